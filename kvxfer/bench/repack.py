"""Receive-side repack rate beside a plain memcpy of the same bytes, in the same run.

Shape: the Llama-3-8B-like cache (32 layers x K and V, 8 kv heads, head size 128, bf16),
4096 tokens: 512 MiB, one repack per layer tensor, as a decode rank would after a pull.
The cache is allocated the way kvxfer allocates it (block-major, huge pages).

    kvxfer bench repack [--tokens 4096] [--repeat 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from kvxfer.cache import KVCacheSpec, allocate_kv_cache
from kvxfer.config import CacheDtype, Layout
from kvxfer.progress import Progress
from kvxfer.repack import DEFAULT_CHUNK_BYTES, blocks_to_receive, repack_inplace

CASES: list[tuple[Layout, Layout, int, int]] = [  # (remote layout, local layout, remote block size, local block size)
    ("NHD", "NHD", 16, 16),
    ("NHD", "NHD", 16, 64),
    ("HND", "HND", 16, 16),
    ("NHD", "HND", 16, 16),
    ("HND", "NHD", 16, 16),
    ("HND", "HND", 16, 64),
    ("HND", "HND", 64, 16),
    ("NHD", "HND", 16, 64),
    ("HND", "NHD", 64, 16),
]


def measure(fn, repeat: int) -> list[float]:
    fn()  # warm: first touch of pages, allocator
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure_memcpy(spec: KVCacheSpec, num_blocks: int, repeat: int) -> list[float]:
    """The baseline: copy the same bytes, tensor by tensor, between two kvxfer-allocated caches."""
    src, dst = allocate_kv_cache(spec, num_blocks), allocate_kv_cache(spec, num_blocks)
    for t in src.tensors:
        t.view(torch.int16).random_(-1000, 1000)

    def memcpy() -> None:
        for s, d in zip(src.tensors, dst.tensors, strict=True):
            d.copy_(s)

    return measure(memcpy, repeat)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                    help="bytes repacked per step (default %(default)s)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    heads, head_size = 8, 128
    dtype: CacheDtype = "bfloat16"
    nbytes = args.tokens * heads * head_size * 2 * 2 * args.layers  # K and V
    print(f"repack of {args.tokens} tokens x {args.layers} layers x K,V (8 kv heads, head 128, bf16): "
          f"{nbytes / 2**20:.0f} MiB; median of {args.repeat}; torch threads {torch.get_num_threads()}; "
          f"chunk {args.chunk_bytes >> 10} KiB")

    # baseline: memcpy of the same bytes, tensor by tensor, between two huge-page buffers
    spec = KVCacheSpec(num_layers=args.layers, num_kv_heads=heads, head_size=head_size, block_size=16,
                       dtype=dtype)
    base = statistics.median(measure_memcpy(spec, args.tokens // 16, args.repeat))
    base_gbps = nbytes / base / 1e9

    header = (f"{'remote':>8} {'local':>8} {'bs':>7} {'median ms':>10} {'p90 ms':>8} {'GB/s':>7} "
              f"{'memcpy GB/s':>12} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    print(f"{'memcpy':>8} {'':>8} {'':>7} {base * 1e3:10.1f} {'':>8} {base_gbps:7.2f} "
          f"{base_gbps:12.2f} {1:6.2f}")
    records = []
    progress = Progress(len(CASES), "cases")
    for i, (rl, ll, rbs, lbs) in enumerate(CASES, 1):
        progress.update(i - 1)
        need = blocks_to_receive(args.tokens, remote_layout=rl, remote_block_size=rbs, local_block_size=lbs)
        lspec = KVCacheSpec(num_layers=args.layers, num_kv_heads=heads, head_size=head_size, block_size=lbs,
                            dtype=dtype, layout=ll)
        cache = allocate_kv_cache(lspec, need * 2)
        ids = torch.arange(0, 2 * need, 2)  # every other block: a fragmented list
        for t in cache.tensors:
            t.view(torch.int16).random_(-1000, 1000)

        def run(cache=cache, ids=ids, rl=rl, ll=ll, rbs=rbs, lbs=lbs) -> None:
            for t in cache.tensors:
                repack_inplace(t, ids, remote_layout=rl, local_layout=ll, remote_block_size=rbs,
                               local_block_size=lbs, num_tokens=args.tokens, chunk_bytes=args.chunk_bytes)

        times = measure(run, args.repeat)
        med = statistics.median(times)
        p90 = sorted(times)[min(len(times) - 1, int(0.9 * len(times)))]
        gbps = nbytes / med / 1e9
        rec = {"remote_layout": rl, "local_layout": ll, "remote_block_size": rbs, "local_block_size": lbs,
               "tokens": args.tokens, "bytes": nbytes, "median_ms": med * 1e3, "p90_ms": p90 * 1e3,
               "gbps": gbps, "baseline": "memcpy", "baseline_gbps": base_gbps, "ratio": gbps / base_gbps}
        records.append(rec)
        print(f"{rl:>8} {ll:>8} {f'{rbs}->{lbs}':>7} {med * 1e3:10.1f} {p90 * 1e3:8.1f} {gbps:7.2f} "
              f"{base_gbps:12.2f} {rec['ratio']:6.2f}")
        del cache
    progress.update(len(CASES))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.machine(), "torch": torch.__version__,
                                         "threads": torch.get_num_threads(), "chunk_bytes": args.chunk_bytes,
                                         "records": records}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
