"""cma one-sided reads: ``memcpy`` from a mapping of the producer's file against ``process_vm_readv``.

Two parts, each run with the cma plane's ``map_memory`` on and off, alternated, in one run:

- ``plane``: a producer and a consumer cma plane in this process, both caches in /dev/shm files
  (as a transfer agent's are), a hold on the producer's board; one read of B blocks of 2 MiB,
  each in 64 pieces of 32 KiB at random places (the Llama-3-8B-like block of ``kvxfer bench
  transfer``), from the same blocks again (``hot``) or from random blocks of the cache (``cold``).
  Baseline in the same process: ``memcpy`` of the same bytes, one contiguous copy.
- ``agents``: a prefill and a decode ``Connector`` with their transfer agents (``data_path:
  agent``), the engine thread calling ``poll()`` in a loop; 1-block loads of the same block, timed
  from ``start_load`` to the ``poll`` that reports it, with the stages from ``Connector.stats()``.

Prints a table and writes JSON:

    python benchmarks/cma_mapped.py [--reads 300] [--rounds 3] [--blocks 1 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from kvxfer.connectors.cma import CmaDataPlane

from kvxfer.bench.transfer_cases import bench_cache, make_cfg
from kvxfer.cache.tensors import MemoryRegion
from kvxfer.connector import Connector
from kvxfer.dataplane import Descriptors
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.producer import HoldRegistry

BLOCK = 2 << 20
PIECE = 32 << 10
CACHE_BLOCKS = 256  # 512 MiB per side: random blocks come from memory, not cache


def shm_array(nbytes: int, fill: bool) -> np.ndarray:
    fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR)
    os.ftruncate(fd, nbytes)
    m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    a = np.frombuffer(m, dtype=np.uint8)
    if fill:
        a.view(np.uint64)[:] = np.random.default_rng(1).integers(0, 2**63, nbytes // 8, dtype=np.uint64)
    else:
        a[:] = 0
    return a


def region(a: np.ndarray) -> MemoryRegion:
    return MemoryRegion(region_id=0, address=a.ctypes.data, length=a.nbytes, block_stride=BLOCK,
                        num_blocks=CACHE_BLOCKS, layers=(0, 1), kind="KV")


def plane_reads(src: np.ndarray, dst: np.ndarray, mapped: bool, nblocks: int, hot: bool, reads: int,
                rng: np.random.Generator) -> list[float]:
    producer, consumer = CmaDataPlane({}), CmaDataPlane({"map_memory": mapped})
    producer.register([region(src)])
    consumer.register([region(dst)])
    holds = HoldRegistry(ParallelLayout(tp_size=1, pp_size=1, num_layers=1, num_kv_heads=1), 0, 0, CACHE_BLOCKS,
                         {0: (BLOCK, CACHE_BLOCKS * BLOCK)}, 1.0, 600.0, time.monotonic, region_layers={0: (0, 1)})
    holds.on_change = producer.hold_changed
    producer.set_read_validator(holds.validate)
    consumer.connect("p", producer.address())
    per = BLOCK // PIECE
    times = []
    try:
        fixed = rng.permutation(CACHE_BLOCKS)[:nblocks], rng.permutation(CACHE_BLOCKS)[:nblocks]
        for i in range(reads):
            sb, db = fixed if hot else (rng.permutation(CACHE_BLOCKS)[:nblocks],
                                        rng.permutation(CACHE_BLOCKS)[:nblocks])
            so = (sb[:, None] * BLOCK + rng.permutation(per)[None, :] * PIECE).ravel()
            do = (db[:, None] * BLOCK + np.arange(per)[None, :] * PIECE).ravel()
            n = len(so)
            d = Descriptors(np.zeros(n, np.int64), so.astype(np.int64), np.zeros(n, np.int64), do.astype(np.int64),
                            np.full(n, PIECE, np.int64))
            holds.hold(f"r{i}", sb.tolist(), 16 * nblocks)
            t0 = time.perf_counter()
            consumer.read("p", f"r{i}", d)
            res = consumer.poll()
            times.append(time.perf_counter() - t0)
            if len(res) != 1 or not res[0].ok:
                raise RuntimeError(f"read {i} failed: {res}")
            for k in (0, n - 1):  # the first and the last piece, bit for bit
                if not np.array_equal(src[so[k]:so[k] + PIECE], dst[do[k]:do[k] + PIECE]):
                    raise RuntimeError(f"read {i}: the bytes that arrived differ")
            holds.release(f"r{i}")
        want = reads if mapped and nblocks * BLOCK <= consumer.inline_copy_bytes else 0
        if consumer.mapped_reads != want:
            raise RuntimeError(f"{consumer.mapped_reads} reads copied from the mapping, expected {want}")
    finally:
        consumer.close()
        producer.close()
    return times


def memcpy_times(nbytes: int, reads: int) -> list[float]:
    a, b = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)
    out = []
    for _ in range(reads):
        t0 = time.perf_counter()
        np.copyto(b, a)
        out.append(time.perf_counter() - t0)
    return out


def agent_loads(mapped: bool, reads: int) -> tuple[list[float], dict[str, float], dict[str, float]]:
    def cfg(role: str) -> Any:
        c = make_cfg(role, "cma", 64, "agent")  # type: ignore[arg-type]
        return msgspec.structs.replace(c, connector=msgspec.structs.replace(c.connector,
                                                                           data_plane={"map_memory": mapped}))

    prefill, decode = Connector.from_config(cfg("prefill")), Connector.from_config(cfg("decode"))
    prefill.register_kv_caches(bench_cache(64, fill=True))
    decode.register_kv_caches(bench_cache(64, fill=False))
    times = []
    try:
        for i in range(reads + 50):
            if i == 50:
                before = decode.stats()
            params = prefill.hold(f"r{i}", [5], 16)
            t0 = time.perf_counter()
            decode.start_load(f"r{i}", params, [9])
            while True:
                out = decode.poll()
                if out.receiving or out.failed:
                    break
            if out.receiving != [f"r{i}"]:
                raise RuntimeError(f"load {i}: {out}")
            if i >= 50:
                times.append(time.perf_counter() - t0)
            prefill.poll()
        after = decode.stats()
    finally:
        decode.close()
        prefill.close()
    n = after["stage_loads"] - before["stage_loads"]
    stages = {k[6:-2] + "_us": (after[k] - before[k]) / n * 1e6 for k in after
              if k.startswith("stage_") and k.endswith("_s")}
    return times, stages, {k: v for k, v in after.items() if k.startswith("plane_")}


def p50_us(times: list[float]) -> float:
    return float(np.median(times)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds of mapped / not mapped")
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    src, dst = shm_array(CACHE_BLOCKS * BLOCK, True), shm_array(CACHE_BLOCKS * BLOCK, False)
    rows: list[dict[str, Any]] = []
    print(f"{'part':8} {'case':18} {'round':>5} {'map_memory':>10} {'p50 us':>9} {'x memcpy':>9}  stages us")
    for nblocks in args.blocks:
        base = p50_us(memcpy_times(nblocks * BLOCK, args.reads))
        for hot in (True, False):
            case = f"{nblocks} block{'s' * (nblocks > 1)} {'hot' if hot else 'cold'}"
            for rnd in range(args.rounds):
                for mapped in (True, False) if rnd % 2 == 0 else (False, True):
                    p50 = p50_us(plane_reads(src, dst, mapped, nblocks, hot, args.reads, rng))
                    rows.append({"part": "plane", "case": case, "round": rnd, "map_memory": mapped, "p50_us": p50,
                                 "memcpy_p50_us": base, "x_memcpy": p50 / base})
                    print(f"{'plane':8} {case:18} {rnd:>5} {mapped!s:>10} {p50:9.0f} {p50 / base:9.2f}")
    for rnd in range(args.rounds):
        for mapped in (True, False) if rnd % 2 == 0 else (False, True):
            times, stages, counters = agent_loads(mapped, args.reads)
            p50 = p50_us(times)
            rows.append({"part": "agents", "case": "1 block", "round": rnd, "map_memory": mapped, "p50_us": p50,
                         "stages": stages, "counters": counters})
            print(f"{'agents':8} {'1 block':18} {rnd:>5} {mapped!s:>10} {p50:9.0f} {'':>9}  "
                  + "/".join(f"{v:.0f}" for v in stages.values()))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                                     "processor": platform.processor()},
                                         "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
