"""1-block pull loads into blocks never touched before, beside loads into the same blocks again.

A serving engine loads each prompt into blocks it just allocated, from blocks the producer just
wrote; ``kvxfer bench transfer`` repeats one set of block ids per case, so every trial after the
first finds its pages mapped. This runs both in one process pair, on the public ``Connector``
API (transfer agents, the default data path): ``fresh`` loads take block ids no load used
before on either side, ``warm`` loads reuse a few ids. Their ratio is what a page first touched
costs a transfer (the agent's mapping fills its page tables at registration for this).

Prints a table and writes JSON:

    python benchmarks/fresh_blocks.py [--connector cma] [--loads 150] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.bench.transfer_cases import bench_cache, make_cfg
from kvxfer.connector import Connector
from kvxfer.protocol import KVTransferParams

BLOCK_TOKENS = 16


def _producer(pipe: Any, connector: str, num_blocks: int) -> None:
    cache = bench_cache(num_blocks, fill=True)
    c = Connector.from_config(make_cfg("prefill", connector, num_blocks))
    c.register_kv_caches(cache)
    n = 0
    while (ids := pipe.recv()) is not None:  # one hold per block id asked for
        out = []
        for b in ids:
            n += 1
            out.append(c.hold(f"r{n}", [int(b)], BLOCK_TOKENS).to_bytes())
        pipe.send(out)
        deadline = time.monotonic() + 30
        while not pipe.poll(0.0) and time.monotonic() < deadline:  # free holds as readers finish
            c.poll(timeout_s=0.01)
    c.close()


def _load_all(conn: Any, blobs: list[bytes], dst: list[int]) -> list[float]:
    times = []
    for blob, d in zip(blobs, dst, strict=True):
        p = KVTransferParams.from_bytes(blob)
        t0 = time.perf_counter()
        conn.start_load(p.request_id, p, [d])
        deadline = t0 + 30
        while True:
            f = conn.poll(timeout_s=1.0)
            if p.request_id in f.failed:
                raise RuntimeError(f"load {p.request_id} failed: {f.errors}")
            if p.request_id in f.receiving:
                break
            if time.perf_counter() > deadline:
                raise TimeoutError(f"load {p.request_id} not done in 30 s")
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", default="cma", help="data plane (default cma)")
    ap.add_argument("--loads", type=int, default=150, help="loads of each kind (fresh, warm), interleaved in rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    per_round = a.loads // a.rounds
    num_blocks = per_round * a.rounds + 16 + 8  # every fresh load its own block, 8 warm ones, room
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child, a.connector, num_blocks), daemon=True)
    proc.start()
    try:
        cache = bench_cache(num_blocks, fill=False)
        conn = Connector.from_config(make_cfg("decode", a.connector, num_blocks))
        conn.register_kv_caches(cache)
        rng = np.random.default_rng(0)
        fresh_src, fresh_dst = rng.permutation(np.arange(8, num_blocks)), rng.permutation(np.arange(8, num_blocks))
        warm = list(range(8))
        pipe.send(warm)  # the handshake and the warm blocks' first touch: not counted
        _load_all(conn, pipe.recv(), warm)
        out: dict[str, list[float]] = {"fresh": [], "warm": []}
        for r in range(a.rounds):
            for kind in ("fresh", "warm") if r % 2 == 0 else ("warm", "fresh"):
                if kind == "fresh":
                    src = fresh_src[r * per_round:(r + 1) * per_round].tolist()
                    dst = fresh_dst[r * per_round:(r + 1) * per_round].tolist()
                else:
                    src = [warm[i % 8] for i in range(per_round)]
                    dst = [warm[(i + 3) % 8] for i in range(per_round)]
                pipe.send(src)
                out[kind] += _load_all(conn, pipe.recv(), dst)
        conn.close()
    finally:
        pipe.send(None)
        proc.join(30)
    rows = {k: {"loads": len(v), "p50_us": statistics.median(v), "p10_us": float(np.percentile(v, 10)),
                "p90_us": float(np.percentile(v, 90))} for k, v in out.items()}
    ratio = rows["fresh"]["p50_us"] / rows["warm"]["p50_us"]
    print(f"1-block loads (2 MiB, 64 pieces), {a.connector}, transfer agents; fresh/warm interleaved in "
          f"{a.rounds} rounds")
    print(f"{'blocks':<8} {'loads':>6} {'p10 us':>8} {'p50 us':>8} {'p90 us':>8}")
    for k, r in rows.items():
        print(f"{k:<8} {r['loads']:>6} {r['p10_us']:8.0f} {r['p50_us']:8.0f} {r['p90_us']:8.0f}")
    print(f"fresh/warm p50: {ratio:.2f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"connector": a.connector, "rows": rows, "fresh_over_warm_p50": ratio}, indent=2))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
