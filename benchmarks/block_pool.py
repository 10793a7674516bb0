"""Block pool speed: allocate + free of 100k blocks, beside a plain-list baseline.

Prints a table and writes JSON. The baseline (pop/append of ints on a Python list, the
floor for any pure-Python allocator) runs in the same process in the same run, so the
``ratio`` column is comparable across machines; the absolute numbers are not.

    python benchmarks/block_pool.py [--blocks 100000] [--repeat 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvxfer.cache.block_manager import BlockManager
from kvxfer.cache.block_pool import BlockPool


def bench(fn: Callable[[], Callable[[], None]], repeat: int) -> list[float]:
    """``fn`` sets up and returns the timed callable; returns seconds per run."""
    times = []
    for _ in range(repeat):
        run = fn()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def case_baseline(n: int) -> Callable[[], None]:
    free = list(range(n))

    def run() -> None:
        taken = [free.pop() for _ in range(n)]
        for b in taken:
            free.append(b)
    return run


def case_pool(n: int) -> Callable[[], None]:
    pool = BlockPool(n)

    def run() -> None:
        pool.free(pool.allocate(n))
    return run


def case_pool_cached(n: int) -> Callable[[], None]:
    """Every block carries a hash, so allocation also evicts from the prefix map."""
    pool = BlockPool(n)
    blocks = pool.allocate(n)
    for b in blocks:
        pool.cache_block(b, b.block_id.to_bytes(16, "little"))
    pool.free(blocks)

    def run() -> None:
        pool.free(pool.allocate(n))
    return run


def case_touch(n: int) -> Callable[[], None]:
    """Prefix hits: unlink n cached free blocks from the middle of the queue, then free."""
    pool = BlockPool(n)
    blocks = pool.allocate(n)
    for b in blocks:
        pool.cache_block(b, b.block_id.to_bytes(16, "little"))
    pool.free(blocks)
    order = blocks[1::2] + blocks[0::2]  # from the middle, not the head

    def run() -> None:
        pool.touch(order)
        pool.free(order)
    return run


def case_manager(n: int, block_size: int = 16, blocks_per_request: int = 16) -> Callable[[], None]:
    """Request-level: allocate + commit (hashing) + free, 16 blocks per request."""
    bm = BlockManager(n, block_size, watermark=0.0)
    per_req = block_size * blocks_per_request
    prompts = [list(range(i * per_req, (i + 1) * per_req)) for i in range(n // blocks_per_request)]

    def run() -> None:
        for i, p in enumerate(prompts):
            bm.allocate(str(i), p)
            bm.commit(str(i))
        for i in range(len(prompts)):
            bm.free(str(i))
    return run


def case_reserve_discard(n: int, block_size: int = 16, blocks_per_request: int = 16) -> Callable[[], None]:
    """A transfer's path on failure: reserve then discard, 16 blocks per request."""
    bm = BlockManager(n, block_size, watermark=0.0, enable_prefix_caching=False)
    per_req = block_size * blocks_per_request
    prompts = [list(range(i * per_req, (i + 1) * per_req)) for i in range(n // blocks_per_request)]

    def run() -> None:
        for i, p in enumerate(prompts):
            bm.reserve(str(i), p, timeout_s=60)
        for i in range(len(prompts)):
            bm.discard(str(i))
    return run


CASES: dict[str, Callable[[int], Callable[[], None]]] = {
    "baseline: list pop+append": case_baseline,
    "pool allocate+free": case_pool,
    "pool allocate+free (evicting cached)": case_pool_cached,
    "pool touch+free (prefix hits)": case_touch,
    "manager allocate+commit+free": case_manager,
    "manager reserve+discard": case_reserve_discard,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None, help="write the records here")
    args = ap.parse_args(argv)
    if args.blocks < 16 or args.repeat < 1:
        ap.error("--blocks must be >= 16 and --repeat >= 1")

    records = []
    base_ms = None
    print(f"{args.blocks:,} blocks, median of {args.repeat} runs, Python {platform.python_version()}")
    header = f"{'case':40} {'median ms':>10} {'p90 ms':>9} {'ns/block':>9} {'Mblocks/s':>10} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for i, (name, case) in enumerate(CASES.items(), 1):
        print(f"[{i}/{len(CASES)}] {name}...", end="\r", file=sys.stderr, flush=True)
        times = bench(lambda c=case: c(args.blocks), args.repeat)
        med = statistics.median(times)
        p90 = sorted(times)[min(len(times) - 1, int(0.9 * len(times)))]
        if base_ms is None:
            base_ms = med
        rec = {
            "case": name, "blocks": args.blocks, "median_ms": med * 1e3, "p90_ms": p90 * 1e3,
            "ns_per_block": med / args.blocks * 1e9, "mblocks_per_s": args.blocks / med / 1e6,
            "baseline": "list pop+append", "ratio_to_baseline": med / base_ms,
        }
        records.append(rec)
        print(f"{name:40} {rec['median_ms']:10.2f} {rec['p90_ms']:9.2f} {rec['ns_per_block']:9.0f} "
              f"{rec['mblocks_per_s']:10.2f} {rec['ratio_to_baseline']:6.1f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.machine(), "python": platform.python_version(),
                                         "records": records}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
