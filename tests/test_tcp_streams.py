"""The tcp plane's streams: reads in flight spread over a peer's connections; Unix connections'
send buffers.

Two real tcp planes in this process (real sockets, the producer's real serving threads); the
producer's read validator is the only hook, gated to keep one read in the server.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from kvxfer.connectors.tcp import UNIX_SNDBUF, TcpDataPlane

from kvxfer.cache.tensors import MemoryRegion
from kvxfer.dataplane import BatchResult, Descriptors
from kvxfer.protocol import Refusal

STRIDE = 64 << 10
NB = 16


def region(a: np.ndarray) -> MemoryRegion:
    return MemoryRegion(region_id=0, address=a.ctypes.data, length=a.nbytes, block_stride=STRIDE, num_blocks=NB,
                        layers=(0, 1), kind="KV")


class Pair:
    def __init__(self, transport: str) -> None:
        self.src = np.random.default_rng(1).integers(0, 255, NB * STRIDE, dtype=np.uint8)
        self.dst = np.zeros(NB * STRIDE, dtype=np.uint8)
        self.producer = TcpDataPlane({"transport": transport})
        self.consumer = TcpDataPlane({"transport": transport, "streams": 2, "timeout_s": 10.0})
        self.producer.register([region(self.src)])
        self.consumer.register([region(self.dst)])
        self.gate = threading.Event()
        self.in_server = threading.Event()
        self.producer.set_read_validator(self.validate)
        self.consumer.connect("p", self.producer.address())
        self.results: dict[int, BatchResult] = {}
        self.finished = threading.Event()  # set by the plane's completion callback
        self.consumer.set_completion_callback(self.finished.set)

    def validate(self, request_id: str, d: Descriptors) -> Refusal | None:
        if request_id == "slow":
            self.in_server.set()
            self.gate.wait(10)
        return None

    def read(self, request_id: str, block: int) -> int:
        one = np.ones(1, np.int64)
        d = Descriptors(0 * one, block * STRIDE * one, 0 * one, block * STRIDE * one, STRIDE * one)
        return self.consumer.read("p", request_id, d)

    def wait_for(self, batch: int, timeout_s: float = 5.0) -> BatchResult | None:
        deadline = time.monotonic() + timeout_s
        while batch not in self.results and time.monotonic() < deadline:
            self.finished.clear()
            for r in self.consumer.poll():
                self.results[r.batch_id] = r
            if batch not in self.results:
                self.finished.wait(max(deadline - time.monotonic(), 0.0))
        return self.results.get(batch)

    def close(self) -> None:
        self.gate.set()
        self.consumer.close()
        self.producer.close()


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_small_read_is_not_queued_behind_a_slow_one(transport: str) -> None:
    """With two streams, a read issued while another is held in the server takes the idle
    stream and finishes first; both arrive bit-exact."""
    pair = Pair(transport)
    try:
        slow = pair.read("slow", 3)
        assert pair.in_server.wait(5), "the first read never reached the server"
        fast = pair.read("fast", 7)
        res = pair.wait_for(fast)
        assert res is not None and res.ok, f"the second read waited behind the first: {res}"
        assert slow not in pair.results, "the gated read finished early"
        pair.gate.set()
        res = pair.wait_for(slow)
        assert res is not None and res.ok
        for b in (3, 7):
            assert np.array_equal(pair.src[b * STRIDE:(b + 1) * STRIDE], pair.dst[b * STRIDE:(b + 1) * STRIDE])
    finally:
        pair.close()


def test_finished_reads_free_their_stream() -> None:
    """A read that finished leaves its stream idle again: reads one after another all take the
    first stream (no connection is opened for nothing)."""
    pair = Pair("unix")
    try:
        for i, b in enumerate([1, 2, 3]):
            res = pair.wait_for(pair.read(f"r{i}", b))
            assert res is not None and res.ok
        with pair.producer._lock:
            conns = len(pair.producer._conns)
        assert conns == 1
    finally:
        pair.close()


def test_unix_connections_get_a_wide_send_buffer() -> None:
    """The producer's end of a Unix connection sends from a buffer as large as the kernel allows
    up to UNIX_SNDBUF (the default, 208 KiB, costs a wake-up of each side per 208 KiB)."""
    pair = Pair("unix")
    try:
        res = pair.wait_for(pair.read("r", 2))
        assert res is not None and res.ok
        with pair.producer._lock:
            (conn,) = pair.producer._conns
        cap = int(Path("/proc/sys/net/core/wmem_max").read_text())
        default = int(Path("/proc/sys/net/core/wmem_default").read_text())
        got = conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert got >= min(UNIX_SNDBUF, cap) and got > default, (got, cap, default)
    finally:
        pair.close()


def test_a_small_read_on_an_idle_connection_is_done_by_the_caller() -> None:
    """Once a stream is connected and idle, a small read is done on the thread that calls
    ``read``: it is finished (bit-exact) when ``read`` returns, reported from that thread."""
    pair = Pair("unix")
    reporters: list[str] = []

    def report() -> None:
        reporters.append(threading.current_thread().name)
        pair.finished.set()

    pair.consumer.set_completion_callback(report)
    try:
        res = pair.wait_for(pair.read("first", 1))  # connects the stream (on its own thread)
        assert res is not None and res.ok
        batch = pair.read("inline", 5)
        done = {r.batch_id: r for r in pair.consumer.poll()}
        assert batch in done and done[batch].ok, done
        assert reporters[-1] == threading.current_thread().name, reporters
        assert np.array_equal(pair.src[5 * STRIDE:6 * STRIDE], pair.dst[5 * STRIDE:6 * STRIDE])
    finally:
        pair.close()


def test_an_inline_read_that_waits_too_long_is_finished_by_the_stream() -> None:
    """A read whose reply is held in the server past the inline wait: ``read`` returns unfinished,
    the stream's thread takes the reply when it comes, bit-exact, and the connection stays in
    step for the next read."""
    pair = Pair("unix")
    try:
        res = pair.wait_for(pair.read("first", 1))
        assert res is not None and res.ok
        slow = pair.read("slow", 3)  # inline on the connected stream, held in the server
        first = pair.consumer._streams["p"][0]
        assert first.handed_over == 1, "the read was not begun here and left to the stream's thread"
        assert pair.in_server.wait(5), "the read never reached the server"
        assert slow not in {r.batch_id for r in pair.consumer.poll()}, "the gated read finished early"
        pair.gate.set()
        res = pair.wait_for(slow)
        assert res is not None and res.ok, res
        res = pair.wait_for(pair.read("after", 9))
        assert res is not None and res.ok, res
        for b in (1, 3, 9):
            assert np.array_equal(pair.src[b * STRIDE:(b + 1) * STRIDE], pair.dst[b * STRIDE:(b + 1) * STRIDE])
        with pair.producer._lock:
            assert len(pair.producer._conns) == 1  # one connection throughout: nothing was dropped
    finally:
        pair.close()
