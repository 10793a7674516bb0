"""An idle ucx data plane costs no CPU, also after it has moved data (real processes, real UCX).

ucxx's blocking progress re-arms the worker's event fd between events; once a shared-memory
endpoint exists the arm keeps failing and its loop spun a whole core on both sides for as
long as the processes lived. The plane progresses its worker itself now.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import time
from typing import Any

import ucxx  # noqa: F401  (the README's test install has the ucx extra: a missing ucxx is a failure, not a skip)

from kvxfer.bench.transfer import bench_cache, make_cfg
from kvxfer.connector import Connector
from kvxfer.protocol import KVTransferParams

IDLE_S = 3.0


def _cpu_share(seconds: float) -> float:
    """CPU seconds this process used per wall second, over ``seconds`` of sleeping."""
    def used() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    t0, c0 = time.monotonic(), used()
    time.sleep(seconds)
    return (used() - c0) / (time.monotonic() - t0)


def _producer(conn: Any) -> None:
    c = Connector.from_config(make_cfg("prefill", "ucx-nocma", 40))  # UCX's own wire (same_host: ucx)
    c.register_kv_caches(bench_cache(40, fill=True))
    conn.send(c.hold("r1", list(range(8)), 128).to_bytes())
    conn.recv()  # the consumer has loaded it
    conn.send(_cpu_share(IDLE_S))
    conn.recv()
    c.close()


def test_ucx_planes_do_not_spin_after_a_transfer() -> None:
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child,), daemon=True)
    proc.start()
    c = Connector.from_config(make_cfg("decode", "ucx-nocma", 40))
    cache = bench_cache(40, fill=False)
    c.register_kv_caches(cache)
    try:
        assert pipe.poll(60)
        params = KVTransferParams.from_bytes(pipe.recv())
        c.start_load("r1", params, list(range(20, 28)))
        deadline = time.monotonic() + 60
        while not (f := c.poll(timeout_s=1.0)):
            assert time.monotonic() < deadline, "the load did not finish"
        assert f.receiving == ["r1"], f
        assert all(bool((t[20:28] != 0).any()) for t in cache.tensors), "the blocks were loaded"
        pipe.send("loaded")
        consumer_share = _cpu_share(IDLE_S)
        assert pipe.poll(30)
        producer_share = pipe.recv()
        pipe.send("stop")
        # a spinning worker uses a whole core (1.0); idle planes measured 0.003-0.007
        assert consumer_share < 0.25, f"the consumer's idle ucx plane uses {consumer_share:.2f} of a core"
        assert producer_share < 0.25, f"the producer's idle ucx plane uses {producer_share:.2f} of a core"
    finally:
        c.close()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
