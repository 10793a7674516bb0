"""A busy engine thread and 1-block loads through transfer agents: where the time goes.

A prefill and a decode ``Connector`` with their transfer agents (``data_path: agent``); the decode
engine's thread loads one block (2 MiB) at a time, timed from ``start_load`` to the ``poll()`` (in a
tight loop) that reports it. Rounds alternate: the engine's process idle but for that thread, then
with a second Python thread spinning in pure Python (the bench's ``--busy-engine`` consumer row).
A third kind of round spins in a process of its own (a core taken, no GIL: the ``cpu`` control).

The engine's thread keeps the GIL through ``start_load`` and its polls
(``tests/test_agent.py::test_start_load_and_the_polls_that_see_it_finish_keep_the_gil``), so the
spinning thread gets it only when the interpreter forces a switch (``sys.getswitchinterval()``, 5 ms),
and the engine's thread waits as long to get it back: a load that spans such a switch takes about
5 ms more. The table shows how often that happens (``> 3 ms``), besides the percentiles.

``--switch-ms M`` sets this process's switch interval (``sys.setswitchinterval``) first: what an
engine that shortens it pays per crossing instead.

    python benchmarks/busy_engine_gil.py [--plane cma] [--loads 300] [--rounds 3] [--switch-ms M] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.bench.transfer_cases import Spinner, bench_cache, make_cfg
from kvxfer.connector import Connector

WARM = 20  # loads per round not counted


def one_round(prefill: Any, decode: Any, tag: str, loads: int, busy: str) -> list[float]:
    params = [prefill.hold(f"{tag}{i}", [5], 16) for i in range(loads + WARM)]  # round trips: before the clock
    spinner, cpu = Spinner(), None
    if busy == "thread":
        spinner.set(True)
    elif busy == "process":
        cpu = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.2)
    times: list[float] = []
    try:
        for i, p in enumerate(params):
            t0 = time.perf_counter()
            decode.start_load(p.request_id, p, [9])
            deadline = time.monotonic() + 30
            while not (out := decode.poll()):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"load {p.request_id} not reported in 30 s")
            if out.receiving != [p.request_id]:
                raise RuntimeError(f"load {p.request_id}: {out}")
            if i >= WARM:
                times.append(time.perf_counter() - t0)
    finally:
        spinner.set(False)
        if cpu is not None:
            cpu.kill()
            cpu.wait()
    for _ in range(50):  # the producer's released holds, read so its events do not pile up
        if not prefill.poll(0.02).sending:
            break
    return times


def summary(times: list[float]) -> dict[str, float]:
    a = np.asarray(times) * 1e6
    return {"loads": len(a), "p10_us": float(np.percentile(a, 10)), "p50_us": float(np.percentile(a, 50)),
            "p90_us": float(np.percentile(a, 90)), "mean_us": float(a.mean()), "over_3ms": float(np.mean(a > 3000))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plane", default="cma", choices=["cma", "tcp", "ucx"])
    ap.add_argument("--loads", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--switch-ms", type=float, default=None, help="sys.setswitchinterval for this process, in ms")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.switch_ms is not None:
        if args.switch_ms <= 0:
            ap.error(f"--switch-ms must be > 0, got {args.switch_ms:g}")
        sys.setswitchinterval(args.switch_ms / 1e3)
    plane = f"{args.plane}-noswitch"  # this script sets the interval itself: the connectors leave it
    prefill = Connector.from_config(make_cfg("prefill", plane, 64, "agent"))
    decode = Connector.from_config(make_cfg("decode", plane, 64, "agent"))
    prefill.register_kv_caches(bench_cache(64, fill=True))
    decode.register_kv_caches(bench_cache(64, fill=False))
    rows: list[dict[str, Any]] = []
    print(f"{args.plane}, 1 block (2 MiB) through two agents; switch interval {sys.getswitchinterval() * 1e3:g} ms")
    print(f"{'round':>5} {'busy':8} {'p10 us':>8} {'p50 us':>8} {'p90 us':>8} {'mean us':>8} {'> 3 ms':>7}")
    try:
        decode.start_load("first", prefill.hold("first", [5], 16), [9])  # the handshake
        while not decode.poll(0.05):
            pass
        for rnd in range(args.rounds):
            for busy in ("idle", "thread", "process"):
                s = summary(one_round(prefill, decode, f"{rnd}{busy}", args.loads, busy))
                rows.append({"round": rnd, "busy": busy, **s})
                print(f"{rnd:>5} {busy:8} {s['p10_us']:8.0f} {s['p50_us']:8.0f} {s['p90_us']:8.0f} "
                      f"{s['mean_us']:8.0f} {s['over_3ms']:7.2f}")
    finally:
        decode.close()
        prefill.close()
    for busy in ("thread", "process"):
        ratio = [b["p50_us"] / i["p50_us"] for i, b in zip((r for r in rows if r["busy"] == "idle"),
                                                          (r for r in rows if r["busy"] == busy), strict=True)]
        print(f"busy/idle p50 ({busy}): " + ", ".join(f"{x:.2f}" for x in ratio))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                         "cpus": len(os.sched_getaffinity(0)),
                                         "plane": args.plane, "switch_interval_s": sys.getswitchinterval(),
                                         "loads": args.loads, "rows": rows}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
