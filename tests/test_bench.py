"""``kvxfer bench``: each benchmark runs end to end on a small sweep and writes its table,
JSON and plot (the numbers themselves are not asserted: these machines are noisy)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvxfer.bench.e2e import run_order
from kvxfer.bench.peers import PEERS, SAME_WIRE
from kvxfer.bench.transfer import STAGES, bench_cache, check_arrived, make_cfg, stage_breakdown
from kvxfer.connector import Connector
from kvxfer.metrics import ConnectorMetrics

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
FIELDS = {"connector", "pattern", "bytes", "gbps", "p50_us", "p99_us", "baseline", "baseline_gbps", "ratio"}


def kvxfer(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "kvxfer", *args], capture_output=True, text=True, timeout=timeout,
                       cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_bench_transfer_with_peers_writes_table_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    r = kvxfer("bench", "transfer", "--peers", "--tokens", "16", "64", "--budget-s", "0.05", "--json", str(out),
               "--plot", str(png))
    data = json.loads(out.read_text())
    recs = data["records"]
    connectors = {x["connector"] for x in recs if x["kind"] == "connector"}
    assert {"tcp", "ucx"} <= connectors  # every installed cross-process data plane
    for name in connectors:
        for pat in ("contiguous", "random"):
            for tokens in (16, 64):
                (rec,) = [x for x in recs if (x["connector"], x["pattern"], x["tokens"]) == (name, pat, tokens)]
                assert set(rec) >= FIELDS and rec["gbps"] > 0 and rec["bytes"] == tokens // 16 * 2**21
                assert rec["baseline"] == {"tcp": "raw socket (spliced)", "cma": "raw socket"}.get(
                    name, "raw ucxx (pieces)" if pat == "random" else "raw ucxx (one message)")
                assert rec["ratio"] == rec["gbps"] / rec["baseline_gbps"]
    baselines = {x["connector"] for x in recs if x["kind"] == "baseline"}
    assert {"memcpy", "raw socket", "raw socket (spliced)", "raw ucxx (one message)", "raw ucxx (pieces)"} <= baselines
    for peer in PEERS:  # measured when installed; otherwise the table says why not
        measured = [x for x in recs if x["connector"] == peer]
        assert len(measured) == 4 or (peer in data["skipped"] and peer in r.stdout), (peer, data["skipped"])
    same = {(c["connector"], c["pattern"], c["tokens"]): c for c in data["against_nixl"] if c["against"] == "same wire"}
    for name in connectors:  # each plane against NIXL on its own transports, where that NIXL ran
        peer = SAME_WIRE[name]
        if peer in data["skipped"]:
            continue
        for pat in ("contiguous", "random"):
            for tokens in (16, 64):
                mine = next(x for x in recs if (x["connector"], x["pattern"], x["tokens"]) == (name, pat, tokens))
                theirs = next(x for x in recs if (x["connector"], x["pattern"], x["tokens"]) == (peer, pat, tokens))
                c = same[(name, pat, tokens)]
                assert c["peer"] == peer and c["p50_ratio"] == mine["p50_us"] / theirs["p50_us"]
                assert c["gbps_ratio"] == mine["gbps"] / theirs["gbps"]
    if same:
        assert "kvxfer against NIXL" in r.stdout
    assert "local" in data["skipped"]  # in-process only, and said so
    assert "GB/s" in r.stdout and "x memcpy" in r.stdout
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 20_000


def test_a_ucx_bench_run_ends_without_ucx_errors() -> None:
    """Each side closes its ucx endpoints while the other still runs (a consumer's bye closes the
    producer's endpoint to it; the bench closes its own side before it stops the producer): closed
    after its peer exited, an endpoint's flush fails and UCX prints an error, which a clean shutdown
    must not show."""
    r = kvxfer("bench", "transfer", "--connectors", "ucx", "--tokens", "16", "--patterns", "random",
               "--budget-s", "0.05")
    out = r.stdout + r.stderr  # UCX logs to stdout
    assert "error during flush" not in out and "Error while closing endpoint" not in out, out[-3000:]


def test_bench_transfer_refuses_partial_blocks() -> None:
    r = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "transfer", "--tokens", "10"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 1 and "--tokens: expected multiples of 16" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "transfer", "--gap-ms", "-1"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 1 and "--gap-ms: expected >= 0, got -1" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "transfer", "--rounds", "0"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 1 and "--rounds: expected at least 1, got 0" in r.stderr


def test_spaced_trials_start_after_the_gap_which_the_budget_does_not_count() -> None:
    """--gap-ms: each timed trial starts at least the gap after the previous one ended, and
    the budget counts the trials, not the gaps (a budget as long as one gap still gets many trials)."""
    from kvxfer.bench.transfer_cases import timed

    spans: list[tuple[float, float]] = []

    def trial() -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.001:
            pass
        spans.append((t0, time.monotonic()))

    times = timed(trial, 0.02, min_trials=1, gap_s=0.02)
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(spans)]  # spans[0] is the warm-up
    assert len(times) >= 3 and all(g >= 0.02 for g in gaps), gaps


def test_bench_repack_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "repack.json"
    r = kvxfer("bench", "repack", "--tokens", "256", "--layers", "2", "--repeat", "1", "--json", str(out))
    recs = json.loads(out.read_text())["records"]
    assert len(recs) == 9 and all(x["baseline"] == "memcpy" and x["ratio"] > 0 for x in recs)
    assert "memcpy" in r.stdout


def test_the_busy_engine_script_alternates_idle_and_busy_rounds_and_refuses_a_zero_interval(tmp_path: Path) -> None:
    out = tmp_path / "busy.json"
    script = str(REPO / "benchmarks" / "busy_engine_gil.py")
    r = subprocess.run([sys.executable, script, "--plane", "cma", "--loads", "3", "--rounds", "1", "--switch-ms", "4",
                        "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["switch_interval_s"] == 0.004 and got["plane"] == "cma"
    assert [row["busy"] for row in got["rows"]] == ["idle", "thread", "process"]
    assert all(row["loads"] == 3 and 0 < row["p10_us"] <= row["p50_us"] <= row["p90_us"] for row in got["rows"])
    assert "busy/idle p50 (thread)" in r.stdout
    bad = subprocess.run([sys.executable, script, "--switch-ms", "0"], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert bad.returncode == 2 and "--switch-ms must be > 0, got 0" in bad.stderr


def test_the_cma_floor_script_checks_the_block_it_reads_in_both_memories(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    script = str(REPO / "benchmarks" / "cma_floor.py")
    r = subprocess.run([sys.executable, script, "--trials", "5", "--rounds", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    reads = ["process_vm_readv", "nixl"] if importlib.util.find_spec("nixl_cu12") else ["process_vm_readv"]
    assert [(x["memory"], x["read"]) for x in rows] == [(m, k) for m in ("anon", "shm") for k in reads]
    assert all(x["trials"] == 5 and 0 < x["p10_us"] <= x["p50_us"] <= x["p90_us"] for x in rows)
    if len(reads) == 1:
        assert "nixl: not installed" in r.stdout
    bad = subprocess.run([sys.executable, script, "--trials", "0"], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert bad.returncode == 2 and "--trials and --rounds must be >= 1, got 0 and 2" in bad.stderr


def test_the_ucx_rma_script_checks_bytes_in_every_mode_and_producer_state(tmp_path: Path) -> None:
    out = tmp_path / "rma.json"
    script = str(REPO / "benchmarks" / "ucx_rma.py")
    r = subprocess.run([sys.executable, script, "--blocks", "1", "2", "--loads", "3", "--rounds", "1",
                        "--cache-mib", "16", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    keys = {(x["producer"], x["blocks"], x["mode"]) for x in got["rows"]}
    assert keys == {(p, b, m) for p in ("idle", "spin", "cpu") for b in (1, 2) for m in ("memcpy", "tag", "rma")}
    assert all(x["bytes"] == x["blocks"] * 64 * (32 << 10) and 0 < x["p50_us"] <= x["p90_us"] for x in got["rows"])
    assert "busy/idle speed, 2 block(s), rma" in r.stdout
    bad = subprocess.run([sys.executable, script, "--blocks", "65"], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert bad.returncode == 2 and "--blocks: each must be 1-64, got [65]" in bad.stderr


def test_the_rma_progress_script_checks_bytes_for_each_progress_mode_idle_and_beside_spinners(tmp_path: Path) -> None:
    out = tmp_path / "rma_progress.json"
    script = str(REPO / "benchmarks" / "rma_progress.py")
    r = subprocess.run([sys.executable, script, "--mib", "1", "--reps", "2", "--spinners", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(x["mode"], x["spinners"]) for x in rows} == {(m, s) for m in ("memcpy", "native", "adaptive")
                                                          for s in (0, 1)}
    assert all(x["bytes"] == 1 << 20 and x["reps"] == 2 and 0 < x["p50_ms"] <= x["max_ms"] for x in rows)
    assert "x memcpy" in r.stdout
    bad = subprocess.run([sys.executable, script, "--reps", "0"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and "must be at least 1" in bad.stderr


def test_bench_e2e_compares_with_a_monolithic_instance(tmp_path: Path) -> None:
    """Two rounds on fresh instances, pooled: both rounds' requests count."""
    out, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    r = kvxfer("bench", "e2e", "--prompts", "32", "128", "--requests", "2", "--rounds", "2", "--output", "4",
               "--json", str(out), "--plot", str(png))
    recs = json.loads(out.read_text())["records"]
    assert [x["prompt_tokens"] for x in recs] == [32, 128]
    for x in recs:
        assert (x["requests"], x["rounds"]) == (4, 2)
        assert x["disaggregated"]["loaded"] == 4  # every request's KV, in both rounds, came over the connector
        assert x["kv_bytes"] == 4 * x["prompt_tokens"] * 4 * 2 * 2 * 32 * 4  # (layers, K/V, heads, head size, fp32)
        assert x["monolithic"]["loaded"] == 0
        assert x["ttft_ratio"] > 0 and x["itl_ratio"] > 0
    assert "TTFT p50" in r.stdout
    assert png.read_bytes()[:8] == PNG


def test_bench_transfer_concurrency_busy_engine_and_stages_on_tcp(tmp_path: Path) -> None:
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    r = kvxfer("bench", "transfer", "--connectors", "tcp", "--tokens", "16", "--patterns", "random", "--budget-s",
               "0.02", "--busy-engine", "--concurrency", "4", "--blocks", "2", "--json", str(out), "--plot", str(png))
    data = json.loads(out.read_text())
    (rec,) = [x for x in data["records"] if x["kind"] == "connector"]
    assert rec["checked"] and rec["poll"] == "wait" == data["poll"]
    stages = rec["stages"]
    assert stages["loads"] >= 3 and all(stages[f"{k}_us"] >= 0 for k in STAGES if f"{k}_us" in stages)
    # --busy-engine: both poll styles (its default), a spinning thread in each process, and the
    # control: a spinning process of its own (a core taken, no GIL)
    busy = data["busy_engine"]
    # the default --rounds 3: each ratio's conditions in three alternating rounds (test_bench_rounds), each
    # round at least 3 trials after its own warm-up, pooled: at least 9 a side
    assert data["rounds"] == 3
    assert sorted((x["poll"], x["busy"]) for x in busy) == [(p, w) for p in ("busy", "wait")
                                                             for w in ("consumer", "cpu", "producer")]
    for x in busy:
        assert x["checked"] and x["connector"] == "tcp" and x["bytes"] == 2**21
        assert x["gbps_ratio"] == x["busy_gbps"] / x["idle_gbps"]
        assert x["p50_ratio"] == x["busy_p50_us"] / x["idle_p50_us"]
        assert x["busy_stages"]["loads"] >= 9 and x["idle_stages"]["loads"] >= 9
        assert x["busy_trials"] >= 9 and x["idle_trials"] >= 9
    (conc,) = data["concurrency"]
    assert conc["checked"] and (conc["requests"], conc["blocks_per_request"], conc["bytes"]) == (4, 2, 8 * 2**21)
    assert conc["ratio"] == conc["gbps"] / conc["single_gbps"] and conc["latency_p99_us"] >= conc["latency_p50_us"] > 0
    assert conc["stages"]["loads"] >= 4 * 9 and conc["single_stages"]["loads"] >= 9
    assert conc["trials"] >= 9 and conc["single_trials"] >= 9
    assert "busy engine" in r.stdout and "concurrency: 4 requests" in r.stdout
    assert png.read_bytes()[:8] == PNG and (tmp_path / "out-busy.png").read_bytes()[:8] == PNG


def test_stats_sum_each_loads_stages() -> None:
    """The stage sums in stats() cover every successful load, and add up to no more than its
    latency (start_load to the poll that returned it)."""
    prod = Connector.from_config(make_cfg("prefill", "local", 4))
    cons = Connector.from_config(make_cfg("decode", "local", 4))
    try:
        prod.register_kv_caches(bench_cache(4, fill=True))
        cache = bench_cache(4, fill=False)
        cons.register_kv_caches(cache)
        before = cons.stats()
        total = 0.0
        for n in range(2):
            params = prod.hold(f"r{n}", [1, 2], 32)
            t0 = time.monotonic()
            cons.start_load(f"r{n}", params, [3, 0])
            while not (f := cons.poll(timeout_s=1.0)):
                assert time.monotonic() - t0 < 30
            total += time.monotonic() - t0
            assert f.receiving == [f"r{n}"]
            check_arrived(cache, np.array([1, 2]), np.array([3, 0]), "local")
        after = cons.stats()
        stages = stage_breakdown(before, after)
        assert stages is not None and stages["loads"] == 2 == after["stage_handoffs"] - before["stage_handoffs"]
        assert all(stages[f"{k}_us"] >= 0 for k in STAGES if f"{k}_us" in stages)
        assert {"queue_us", "plan_us", "transfer_us", "complete_us", "handoff_us"} <= set(stages)
        spent = [after[f"stage_{k}_s"] - before[f"stage_{k}_s"] for k in STAGES if f"stage_{k}_s" in after]
        assert sum(spent) <= total
    finally:
        cons.close()
        prod.close()


def test_metrics_stage_counters() -> None:
    m = ConnectorMetrics("d", 0, "tcp")
    m.load_started()
    m.load_finished(1.0, 10, stages=(0.1, 0.2, 0.3, 0.4))
    m.load_started()
    m.load_finished(1.0, error="peer died")  # failed loads are not in the stage sums
    m.handed_off(1, 0.5)
    s = m.snapshot()
    assert (s["stage_loads"], s["stage_handoffs"]) == (1, 1)
    assert (s["stage_queue_s"], s["stage_plan_s"], s["stage_transfer_s"], s["stage_complete_s"],
            s["stage_handoff_s"]) == (0.1, 0.2, 0.3, 0.4, 0.5)


def test_bench_e2e_alternates_the_order_of_modes_each_round() -> None:
    assert run_order(["pull", "push"], 3) == [(0, "pull"), (0, "push"), (1, "push"), (1, "pull"), (2, "pull"),
                                              (2, "push")]
    assert run_order(["push"], 2) == [(0, "push"), (1, "push")]


def test_bench_e2e_refuses_a_mode_named_twice() -> None:
    r = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "e2e", "--modes", "pull", "pull"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1 and "a mode named twice" in r.stderr


def test_bench_e2e_runs_pull_and_push_on_a_shaped_link(tmp_path: Path) -> None:
    """Both modes, on the unshaped link and on a namespace joined by a veth pair held to 200 Mbit/s
    (root is needed for the namespace; these machines and CI run as root)."""
    out, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    kvxfer("bench", "e2e", "--launch", "configs/push.yaml", "--modes", "pull", "push", "--prompts", "64",
           "--requests", "2", "--output", "3", "--shape-mbit", "200", "--json", str(out), "--plot", str(png))
    data = json.loads(out.read_text())
    recs = data["records"]
    assert {(x["mode"], x["link"]) for x in recs} == {("pull", "unshaped"), ("push", "unshaped"), ("pull", "shaped"),
                                                      ("push", "shaped")}
    for x in recs:
        assert x["disaggregated"]["loaded"] == 2, x  # every prompt's KV came over the connector, in either mode
        assert x["kv_bytes"] == 2 * 64 * 4 * 2 * 2 * 32 * 4  # 64 tokens x (layers, K/V, heads, head size, fp32)
        assert x["ttft_p50_ms"] > 0 and x["ttft_vs_pull"] > 0
    assert [x["shape_mbit"] for x in recs if x["link"] == "shaped"] == [200.0, 200.0]
    assert png.read_bytes()[:8] == PNG


def test_a_bench_variant_row_runs_its_plane_with_the_variants_options() -> None:
    """``--connectors ucx-2s``: the ucx plane with reads: two-sided, beside the default ucx row."""
    from kvxfer.bench.transfer_cases import plane_of

    cfg = make_cfg("decode", "ucx-2s", 8)
    assert (cfg.connector.name, dict(cfg.connector.data_plane)) == ("ucx", {"reads": "two-sided"})
    assert cfg.engine_id == "bench-decode-ucx-2s" and plane_of("ucx-2s") == "ucx" and plane_of("tcp") == "tcp"
    plain = make_cfg("decode", "ucx", 8)
    assert (plain.connector.name, dict(plain.connector.data_plane)) == ("ucx", {})
    native = make_cfg("prefill", "ucx-native", 8)  # the producer's RMA workers on ucxx's native threads
    assert (native.connector.name, dict(native.connector.data_plane)) == ("ucx", {"rma_progress": "native",
                                                                                  "same_host": "ucx"})
    wire = make_cfg("decode", "ucx-nocma", 8)  # UCX's own wire on this host too (the default reads it with CMA)
    assert (wire.connector.name, dict(wire.connector.data_plane)) == ("ucx", {"same_host": "ucx"})


_BURN = """
import sys, time
while time.process_time() < 0.4:  # CPU of its own, however slowly the machine gives it
    pass
print("burnt", flush=True)
time.sleep(60)
"""


def test_session_cpu_counts_the_cpu_of_a_sessions_processes_and_no_other_sessions() -> None:
    """`kvxfer bench vllm`'s CPU columns: a session that burnt 0.4 s of CPU shows about that (/proc
    counts sampled ticks); a session asleep shows less, and none of the other's."""
    from kvxfer.bench.session_cpu import CpuWindow, session_cpu_s

    burner = subprocess.Popen([sys.executable, "-c", _BURN], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        window = CpuWindow((sleeper.pid,)).start()
        assert burner.stdout is not None and burner.stdout.readline().strip() == "burnt"
        burnt = session_cpu_s(burner.pid)
        assert burnt >= 0.35, burnt  # /proc counts in ticks, sampled
        assert session_cpu_s(sleeper.pid) < burnt - 0.2
        assert 0 <= window.cores() < 0.5  # asleep all along (its start-up CPU came before the window)
        assert session_cpu_s(sleeper.pid + 10**7) == 0  # no such session
    finally:
        for p in (burner, sleeper):
            p.kill()
            p.wait(10)


def test_the_vllm_bench_sets_each_kvxfer_plane_against_nixl_on_its_own_transports() -> None:
    """vLLM's documented NIXL setting (``sm``) reads with CMA on one host, as the ucx plane does by
    default (same_host: cma): kvxfer-ucx meets ``nixl``. The rows on UCX's own wire (same_host: ucx,
    CMA out of UCX_TLS: connectors/ucx DEFAULT_TLS) meet NIXL without CMA when that row ran, and
    fall back to ``nixl`` (named in the table's ``vs`` column) only when it did not."""
    from kvxfer.connectors.ucx import DEFAULT_TLS

    from kvxfer.bench.vllm import NIXL_TLS, baseline_of

    assert NIXL_TLS["nixl-nocma"] == DEFAULT_TLS and "cma" not in NIXL_TLS["nixl-tcp"]
    ran = {"nixl", "nixl-cma", "nixl-nocma", "nixl-tcp"}
    rows = ("kvxfer-ucx", "kvxfer-ucx-nocma", "kvxfer-ucx-2s", "kvxfer-cma", "kvxfer-tcp")
    assert {c: baseline_of(c, ran) for c in rows} == {
        "kvxfer-ucx": "nixl", "kvxfer-ucx-nocma": "nixl-nocma", "kvxfer-ucx-2s": "nixl-nocma",
        "kvxfer-cma": "nixl-cma", "kvxfer-tcp": "nixl-tcp"}
    assert baseline_of("kvxfer-ucx-nocma", {"nixl", "nixl-cma"}) == "nixl"
    assert baseline_of("kvxfer-ucx-nocma", {"nixl-tcp"}) is None
