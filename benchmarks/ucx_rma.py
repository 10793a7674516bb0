"""One-sided UCX gets against the ucx plane's two-sided replies, with the producer idle and busy.

Why: the ucx plane's reads are two-sided (the producer's Python gathers and sends each reply),
so a producer whose Python is busy stalls them (issue 16, items 1 and 5). UCX can read one-sided
(``ucp_get_nbx``; ``connectors/ucx/rma.py``): served by RDMA or CMA hardware paths, or here, with
the ucx plane's transports (no CMA), by UCX's software emulation on the producer's worker, which
a native ucxx progress thread answers without the producer's GIL. This measures both ways in one
process pair and one run, on the same cache layout (a block is ``--pieces`` pieces, one per
layer and K/V, at random places in a cache of ``--cache-mib``), against a local copy of the same
pieces (memcpy), with the producer idle, with a Python thread spinning in it (``spin``: its GIL
taken), and with a spinning process of its own beside the pair (``cpu``: a core taken, no GIL; the
control that tells the two apart on a host with few cores).

Modes: ``memcpy`` (the consumer copies the pieces within its own memory: the floor), ``tag`` (the
plane's way, raw: a request message, the producer's Python gathers the pieces with numpy into a
staging buffer and sends it as one tag message, the consumer scatters it), ``rma`` (one get per
piece, one endpoint flush; the producer's worker has a native progress thread, blocking mode).
Bytes are checked after every round. Each row also has each process's CPU per load (user + system,
all threads: the consumer's includes its polling while it waits, a spinning producer's includes the
spinner; read the idle rows for what a load costs). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

PIECE = 32 << 10
TAG_REQUEST, TAG_REPLY = 1, 2
STATES = ("idle", "spin", "cpu")  # the producer: idle, a Python thread spinning in it, a spinning process beside
UCX_TLS = "^cma,cuda_ipc,cuda_copy,gdr_copy"  # the ucx plane's default set (connectors/ucx DEFAULT_TLS)


def _env() -> None:
    os.environ.setdefault("UCX_TLS", UCX_TLS)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def fill(n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)


def offsets(ids: np.ndarray, pieces: int, num_blocks: int) -> np.ndarray:
    """Byte offsets of every piece of blocks ``ids`` (piece j of block b at (j * num_blocks + b) * PIECE)."""
    return ((np.arange(pieces)[:, None] * num_blocks + ids[None, :]) * PIECE).reshape(-1)


def _wait(worker: Any, reqs: list[Any], deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not all(r.completed for r in reqs):
        worker.progress()
        if time.monotonic() > end:
            raise TimeoutError("a ucx request did not complete within 30 s")
    for r in reqs:
        r.check_error()


def producer(conn: Any, cache_bytes: int, pieces: int) -> None:
    _env()
    from kvxfer.connectors.ucx.rma import map_region
    from ucxx._lib import libucxx as ux
    from ucxx._lib.arr import Array

    ctx = ux.UCXContext()
    rma_worker = ux.UCXWorker(ctx)  # gets are served here, by its native progress thread
    tag_worker = ux.UCXWorker(ctx)  # the two-sided replies: progressed by this process's Python
    cache = fill(cache_bytes)
    key = map_region(ctx.handle, cache.ctypes.data, cache_bytes)
    rma_worker.start_progress_thread(polling_mode=False)
    conn.send((rma_worker.address.tobytes(), tag_worker.address.tobytes(), key.rkey, cache.ctypes.data))
    consumer_tag = conn.recv()
    ep = ux.UCXEndpoint.create_from_worker_address(tag_worker, ux.UCXAddress.create_from_buffer(consumer_tag), False)
    num_blocks = cache_bytes // (pieces * PIECE)
    staging = np.empty(64 * pieces * PIECE, dtype=np.uint8)
    request = np.zeros(65, dtype=np.int64)
    spinning = threading.Event()

    def spin() -> None:
        while spinning.is_set():
            pass

    while True:
        if not conn.poll(600):  # the consumer times every round well within this
            break
        cmd = conn.recv()
        if cmd == "stop":
            break
        if cmd == "spin":
            spinning.set()
            threading.Thread(target=spin, daemon=True).start()
        elif cmd == "idle":
            spinning.clear()
        elif cmd == "serve":  # tag replies until the consumer sends a request of 0 blocks
            while True:
                r = tag_worker.tag_recv(Array(request), ux.UCXXTag(TAG_REQUEST))
                _wait(tag_worker, [r], 300)
                n = int(request[0])
                if n == 0:
                    break
                offs = offsets(request[1 : 1 + n], pieces, num_blocks)
                view = staging[: len(offs) * PIECE].reshape(-1, PIECE)
                np.take(cache.reshape(-1, PIECE), offs // PIECE, axis=0, out=view)
                _wait(tag_worker, [ep.tag_send(Array(staging[: len(offs) * PIECE]), ux.UCXXTag(TAG_REPLY))])
        conn.send("ok")
    spinning.clear()
    ep.close()  # submitted, not waited for: the consumer no longer progresses its worker
    rma_worker.stop_progress_thread()
    key.close()


class Consumer:
    def __init__(self, conn: Any, cache_bytes: int, pieces: int) -> None:
        from kvxfer.connectors.ucx.rma import Getter, RemoteKey
        from ucxx._lib import libucxx as ux
        from ucxx._lib.arr import Array

        self.ux, self.Array, self.conn, self.pieces = ux, Array, conn, pieces
        self.ctx = ux.UCXContext()
        self.worker = ux.UCXWorker(self.ctx)
        if not conn.poll(120):
            raise RuntimeError("the producer did not start within 120 s")
        rma_addr, tag_addr, rkey, self.remote_base = conn.recv()
        conn.send(self.worker.address.tobytes())
        self.rma_ep = ux.UCXEndpoint.create_from_worker_address(
            self.worker, ux.UCXAddress.create_from_buffer(rma_addr), False)
        self.tag_ep = ux.UCXEndpoint.create_from_worker_address(
            self.worker, ux.UCXAddress.create_from_buffer(tag_addr), False)
        self.key = RemoteKey(self.rma_ep.handle, rkey)
        self.getter = Getter(self.rma_ep.handle)
        self.cache = np.zeros(cache_bytes, dtype=np.uint8)
        self.source = fill(cache_bytes)  # the memcpy mode's source, and what every mode must deliver
        self.staging = np.empty(64 * pieces * PIECE, dtype=np.uint8)
        self.num_blocks = cache_bytes // (pieces * PIECE)
        self.lengths = np.full(64 * pieces, PIECE, dtype=np.uint64)
        self.rkeys = np.full(64 * pieces, self.key.handle, dtype=np.uint64)

    def load(self, mode: str, ids: np.ndarray) -> None:
        offs = offsets(ids, self.pieces, self.num_blocks)
        if mode == "memcpy":  # one memcpy per piece, as a copy within one process would go
            dst, src = self.cache.ctypes.data, self.source.ctypes.data
            for o in offs.tolist():
                ctypes.memmove(dst + o, src + o, PIECE)
        elif mode == "rma":
            local = offs.astype(np.uint64) + np.uint64(self.cache.ctypes.data)
            remote = offs.astype(np.uint64) + np.uint64(self.remote_base)
            self.getter.get_pieces(self.rkeys[: len(offs)], local, remote, self.lengths[: len(offs)])
            req = self.getter.flush()
            end = time.monotonic() + 30
            while not self.getter.done(req):
                self.worker.progress()
                if time.monotonic() > end:
                    raise TimeoutError("the gets did not land within 30 s")
        else:
            ux, Array = self.ux, self.Array
            n = len(offs) * PIECE
            recv = self.worker.tag_recv(Array(self.staging[:n]), ux.UCXXTag(TAG_REPLY))
            request = np.zeros(65, dtype=np.int64)
            request[0], request[1 : 1 + len(ids)] = len(ids), ids
            _wait(self.worker, [self.tag_ep.tag_send(Array(request), ux.UCXXTag(TAG_REQUEST)), recv])
            self.cache.reshape(-1, PIECE)[offs // PIECE] = self.staging[:n].reshape(-1, PIECE)

    def command(self, cmd: str) -> None:
        self.conn.send(cmd)
        if cmd not in ("serve", "stop"):  # serve: answered after the round's end request
            self._answer()

    def _answer(self) -> None:
        if not self.conn.poll(60) or self.conn.recv() != "ok":
            raise RuntimeError("the producer did not answer within 60 s")

    def end_serving(self) -> None:
        ux, Array = self.ux, self.Array
        _wait(self.worker, [self.tag_ep.tag_send(Array(np.zeros(65, dtype=np.int64)), ux.UCXXTag(TAG_REQUEST))])
        self._answer()

    def round(self, mode: str, blocks: int, loads: int, rng: np.random.Generator) -> list[float]:
        if mode == "tag":
            self.command("serve")
        self.cache[:] = 0
        times = []
        try:
            for _ in range(loads):
                ids = rng.choice(self.num_blocks, blocks, replace=False)
                t0 = time.perf_counter()
                self.load(mode, ids)
                times.append(time.perf_counter() - t0)
        finally:
            if mode == "tag":
                self.end_serving()
        offs = offsets(ids, self.pieces, self.num_blocks) // PIECE
        if not np.array_equal(self.cache.reshape(-1, PIECE)[offs], self.source.reshape(-1, PIECE)[offs]):
            raise AssertionError(f"{mode}: the bytes that arrived differ from the producer's")
        return times


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, all its threads (a spinning thread's included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _p50s(rows: list[dict[str, Any]], producer: str, blocks: int, mode: str) -> list[float]:
    return [x["p50_us"] for x in rows if (x["producer"], x["blocks"], x["mode"]) == (producer, blocks, mode)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 8], help="blocks per load (at most 64)")
    ap.add_argument("--pieces", type=int, default=64, help="pieces of 32 KiB per block (layers x K/V)")
    ap.add_argument("--cache-mib", type=int, default=256)
    ap.add_argument("--loads", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["memcpy", "tag", "rma"], choices=["memcpy", "tag", "rma"])
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if not all(1 <= b <= 64 for b in a.blocks):
        ap.error(f"--blocks: each must be 1-64, got {a.blocks}")
    cache_bytes = a.cache_mib << 20
    if cache_bytes // (a.pieces * PIECE) < max(a.blocks):
        ap.error(f"--cache-mib {a.cache_mib} holds fewer than {max(a.blocks)} blocks of {a.pieces} pieces")
    _env()
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(theirs, cache_bytes, a.pieces), daemon=True)
    proc.start()
    rows: list[dict[str, Any]] = []
    try:
        c = Consumer(ours, cache_bytes, a.pieces)
        rng = np.random.default_rng(0)
        for mode in a.modes:  # warm-up: endpoints wired, pages touched
            c.round(mode, 1, 20, rng)
        for r in range(a.rounds):
            for busy in STATES:
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy == "cpu" else None
                c.command("spin" if busy == "spin" else "idle")
                for blocks in a.blocks:
                    for mode in a.modes:
                        cpu0 = (time.process_time(), process_cpu_s(proc.pid))
                        t = np.array(c.round(mode, blocks, a.loads, rng))
                        cpu = [(time.process_time() - cpu0[0]) * 1e6 / a.loads,
                               (process_cpu_s(proc.pid) - cpu0[1]) * 1e6 / a.loads]
                        nbytes = blocks * a.pieces * PIECE
                        row = {"round": r, "producer": busy, "mode": mode, "blocks": blocks, "bytes": nbytes,
                               "p50_us": float(np.median(t) * 1e6), "p90_us": float(np.percentile(t, 90) * 1e6),
                               "mean_us": float(t.mean() * 1e6), "gbps_p50": nbytes / float(np.median(t)) / 1e9,
                               "consumer_cpu_us_per_load": cpu[0], "producer_cpu_us_per_load": cpu[1]}
                        rows.append(row)
                        print(f"round {r} producer {busy:4} {blocks:2} block(s) {mode:6} p50 {row['p50_us']:8.0f} us "
                              f"p90 {row['p90_us']:8.0f} us  {row['gbps_p50']:6.2f} GB/s  cpu per load: consumer "
                              f"{cpu[0]:6.0f} us, producer {cpu[1]:6.0f} us", flush=True)
                if hog is not None:
                    hog.kill()
                    hog.wait(10)
            c.command("idle")
        for ep in (c.rma_ep, c.tag_ep):  # closed without waiting for the producer, which stops next
            ep.close()
            ep.remove_close_callback()
        c.command("stop")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    print("\nmedian over rounds (p50 us; ratio to memcpy in the same round and producer state)")
    print(f"{'producer':8} {'blocks':>6} " + " ".join(f"{m:>14}" for m in a.modes))
    summary: list[dict[str, Any]] = []
    for busy in STATES:
        for blocks in a.blocks:
            cells = []
            for mode in a.modes:
                base = _p50s(rows, busy, blocks, "memcpy")
                med = float(np.median(_p50s(rows, busy, blocks, mode)))
                ratio = med / float(np.median(base)) if base else float("nan")
                summary.append({"producer": busy, "blocks": blocks, "mode": mode, "p50_us": med, "vs_memcpy": ratio})
                cells.append(f"{med:7.0f} ({ratio:4.1f}x)")
            print(f"{busy:8} {blocks:6} " + " ".join(f"{x:>14}" for x in cells))
    for blocks in a.blocks:
        for mode in a.modes:
            idle, spin, cpu = (_p50s(summary, busy, blocks, mode)[0] for busy in STATES)
            print(f"busy/idle speed, {blocks} block(s), {mode}: {idle / spin:.2f} (spinning process: {idle / cpu:.2f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "ucx_tls": os.environ.get("UCX_TLS"), "rows": rows, "summary": summary}, f,
                      indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
