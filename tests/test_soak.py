"""Load: a few thousand requests of random sizes, a fifth of them cancelled at random
moments, through one prefill and one decode instance (real processes, loopback), for each
connector. Afterwards every block is back in both pools, and the processes' open files,
threads and resident memory are back within a small bound of where they stood after a
warm-up."""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import yaml
import zmq

from kvxfer.config import load_instance_config, load_launch_config
from kvxfer.engine import messages as m
from kvxfer.engine.launcher import _addr, check_blocks, started, wait_ready
from kvxfer.engine.router import RoutedGenerated

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
REQUESTS, WARMUP, CANCEL_SHARE, WINDOW = 2000, 150, 0.2, 64
DEADLINE_S = 900.0


def usage(pid: int) -> dict[str, int]:
    proc = Path("/proc") / str(pid)
    status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
    return {"fds": len(os.listdir(proc / "fd")), "threads": int(status["Threads"]),
            "rss_kib": int(status["VmRSS"].split()[0])}


def drive(addr: str, rng: np.random.Generator, n: int, prefix: str, vocab: int) -> dict[str, str]:
    """Keep up to WINDOW requests in flight; cancel a fifth of them at a random point of their
    life (still queued, prefilling, held, loading or decoding). Returns id -> outcome."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    outcome: dict[str, str] = {}
    inflight: list[str] = []
    to_cancel: dict[str, int] = {}  # id -> cancel after this many more replies arrive
    sent = 0
    deadline = time.monotonic() + DEADLINE_S
    try:
        while len(outcome) < n:
            while sent < n and len(inflight) < WINDOW:
                rid = f"{prefix}-{sent}"
                prompt = rng.integers(0, vocab, int(rng.integers(8, 300))).tolist()
                s.send_multipart([b"", m.encode(m.Generate(request_id=rid, prompt=prompt,
                                                           max_tokens=int(rng.integers(1, 12))))])
                if rng.random() < CANCEL_SHARE:
                    to_cancel[rid] = int(rng.integers(0, 8))
                inflight.append(rid)
                sent += 1
            for rid, after in list(to_cancel.items()):
                if after <= 0:
                    s.send_multipart([b"", m.encode(m.Cancel(request_id=rid))])
                    del to_cancel[rid]
            assert time.monotonic() < deadline, f"{n - len(outcome)} requests unanswered after {DEADLINE_S:g}s"
            if not s.poll(1000):
                continue
            r = msgspec.msgpack.decode(s.recv_multipart()[-1], type=RoutedGenerated).result
            outcome[r.request_id] = r.error or "ok"
            inflight.remove(r.request_id)
            to_cancel.pop(r.request_id, None)
            for rid in to_cancel:
                to_cancel[rid] -= 1
    finally:
        s.close(linger=0)
    return outcome


@pytest.mark.parametrize("name", ["demo.yaml", "ucx.yaml"])
def test_soak_with_cancellations_leaves_nothing_behind(tmp_path: Path, name: str) -> None:
    data = yaml.safe_load((REPO / "configs" / name).read_text())
    data["instances"] = [str(REPO / "configs" / p) for p in data["instances"]]
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    launch = load_launch_config(path)
    pcfg, dcfg = (load_instance_config(p) for p in launch.instances)
    router_addr = _addr(launch.router.host, launch.router.port)
    rng = np.random.default_rng(7)
    with started(tmp_path / "logs") as run:
        children = [run.start(c.engine_id, ["serve", p]) for c, p in zip((pcfg, dcfg), launch.instances, strict=True)]
        router = run.start("router", ["route", str(path)])
        wait_ready(run, [(children[0], _addr(pcfg.server.host, pcfg.server.port)),
                         (children[1], _addr(dcfg.server.host, dcfg.server.port)), (router, router_addr)], 120)
        warm = drive(router_addr, rng, WARMUP, "warm", pcfg.model.vocab_size)
        assert set(warm.values()) <= {"ok", "cancelled"}, warm
        assert check_blocks([pcfg, dcfg]) == []
        before = {c.name: usage(c.proc.pid) for c in [*children, router]}
        t0 = time.monotonic()
        out = drive(router_addr, rng, REQUESTS, "soak", pcfg.model.vocab_size)
        elapsed = time.monotonic() - t0
        counts = {k: list(out.values()).count(k) for k in set(out.values())}
        assert set(counts) == {"ok", "cancelled"}, counts  # nothing failed
        assert counts["cancelled"] > REQUESTS * CANCEL_SHARE / 2 and counts["ok"] > REQUESTS / 2, counts
        # every block back in both pools: held KV released, loads finished or abandoned
        assert check_blocks([pcfg, dcfg]) == []
        after = {c.name: usage(c.proc.pid) for c in [*children, router]}
        for proc_name, b in before.items():
            a = after[proc_name]
            assert a["fds"] <= b["fds"] + 4, (proc_name, b, a)
            assert a["threads"] <= b["threads"] + 2, (proc_name, b, a)
            assert a["rss_kib"] <= b["rss_kib"] * 1.2 + 32 * 1024, (proc_name, b, a)
        print(f"soak {name}: {REQUESTS} requests in {elapsed:.1f}s, {counts}; before {before}; after {after}")
