"""``kvxfer bench``: each benchmark runs end to end on a small sweep and writes its table,
JSON and plot (the numbers themselves are not asserted: these machines are noisy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
                assert rec["baseline"] in ("raw socket", "raw ucxx (one message)", "raw ucxx (pieces)")
                assert rec["ratio"] == rec["gbps"] / rec["baseline_gbps"]
    baselines = {x["connector"] for x in recs if x["kind"] == "baseline"}
    assert {"memcpy", "raw socket", "raw ucxx (one message)", "raw ucxx (pieces)"} <= baselines
    for peer in ("nixl", "mooncake"):  # measured when installed; otherwise the table says why not
        measured = [x for x in recs if x["connector"] == peer]
        assert len(measured) == 4 or (peer in data["skipped"] and peer in r.stdout), (peer, data["skipped"])
    assert "local" in data["skipped"]  # in-process only, and said so
    assert "GB/s" in r.stdout and "x memcpy" in r.stdout
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 20_000


def test_bench_transfer_refuses_partial_blocks() -> None:
    r = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "transfer", "--tokens", "10"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 1 and "--tokens: expected multiples of 16" in r.stderr


def test_bench_repack_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "repack.json"
    r = kvxfer("bench", "repack", "--tokens", "256", "--layers", "2", "--repeat", "1", "--json", str(out))
    recs = json.loads(out.read_text())["records"]
    assert len(recs) == 9 and all(x["baseline"] == "memcpy" and x["ratio"] > 0 for x in recs)
    assert "memcpy" in r.stdout


def test_bench_e2e_compares_with_a_monolithic_instance(tmp_path: Path) -> None:
    out, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    r = kvxfer("bench", "e2e", "--prompts", "32", "128", "--requests", "2", "--output", "4", "--json", str(out),
               "--plot", str(png))
    recs = json.loads(out.read_text())["records"]
    assert [x["prompt_tokens"] for x in recs] == [32, 128]
    for x in recs:
        assert x["disaggregated"]["loaded"] == 2  # both requests' KV came over the connector
        assert x["monolithic"]["loaded"] == 0
        assert x["ttft_ratio"] > 0 and x["itl_ratio"] > 0
    assert "TTFT p50" in r.stdout
    assert png.read_bytes()[:8] == PNG
