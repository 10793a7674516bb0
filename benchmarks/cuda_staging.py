"""Host staging of a CUDA cache: what a hold (device -> host mirror) and a finished load (host
mirror -> device) cost per request, against one contiguous copy of the same bytes.

A data plane sees a GPU cache's pinned host mirror (``connector.host_staging: auto``); each pull
hold gathers its blocks device-to-host before anyone reads them, each finished load scatters them
host-to-device (``kvxfer.cache.staging.copy_blocks``: one batched gather and one scatter per
tensor). Baseline, in the same process and run: one ``copy_`` of the same number of bytes between
a contiguous device buffer and a pinned host buffer (the PCIe/NVLink-C2C limit for this size).
The cache is the Llama-3-8B-like one of ``kvxfer bench transfer`` (2 MiB a block, 64 tensors);
block ids are random. Needs a CUDA device. Prints a table and writes JSON:

    python benchmarks/cuda_staging.py [--blocks 1 8 64 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvxfer.bench.transfer_cases import make_cfg
from kvxfer.cache import allocate_kv_cache, spec_from_config
from kvxfer.cache.staging import copy_blocks, mirror_of, unpin


def _median_s(fn: Any, budget_s: float, min_trials: int = 5) -> float:
    fn()  # warm
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    while len(times) < min_trials or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--budget-s", type=float, default=0.5, help="time spent on each measurement")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_staging: needs a CUDA device (torch.cuda.is_available() is False)")
    num_blocks = max(2 * max(args.blocks), 64)
    spec = spec_from_config(make_cfg("decode", "tcp", num_blocks))
    cache = allocate_kv_cache(spec, num_blocks, device="cuda")
    t0 = time.perf_counter()
    mirror = mirror_of(cache)
    pin_s = time.perf_counter() - t0
    block_bytes = sum(t[0].numel() * t.element_size() for t in cache.tensors)
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    print(f"cuda_staging: {torch.cuda.get_device_name()}, {platform.machine()}, torch {torch.__version__}; "
          f"{num_blocks} blocks of {block_bytes / 2**20:.1f} MiB, mirror pinned in {pin_s:.2f} s")
    print(f"{'blocks':>6} {'MiB':>7} {'d2h GB/s':>9} {'base':>7} {'ratio':>6} {'h2d GB/s':>9} {'base':>7} {'ratio':>6}")
    try:
        for n in args.blocks:
            ids = torch.as_tensor(rng.choice(num_blocks, size=n, replace=False), dtype=torch.int64)
            nbytes = n * block_bytes
            dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

            def base_d2h(h: torch.Tensor = host, d: torch.Tensor = dev) -> None:
                h.copy_(d, non_blocking=True)
                torch.cuda.synchronize()

            def base_h2d(h: torch.Tensor = host, d: torch.Tensor = dev) -> None:
                d.copy_(h, non_blocking=True)
                torch.cuda.synchronize()

            r = {"blocks": n, "bytes": nbytes,
                 "d2h_s": _median_s(lambda i=ids: copy_blocks(cache, mirror, i), args.budget_s),
                 "d2h_base_s": _median_s(base_d2h, args.budget_s),
                 "h2d_s": _median_s(lambda i=ids: copy_blocks(mirror, cache, i), args.budget_s),
                 "h2d_base_s": _median_s(base_h2d, args.budget_s)}
            for k in ("d2h", "h2d"):
                r[f"{k}_gbps"] = nbytes / r[f"{k}_s"] / 1e9
                r[f"{k}_base_gbps"] = nbytes / r[f"{k}_base_s"] / 1e9
                r[f"{k}_ratio"] = r[f"{k}_base_s"] / r[f"{k}_s"]
            rows.append(r)
            print(f"{n:6d} {nbytes / 2**20:7.1f} {r['d2h_gbps']:9.2f} {r['d2h_base_gbps']:7.2f} {r['d2h_ratio']:6.2f} "
                  f"{r['h2d_gbps']:9.2f} {r['h2d_base_gbps']:7.2f} {r['h2d_ratio']:6.2f}")
            del dev, host
    finally:
        unpin(mirror)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "block_bytes": block_bytes, "pin_s": pin_s, "rows": rows}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
