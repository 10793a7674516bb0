"""The tcp plane's streams: reads in flight spread over a peer's connections; Unix connections'
send buffers.

Two real tcp planes in this process (real sockets, the producer's real serving threads); the
producer's read validator is the only hook, gated to keep one read in the server.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from kvxfer.connectors.tcp import UNIX_SNDBUF, TcpDataPlane

from kvxfer.cache.tensors import MemoryRegion
from kvxfer.dataplane import BatchResult, Descriptors
from kvxfer.protocol import ErrorCode, Refusal

STRIDE = 64 << 10
NB = 16


def region(a: np.ndarray) -> MemoryRegion:
    return MemoryRegion(region_id=0, address=a.ctypes.data, length=a.nbytes, block_stride=STRIDE, num_blocks=NB,
                        layers=(0, 1), kind="KV")


class Pair:
    def __init__(self, transport: str, streams: int = 2) -> None:
        self.src = np.random.default_rng(1).integers(0, 255, NB * STRIDE, dtype=np.uint8)
        self.dst = np.zeros(NB * STRIDE, dtype=np.uint8)
        self.producer = TcpDataPlane({"transport": transport})
        self.consumer = TcpDataPlane({"transport": transport, "streams": streams, "timeout_s": 10.0})
        self.producer.register([region(self.src)])
        self.consumer.register([region(self.dst)])
        self.gate = threading.Event()
        self.waiting = 0  # what the "look" read saw queued behind it on the connection
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
        if request_id == "refused":
            return Refusal(ErrorCode.NOT_HELD, "not held (the test's refusal)")
        if request_id == "look":  # how many bytes of later requests wait on the connection now
            self.waiting = self.queued_after(1.0)
        return None

    def queued_after(self, timeout_s: float) -> int:
        """Bytes waiting unread on the producer's connection, once there are any (or 0 after ``timeout_s``)."""
        with self.producer._lock:
            (conn,) = self.producer._conns
        deadline = time.monotonic() + timeout_s
        while (n := struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.FIONREAD, b"\0" * 4))[0]) == 0 \
                and time.monotonic() < deadline:
            time.sleep(0.001)
        return n

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


def same(pair: Pair, blocks: list[int]) -> bool:
    return all(np.array_equal(pair.src[b * STRIDE:(b + 1) * STRIDE], pair.dst[b * STRIDE:(b + 1) * STRIDE])
               for b in blocks)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_reads_queued_on_one_stream_are_pipelined_and_arrive_bit_exact(transport: str) -> None:
    """Reads queued together on one stream go out back to back: while the producer checks one,
    the next requests already wait on its connection (without the pipeline the consumer sends
    the next only after the reply), and every read arrives bit-exact on the one connection."""
    pair = Pair(transport, streams=1)
    try:
        slow = pair.read("slow", 1)
        assert pair.in_server.wait(5), "the first read never reached the server"
        batches = {b: pair.read(rid, b) for rid, b in (("look", 2), ("r3", 3), ("r4", 4), ("r5", 5), ("r6", 6))}
        pair.gate.set()
        for batch in (slow, *batches.values()):
            res = pair.wait_for(batch)
            assert res is not None and res.ok, res
        assert pair.waiting > 0, "no later request was on the connection while the producer checked one"
        assert same(pair, [1, *batches])
        with pair.producer._lock:
            assert len(pair.producer._conns) == 1
    finally:
        pair.close()


def test_a_refused_read_among_pipelined_ones_fails_alone() -> None:
    """A refusal in the middle of a pipeline fails that read (its code kept); the reads sent
    behind it go on on the same connection and arrive bit-exact."""
    pair = Pair("unix", streams=1)
    try:
        slow = pair.read("slow", 1)
        assert pair.in_server.wait(5)
        refused = pair.read("refused", 2)
        after = {b: pair.read(f"r{b}", b) for b in (3, 4, 5)}
        pair.gate.set()
        res = pair.wait_for(refused)
        assert res is not None and not res.ok and res.code == ErrorCode.NOT_HELD, res
        for batch in (slow, *after.values()):
            res = pair.wait_for(batch)
            assert res is not None and res.ok, res
        assert same(pair, [1, 3, 4, 5]) and not pair.dst[2 * STRIDE:3 * STRIDE].any()
        with pair.producer._lock:
            assert len(pair.producer._conns) == 1  # the refusal left the connection in step
        assert pair.consumer._streams["p"][0].outstanding == 0
    finally:
        pair.close()
