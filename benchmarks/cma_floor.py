"""What one 1-block cma read costs at best here: ``process_vm_readv`` against NIXL, same pieces.

The 1-block case of ``kvxfer bench transfer`` moves 2 MiB in 64 pieces of 32 KiB, one piece per
layer's K or V tensor. This script moves exactly that, with nothing of kvxfer around it: a
producer process holds 64 tensors (the same block of each is read every trial, as the bench
does), and this process reads the block

- ``process_vm_readv``: one call for the 64 pieces (ctypes, the GIL released): the copy kvxfer's
  cma plane makes for a block of a producer whose memory is not a shared file, and the floor
  for any CMA read;
- ``nixl`` (when installed): NIXL's UCX backend (``UCX_TLS=sm,self,cma,tcp``, so its reads are CMA
  copies), through the bench's own NIXL reader (``kvxfer.bench.peers.NixlConsumer``: descriptors,
  ``initialize_xfer``, ``transfer``, ``check_xfer_state`` in a loop).

Both with the tensors in private memory (``anon``: torch's allocator, as an engine's own cache)
and in shared memory (``shm``: ``share_memory_()``, as a transfer agent's cache). Rows alternate
(``--rounds``); p50/p10/p90 per row. Set against the bench's cma row (1 block p50, and its stages),
this says how much of kvxfer's time is the copy and how much is around it.

    python benchmarks/cma_floor.py [--trials 300] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvxfer.bench.peers import NIXL_UCX_TLS, NixlConsumer, NixlProducer

TENSORS, BLOCKS, PIECE = 64, 64, 32 << 10  # 64 tensors (32 layers, K and V) of 64 blocks; a block's piece
SRC, DST = 5, 9  # the block read from the producer, the block written here


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def make_tensors(memory: str, fill: int | None = None) -> list[torch.Tensor]:
    """Tensor i filled with i % 251 (the producer's), or all with ``fill``."""
    ts = [torch.full((BLOCKS * PIECE,), i % 251 if fill is None else fill, dtype=torch.uint8)
          for i in range(TENSORS)]
    if memory == "shm":
        for t in ts:
            t.share_memory_()
    return ts


def producer(memory: str, use_nixl: bool, pipe: Any) -> None:
    ts = make_tensors(memory)
    nixl = None
    if use_nixl:
        os.environ["UCX_TLS"] = NIXL_UCX_TLS
        nixl = NixlProducer(ts)  # kept until the consumer is done: its agent serves the reads
    pipe.send((nixl.info if nixl else {}, [t.data_ptr() for t in ts], os.getpid()))
    pipe.recv()  # stop


def measure(memory: str, use_nixl: bool, trials: int) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(memory, use_nixl, there), daemon=True)
    proc.start()
    try:
        if not here.poll(120):
            raise RuntimeError("the producer process did not start within 120 s")
        info, remote_bases, pid = here.recv()
        ts = make_tensors(memory, fill=255)
        local = np.array([[t.data_ptr() + DST * PIECE, PIECE, 0] for t in ts], dtype=np.int64)
        remote = np.array([[b + SRC * PIECE, PIECE, 0] for b in remote_bases], dtype=np.int64)
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        liov = (_Iovec * TENSORS)(*[_Iovec(int(a), PIECE) for a in local[:, 0]])
        riov = (_Iovec * TENSORS)(*[_Iovec(int(a), PIECE) for a in remote[:, 0]])

        def pvm() -> None:
            n = libc.process_vm_readv(pid, liov, TENSORS, riov, TENSORS, 0)
            if n != TENSORS * PIECE:
                raise OSError(ctypes.get_errno(), f"process_vm_readv copied {n} bytes")

        fns = {"process_vm_readv": pvm}
        if use_nixl:
            os.environ["UCX_TLS"] = NIXL_UCX_TLS
            peer = NixlConsumer(ts, info)
            idx, offsets = np.arange(TENSORS), np.full(TENSORS, 0, dtype=np.int64)
            lengths = np.full(TENSORS, PIECE, dtype=np.int64)

            def nixl() -> None:  # as the bench's NIXL rows read
                peer.read(idx, offsets + SRC * PIECE, idx, offsets + DST * PIECE, lengths, timeout_s=30.0)

            fns["nixl"] = nixl
        out: dict[str, list[float]] = {}
        for name, fn in fns.items():
            for t in ts:
                t[DST * PIECE:(DST + 1) * PIECE] = 255
            for _ in range(min(30, trials)):  # warm-up
                fn()
            times = []
            for _ in range(trials):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            got = torch.stack([t[DST * PIECE:(DST + 1) * PIECE] for t in ts])
            if not torch.equal(got, torch.arange(TENSORS).remainder(251).to(torch.uint8)[:, None].expand_as(got)):
                raise RuntimeError(f"{name}: the block that arrived is not the producer's")
            out[name] = times
        return out
    finally:
        here.send(None)
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.trials < 1 or args.rounds < 1:
        ap.error(f"--trials and --rounds must be >= 1, got {args.trials} and {args.rounds}")
    use_nixl = importlib.util.find_spec("nixl_cu12") is not None
    if not use_nixl:
        print("nixl: not installed (pip install nixl); process_vm_readv rows only")
    rows = []
    print(f"{'round':>5} {'memory':<6} {'read':<17} {'p50 us':>8} {'p10 us':>8} {'p90 us':>8} {'GB/s':>6}")
    for rnd in range(args.rounds):
        for memory in ("anon", "shm"):
            for name, t in measure(memory, use_nixl, args.trials).items():
                p10, p50, p90 = (float(np.percentile(t, q)) * 1e6 for q in (10, 50, 90))
                rows.append({"round": rnd, "memory": memory, "read": name, "p50_us": p50, "p10_us": p10,
                             "p90_us": p90, "gbps": TENSORS * PIECE / p50 / 1e3, "trials": len(t)})
                print(f"{rnd:>5} {memory:<6} {name:<17} {p50:>8.0f} {p10:>8.0f} {p90:>8.0f} {rows[-1]['gbps']:>6.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                         "cpus": os.cpu_count(), "bytes": TENSORS * PIECE, "pieces": TENSORS,
                                         "rows": rows}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
