"""The tcp plane's two ways to serve a Unix socket: sendmsg (two copies) against spliced pages (one).

Why: on one host the tcp plane's connection is a Unix socket; ``sendmsg`` copies every byte into
the socket's buffers in the producer and ``recvmsg_into`` copies it out in the consumer, so a read
costs two copies in two processes, which a busy host serialises on its free cores (issue 16,
item 1). ``unix_send: splice`` (``connectors/tcp/splice.py``) hands the socket references to the
producer's pages: the consumer's receive is the only copy. This runs both with the plane's own
send code (``send_pieces``, ``Splicer``) in one process pair and one run, on the plane's layout (a
block is ``--pieces`` pieces of 32 KiB at random places in a cache of ``--cache-mib``), against a
copy of the same pieces within one process (memcpy), with the pair idle and with a spinning process
beside it (``cpu``: a core taken, as a busy engine's thread takes one beside its transfer agent).
Each row has p50 per load and the CPU per load of the thread that sends and of the one that
receives (user + system; the kernel's copies count where they run). Bytes are checked after every
round. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import struct
import sys
import tempfile
import time
from typing import Any

import numpy as np
from kvxfer.connectors.tcp import UNIX_SNDBUF, recv_pieces, send_pieces
from kvxfer.connectors.tcp.splice import Splicer, splice_works

PIECE = 32 << 10
STATES = ("idle", "cpu")
_HDR = struct.Struct("!q")


def cache(mib: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, mib << 20, dtype=np.uint8)


def spin(stop: Any) -> None:
    while not stop.is_set():
        pass


def cpu_s() -> float:
    return time.thread_time()


def producer(path: str, mode: str, mib: int) -> None:
    """Serve loads until a zero-piece request: each request is its pieces' offsets (int64)."""
    src = cache(mib, 1)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
    splicer = Splicer() if mode == "splice" else None
    view = memoryview(src)
    lengths = np.empty(0, np.int64)
    used = 0.0
    while True:
        (n,) = _HDR.unpack(conn.recv(8, socket.MSG_WAITALL))
        if n == 0:
            break
        offsets = np.frombuffer(conn.recv(8 * n, socket.MSG_WAITALL), np.int64)
        t0 = cpu_s()
        if len(lengths) != n:
            lengths = np.full(n, PIECE, np.int64)
        if splicer is not None:
            splicer.send(conn, src.ctypes.data + offsets, lengths)
        else:
            send_pieces(conn, [view[o : o + PIECE] for o in offsets.tolist()])
        used += cpu_s() - t0
    conn.sendall(struct.pack("!d", used))
    conn.close()


def measure(mode: str, state: str, blocks: int, a: argparse.Namespace, dst: np.ndarray, src: np.ndarray
            ) -> dict[str, Any]:
    n = blocks * a.pieces
    rng = np.random.default_rng(blocks)
    slots = (a.cache_mib << 20) // PIECE
    offsets_all = [rng.choice(slots, n, replace=False).astype(np.int64) * PIECE for _ in range(a.loads)]
    times: list[float] = []
    if mode == "memcpy":
        t_cpu = cpu_s()
        for offsets in offsets_all:
            t0 = time.perf_counter()
            for o in offsets.tolist():
                dst[o : o + PIECE] = src[o : o + PIECE]
            times.append(time.perf_counter() - t0)
        mine = cpu_s() - t_cpu
        theirs = 0.0
    else:
        path = os.path.join(tempfile.gettempdir(), f"kvxfer-splice-bench-{os.getpid()}.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        spinner = ctx.Process(target=spin, args=(stop,)) if state == "cpu" else None
        if spinner is not None:
            spinner.start()
        p = ctx.Process(target=producer, args=(path, mode, a.cache_mib))
        p.start()
        srv.settimeout(60)
        conn, _ = srv.accept()
        conn.settimeout(60)
        view = memoryview(dst)
        t_cpu = cpu_s()
        for offsets in offsets_all:
            t0 = time.perf_counter()
            conn.sendall(_HDR.pack(n) + offsets.tobytes())
            recv_pieces(conn, [view[o : o + PIECE] for o in offsets.tolist()], time.monotonic() + 60)
            times.append(time.perf_counter() - t0)
        mine = cpu_s() - t_cpu
        conn.sendall(_HDR.pack(0))
        (theirs,) = struct.unpack("!d", conn.recv(8, socket.MSG_WAITALL))
        p.join(30)
        stop.set()
        if spinner is not None:
            spinner.join(10)
        conn.close()
        srv.close()
        os.unlink(path)
    last = offsets_all[-1]
    idx = (last[:, None] + np.arange(PIECE)).ravel()
    if not np.array_equal(dst[idx], src[idx]):
        raise SystemExit(f"{mode} {state} {blocks} blocks: bytes differ")
    dst[idx] = 0
    p50 = float(np.median(times))
    return {"mode": mode, "state": state, "blocks": blocks, "bytes": n * PIECE, "p50_us": p50 * 1e6,
            "gbps": n * PIECE / p50 / 1e9, "consumer_cpu_ms": mine / a.loads * 1e3,
            "producer_cpu_ms": theirs / a.loads * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 8], help="blocks per load")
    ap.add_argument("--pieces", type=int, default=64, help="pieces of 32 KiB per block (layers x K/V)")
    ap.add_argument("--cache-mib", type=int, default=256)
    ap.add_argument("--loads", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every mode, interleaved")
    ap.add_argument("--states", nargs="+", default=list(STATES), choices=STATES)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    why = splice_works()
    if why is not None:
        raise SystemExit(f"splice does not work here: {why}")
    src, dst = cache(a.cache_mib, 1), np.zeros(a.cache_mib << 20, np.uint8)
    rows: list[dict[str, Any]] = []
    print(f"{'mode':8} {'state':6} {'blocks':>6} {'MiB':>5} {'p50 us':>8} {'GB/s':>6} {'recv cpu ms':>11} "
          f"{'send cpu ms':>11}  round", flush=True)
    for r in range(a.rounds):
        for blocks in a.blocks:
            for state in a.states:
                for mode in ("memcpy", "sendmsg", "splice"):
                    if mode == "memcpy" and state != "idle":
                        continue
                    row = measure(mode, state, blocks, a, dst, src) | {"round": r}
                    rows.append(row)
                    print(f"{mode:8} {state:6} {blocks:6d} {row['bytes'] / 2**20:5.0f} {row['p50_us']:8.0f} "
                          f"{row['gbps']:6.2f} {row['consumer_cpu_ms']:11.2f} {row['producer_cpu_ms']:11.2f}  {r}",
                          flush=True)
    summary = []
    print("\nsplice against sendmsg, same rounds (median over rounds): p50 ratio (<1: faster), CPU ratios")
    for blocks in a.blocks:
        for state in a.states:
            def med(mode: str, key: str, blocks: int = blocks, state: str = state) -> float:
                return float(np.median([x[key] for x in rows if x["mode"] == mode and x["state"] == state
                                        and x["blocks"] == blocks]))
            s = {"blocks": blocks, "state": state,
                 "p50_ratio": med("splice", "p50_us") / med("sendmsg", "p50_us"),
                 "producer_cpu_ratio": med("splice", "producer_cpu_ms") / med("sendmsg", "producer_cpu_ms"),
                 "consumer_cpu_ratio": med("splice", "consumer_cpu_ms") / med("sendmsg", "consumer_cpu_ms"),
                 "total_cpu_ratio": (med("splice", "producer_cpu_ms") + med("splice", "consumer_cpu_ms"))
                 / (med("sendmsg", "producer_cpu_ms") + med("sendmsg", "consumer_cpu_ms"))}
            summary.append(s)
            print(f"  {blocks} blocks {state:5}: p50 {s['p50_ratio']:.2f}x  producer CPU "
                  f"{s['producer_cpu_ratio']:.2f}x  receiver CPU {s['consumer_cpu_ratio']:.2f}x  both "
                  f"{s['total_cpu_ratio']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "machine": {"cpus": os.cpu_count(), "kernel": os.uname().release,
                                                    "python": sys.version.split()[0]},
                       "rows": rows, "summary": summary}, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
