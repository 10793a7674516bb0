"""How the producer's RMA worker is progressed, against how long one-sided gets take.

Why: with the ucx plane's transports on one host (no CMA), UCX emulates a get on the producer's
worker and the data goes through a bounded shared-memory FIFO that the producer refills as the
consumer drains it. ucxx's native progress thread in blocking mode (``native``) sleeps in epoll
between refills; ``adaptive`` (connectors/ucx/rma_progress.py, what a transfer agent uses) polls
for 1 ms after each event first. The difference shows when the host's other CPUs are idle (a VM
vCPU that halts makes each wake-up a VM exit) and not when they are busy, so each mode runs with
the CPUs otherwise idle and beside ``--spinners`` processes that spin calling sched_yield, pinned
one per CPU (as vLLM's CPU workers busy-poll their own core).

One process pair per mode and background, in one run; the baseline, in the same run, is the
consumer copying the same bytes within its own memory (memcpy). Bytes are checked after each
mode. Prints a table, writes JSON.

    python benchmarks/rma_progress.py --json benchmarks/results/issue16/session18/rma_progress.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

UCX_TLS = "^cma,cuda_ipc,cuda_copy,gdr_copy"  # the ucx plane's default set (connectors/ucx DEFAULT_TLS)
GET_TIMEOUT_S = 10.0


def _spinner(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        os.sched_yield()


def _producer(conn: Any, mode: str, size: int) -> None:
    os.environ["UCX_TLS"] = UCX_TLS
    from kvxfer.connectors.ucx.rma import map_region
    from kvxfer.connectors.ucx.rma_progress import AdaptiveRmaProgress
    from kvxfer.connectors.ucx.runtime import RMA_EPOLL_TIMEOUT_MS
    from ucxx._lib import libucxx as ux

    ctx = ux.UCXContext()
    worker = ux.UCXWorker(ctx, enable_delayed_submission=False, enable_python_future=False)
    cache = np.arange(size // 8, dtype=np.uint64).view(np.uint8)
    key = map_region(ctx.handle, cache.ctypes.data, size)
    if mode == "adaptive":
        AdaptiveRmaProgress(wake_s=RMA_EPOLL_TIMEOUT_MS / 1000).add(worker)
    else:
        worker.start_progress_thread(polling_mode=False, epoll_timeout=RMA_EPOLL_TIMEOUT_MS)
    conn.send((worker.address.tobytes(), key.rkey, cache.ctypes.data))
    conn.poll(600)
    os._exit(0)  # the progress threads go with the process


def measure(mode: str, spinners: int, size: int, gets: int, reps: int, gap_s: float) -> dict[str, Any]:
    """One producer process progressed as ``mode``, this process reading from it."""
    ctx = mp.get_context("spawn")
    spins = [ctx.Process(target=_spinner, args=(i % os.cpu_count(),), daemon=True)  # type: ignore[operator]
             for i in range(spinners)]
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(theirs, mode, size), daemon=True)
    try:
        for s in spins:
            s.start()
        proc.start()
        if not ours.poll(120):
            raise TimeoutError("the producer did not start within 120 s")
        address, rkey, base = ours.recv()
        from kvxfer.connectors.ucx.rma import Getter, RemoteKey
        from ucxx._lib import libucxx as ux

        worker = ux.UCXWorker(ux.UCXContext(), enable_delayed_submission=False, enable_python_future=False)
        ep = ux.UCXEndpoint.create_from_worker_address(worker, ux.UCXAddress.create_from_buffer(address), False)
        key = RemoteKey(ep.handle, rkey)
        getter = Getter(ep.handle)

        def wait(req: Any) -> None:  # the consumer as the plane's loop spins while a read is in flight
            end = time.monotonic() + GET_TIMEOUT_S
            while not getter.done(req):
                worker.progress()
                os.sched_yield()
                if time.monotonic() > end:
                    raise TimeoutError(f"{mode}: gets unfinished after {GET_TIMEOUT_S:g} s")

        wait(getter.flush())
        local = np.zeros(size, dtype=np.uint8)
        piece = size // gets
        at = np.arange(gets, dtype=np.uint64) * np.uint64(piece)
        handles = np.full(gets, key.handle, dtype=np.uint64)
        times = []
        for _ in range(reps):
            local[:] = 0
            t = time.perf_counter()
            getter.get_pieces(handles, at + np.uint64(local.ctypes.data), at + np.uint64(base),
                              np.full(gets, piece, dtype=np.uint64))
            wait(getter.flush())
            times.append(time.perf_counter() - t)
            time.sleep(gap_s)  # spaced, as loads are: the producer's thread goes back to sleep between them
        want = np.arange(size // 8, dtype=np.uint64).view(np.uint8)
        if not np.array_equal(local, want):
            raise AssertionError(f"{mode}: the bytes that arrived differ from the producer's")
        key.close()
        return _row(mode, spinners, size, times)
    finally:
        ours.send("stop")
        for p in (*spins, proc):
            p.kill()
            p.join(10)


def memcpy(spinners: int, size: int, reps: int, gap_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    spins = [ctx.Process(target=_spinner, args=(i % os.cpu_count(),), daemon=True)  # type: ignore[operator]
             for i in range(spinners)]
    for s in spins:
        s.start()
    try:
        src = np.arange(size // 8, dtype=np.uint64).view(np.uint8)
        dst = np.zeros(size, dtype=np.uint8)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t)
            time.sleep(gap_s)
        return _row("memcpy", spinners, size, times)
    finally:
        for s in spins:
            s.kill()
            s.join(10)


def _row(mode: str, spinners: int, size: int, times: list[float]) -> dict[str, Any]:
    ms = np.array(times) * 1e3
    return {"mode": mode, "spinners": spinners, "bytes": size, "reps": len(ms), "p50_ms": float(np.median(ms)),
            "p90_ms": float(np.percentile(ms, 90)), "max_ms": float(ms.max()),
            "gbps_p50": size / (float(np.median(ms)) / 1e3) / 1e9}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=16, help="bytes per read, in MiB")
    ap.add_argument("--gets", type=int, default=8, help="gets per read (pieces of equal size)")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--gap-ms", type=float, default=50.0, help="pause between reads (the CPUs go idle meanwhile)")
    ap.add_argument("--spinners", type=int, default=os.cpu_count() or 2,
                    help="spinning processes in the busy rows (default: one per CPU)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.mib < 1 or args.gets < 1 or args.reps < 1 or args.spinners < 1:
        ap.error("--mib, --gets, --reps and --spinners must be at least 1")
    size = args.mib << 20
    rows = []
    for spinners in (0, args.spinners):
        rows.append(memcpy(spinners, size, args.reps, args.gap_ms / 1e3))
        for mode in ("native", "adaptive"):
            print(f"{mode}, {spinners} spinners ...", file=sys.stderr, flush=True)
            rows.append(measure(mode, spinners, size, args.gets, args.reps, args.gap_ms / 1e3))
    print(f"{args.mib} MiB as {args.gets} one-sided gets, {args.reps} reads spaced {args.gap_ms:g} ms, "
          f"UCX_TLS={UCX_TLS}; baseline memcpy in the same run")
    print(f"{'progress':<10} {'other CPUs':<27} {'p50 ms':>8} {'p90 ms':>8} {'max ms':>8} {'GB/s p50':>9} "
          f"{'x memcpy':>9}")
    for r in rows:
        base = next(b for b in rows if b["mode"] == "memcpy" and b["spinners"] == r["spinners"])
        r["ratio_to_memcpy"] = r["p50_ms"] / base["p50_ms"]
        where = "idle" if not r["spinners"] else f"{r['spinners']} spinners (sched_yield)"
        print(f"{r['mode']:<10} {where:<27} {r['p50_ms']:8.2f} {r['p90_ms']:8.2f} {r['max_ms']:8.2f} "
              f"{r['gbps_p50']:9.2f} {r['ratio_to_memcpy']:9.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"mib": args.mib, "gets": args.gets, "reps": args.reps, "gap_ms": args.gap_ms,
                                         "tls": UCX_TLS,
                                         "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
