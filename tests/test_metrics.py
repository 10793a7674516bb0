"""Connector metrics: the numbers, and a running instance's Prometheus endpoint over HTTP."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import yaml

from kvxfer.config import load_instance_config, load_launch_config
from kvxfer.engine.launcher import _addr, make_workload, run_workload, started, wait_ready
from kvxfer.integrations.vllm_pd import free_port
from kvxfer.metrics import BusyClock, ConnectorMetrics, Histogram

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_busy_time_is_the_union_of_overlapping_loads() -> None:
    clock = FakeClock()
    busy = BusyClock(clock)
    busy.start()  # load A: 0..4
    clock.now = 1.0
    busy.start()  # load B: 1..3 (inside A)
    clock.now = 3.0
    busy.stop()
    clock.now = 4.0
    busy.stop()
    clock.now = 10.0  # idle
    busy.start()  # load C: 10..12
    clock.now = 12.0
    busy.stop()
    assert busy.busy_s() == 6.0  # not 4 + 2 + 2 = 8


def test_throughput_divides_bytes_by_busy_time_not_summed_durations() -> None:
    clock = FakeClock()
    m = ConnectorMetrics("d", 0, "tcp", clock)
    m.load_started()
    m.load_started()
    clock.now = 2.0
    m.load_finished(2.0, 2_000_000_000)
    m.load_finished(2.0, 2_000_000_000)
    s = m.snapshot()
    assert s["bytes_received"] == 4e9 and s["busy_s"] == 2.0
    assert s["throughput_gbps"] == 2.0  # summed durations would say 1.0
    m.load_started()
    m.load_finished(0.5, error="peer died", timed_out=True)
    s = m.snapshot()
    assert (s["loads_ok"], s["loads_failed"], s["load_timeouts"]) == (2, 1, 1)


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.count == 4 and abs(h.sum - 3.65) < 1e-12


def _free_port() -> int:
    return free_port()


def _metric(text: str, name: str, engine: str) -> float:
    total = 0.0
    for m in re.finditer(rf'^{name}\{{([^}}]*)\}} (\S+)$', text, re.M):
        if f'engine="{engine}"' in m.group(1):
            total += float(m.group(2))
    return total


def test_a_running_instance_exports_the_bytes_of_a_known_transfer(tmp_path: Path) -> None:
    ports = {"prefill": _free_port(), "decode": _free_port()}
    paths = []
    for role in ("prefill", "decode"):
        data = yaml.safe_load((CONFIGS / f"{role}.yaml").read_text())
        data["server"]["metrics_port"] = ports[role]
        (tmp_path / f"{role}.yaml").write_text(yaml.safe_dump(data))
        paths.append(str(tmp_path / f"{role}.yaml"))
    launch = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    launch.update(instances=paths, workload={"num_requests": 3, "prompt_tokens": 100, "output_tokens": 3, "seed": 9})
    lpath = tmp_path / "launch.yaml"
    lpath.write_text(yaml.safe_dump(launch))
    cfg = load_launch_config(lpath)
    pcfg, dcfg = (load_instance_config(p) for p in paths)
    with started(tmp_path / "logs") as run:
        targets = [(run.start(c.engine_id, ["serve", p]), _addr(c.server.host, c.server.port))
                   for c, p in zip((pcfg, dcfg), paths, strict=True)]
        targets.append((run.start("router", ["route", str(lpath)]), _addr(cfg.router.host, cfg.router.port)))
        wait_ready(run, targets, 120)
        results = run_workload(_addr(cfg.router.host, cfg.router.port), make_workload(cfg, 1024), 120, "metrics")
        assert all(r.result.loaded and not r.result.error for r in results.values())
        moved = sum(r.result.kv_bytes for r in results.values())
        assert moved == 3 * 100 * 4 * 2 * 2 * 32 * 4  # tokens x layers x K,V x kv heads x head size x float32
        text = urllib.request.urlopen(f"http://127.0.0.1:{ports['decode']}/metrics", timeout=10).read().decode()
        assert _metric(text, "kvxfer_bytes_received_total", "decode-0") == moved
        assert _metric(text, "kvxfer_loads_ok_total", "decode-0") == 3
        assert _metric(text, "kvxfer_loads_failed_total", "decode-0") == 0
        assert _metric(text, "kvxfer_transfer_seconds_count", "decode-0") == 3
        assert _metric(text, "kvxfer_handshakes_total", "decode-0") == 1
        assert _metric(text, "kvxfer_throughput_gbps", "decode-0") > 0
        ptext = urllib.request.urlopen(f"http://127.0.0.1:{ports['prefill']}/metrics", timeout=10).read().decode()
        assert "kvxfer_held_blocks" in ptext and _metric(ptext, "kvxfer_refused_reads_total", "prefill-0") == 0
