"""The tcp plane's spliced sends on Unix sockets (``unix_send``): bit-exact for pieces at any
offset and length across several regions, used only where asked and where the connection is a
Unix socket, refused by name where it cannot work; a signal mid-splice, memory vmsplice refuses,
and a consumer that leaves mid-read.

Two real tcp planes in this process (real sockets, the kernel's real vmsplice and splice).
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
from kvxfer.connectors import tcp
from kvxfer.connectors.tcp import TcpDataPlane, recv_frame, send_frame, splice
from kvxfer.connectors.tcp.splice import IOV_BATCH, PIPE_BYTES, Splicer, splice_works

from kvxfer.cache.tensors import MemoryRegion
from kvxfer.dataplane import BatchResult, Descriptors
from kvxfer.protocol import DataHello, ReadReply, ReadRequest, decode_data, encode

SIZE = 12 << 20  # per region: a read of most of two of them is many pipes' worth
REGION_IDS = (7, 3)  # registered in this order: the region table sorts them
WHY_NOT = splice_works()
needs_splice = pytest.mark.skipif(WHY_NOT is not None, reason=f"this host refuses spliced pages: {WHY_NOT}")


def region(rid: int, a: np.ndarray) -> MemoryRegion:
    return MemoryRegion(region_id=rid, address=a.ctypes.data, length=a.nbytes, block_stride=a.nbytes, num_blocks=1,
                        layers=(0, 1), kind="KV")


def pieces(rng: np.random.Generator, n: int) -> Descriptors:
    """``n`` pieces of 1 byte to 96 KiB at odd offsets, alternating regions, none overlapping
    on the consumer's side (each piece lands at the same place it was read from)."""
    lengths = rng.integers(1, 96 << 10, n)
    slots = SIZE // n
    lengths = np.minimum(lengths, slots - 1)
    offsets = np.arange(n) * slots + rng.integers(0, slots - lengths)
    regions = np.array(REGION_IDS, np.int64)[np.arange(n) % 2]
    return Descriptors(regions, offsets, regions, offsets, lengths)


def counters_reach(plane: TcpDataPlane, want: dict[str, int], timeout_s: float = 10.0) -> dict[str, float]:
    """The producer counts a read after its send returns, which may be after the consumer has it."""
    deadline = time.monotonic() + timeout_s
    while (got := plane.counters()) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def wait(pair: Pair, batch: int, timeout_s: float = 30.0) -> BatchResult:
    """The batch's result, woken by the consumer's completion callback."""
    plane, done = pair.consumer, pair.done
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done.clear()
        for r in plane.poll():
            if r.batch_id == batch:
                return r
        done.wait(max(deadline - time.monotonic(), 0.0))
    raise AssertionError(f"batch {batch} did not finish in {timeout_s} s")


class Pair:
    def __init__(self, transport: str, unix_send: str | None) -> None:
        rng = np.random.default_rng(5)
        self.src = {rid: rng.integers(0, 255, SIZE, dtype=np.uint8) for rid in REGION_IDS}
        self.dst = {rid: np.zeros(SIZE, dtype=np.uint8) for rid in REGION_IDS}
        opts: dict[str, str | float] = {"transport": transport}
        if unix_send is not None:
            opts["unix_send"] = unix_send
        self.producer = TcpDataPlane(opts)
        self.consumer = TcpDataPlane({"transport": transport, "timeout_s": 30.0})
        self.producer.register([region(rid, a) for rid, a in self.src.items()])
        self.consumer.register([region(rid, a) for rid, a in self.dst.items()])
        self.consumer.connect("p", self.producer.address())
        self.done = threading.Event()
        self.consumer.set_completion_callback(self.done.set)

    def check(self, d: Descriptors) -> None:
        for rid in REGION_IDS:
            want = self.src[rid].copy()
            mask = np.zeros(SIZE, bool)
            for o, k in zip(d.local_offset[d.local_region == rid].tolist(), d.length[d.local_region == rid].tolist(),
                            strict=True):
                mask[o : o + k] = True
            want[~mask] = 0
            assert np.array_equal(self.dst[rid], want), f"region {rid} differs"

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()


def one_piece(region_id: int, offset: int, length: int) -> Descriptors:
    r, o, k = (np.array([x], np.int64) for x in (region_id, offset, length))
    return Descriptors(r, o, r, o, k)


@pytest.mark.parametrize("unix_send", [pytest.param("splice", marks=needs_splice), "copy"])
def test_unix_reads_arrive_bit_exact_and_are_served_as_asked(unix_send: str) -> None:
    """Four reads on one connection (its pipe reused): many unaligned pieces over two regions,
    more than a pipe and an iovec batch hold; one piece of three pipes and 11 bytes at an odd
    offset; then two small ones."""
    pair = Pair("unix", unix_send)
    try:
        rng = np.random.default_rng(11)
        big = pieces(rng, 3 * IOV_BATCH + 17)
        assert big.nbytes > 4 * PIPE_BYTES
        long = one_piece(3, 12345, 3 * PIPE_BYTES + 11)
        small = [pieces(rng, 3), pieces(rng, 1)]
        total = 0
        for d in (big, long, *small):
            pair.dst[3][:] = 0
            pair.dst[7][:] = 0
            r = wait(pair, pair.consumer.read("p", "req", d))
            assert r.error is None and r.nbytes == d.nbytes
            pair.check(d)
            total += d.nbytes
        want = ({"spliced_bytes": total, "copied_bytes": 0} if unix_send == "splice"
                else {"spliced_bytes": 0, "copied_bytes": total})
        assert counters_reach(pair.producer, want) == want
    finally:
        pair.close()


def test_tcp_connections_are_served_with_sendmsg() -> None:
    """``unix_send`` (splice by default) leaves TCP connections to sendmsg."""
    pair = Pair("tcp", None)
    try:
        assert pair.producer.unix_send == "splice"
        d = pieces(np.random.default_rng(2), 40)
        r = wait(pair, pair.consumer.read("p", "req", d))
        assert r.error is None
        pair.check(d)
        want = {"spliced_bytes": 0, "copied_bytes": d.nbytes}
        assert counters_reach(pair.producer, want) == want
    finally:
        pair.close()


def test_a_bad_unix_send_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unix_send: expected splice or copy, got 'zero'"):
        TcpDataPlane({"unix_send": "zero"})


def test_where_splice_fails_the_default_copies_and_asking_for_it_is_refused(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The kernel's answer is the plane's collaborator here: a host whose seccomp refuses
    vmsplice is stood in for by the probe's reason."""
    monkeypatch.setattr(tcp, "splice_works", lambda: "vmsplice: Operation not permitted")
    with pytest.raises(ValueError, match=r"unix_send: splice does not work here \(vmsplice: Operation not permitted"):
        TcpDataPlane({"unix_send": "splice"})
    with caplog.at_level(logging.WARNING, logger=tcp.__name__):
        plane = TcpDataPlane({})
    try:
        assert plane.unix_send == "copy"
        assert "served with sendmsg (splice does not work here: vmsplice: Operation not permitted)" in caplog.text
    finally:
        plane.close()


def queued(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive queue (FIONREAD)."""
    import fcntl
    import struct
    import termios

    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0])


@needs_splice
def test_a_signal_mid_splice_does_not_end_the_send() -> None:
    """A Python-handled signal interrupts the serving thread's blocked splice (EINTR): the send
    goes on, bit-exact, as sendmsg's would."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    src = np.random.default_rng(9).integers(0, 255, 16 << 20, dtype=np.uint8)
    splicer = Splicer()
    failed: list[BaseException] = []
    blocked = threading.Event()

    def serve() -> None:
        blocked.set()
        try:
            splicer.send(a, np.array([src.ctypes.data + 1], np.int64), np.array([len(src) - 1], np.int64))
        except BaseException as e:
            failed.append(e)

    old = signal.signal(signal.SIGUSR1, lambda *_: None)
    t = threading.Thread(target=serve)
    t.start()
    try:
        blocked.wait(5)
        deadline = time.monotonic() + 5  # until the consumer's socket holds 1 MiB: the thread is in splice
        while queued(b) < 1 << 20 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert t.ident is not None
        for _ in range(3):
            signal.pthread_kill(t.ident, signal.SIGUSR1)
            time.sleep(0.05)
        got = bytearray()
        b.settimeout(10)
        while len(got) < len(src) - 1:
            chunk = b.recv(1 << 20)
            assert chunk
            got += chunk
        t.join(10)
    finally:
        signal.signal(signal.SIGUSR1, old)
        splicer.close()
        a.close()
        b.close()
    assert not failed, failed
    assert bytes(got) == src[1:].tobytes()


@needs_splice
def test_memory_vmsplice_refuses_is_sent_with_sendmsg_from_where_it_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """vmsplice refusing a region's pages (EFAULT: some driver mappings) is stood in for by the
    kernel's answer after the first call; the read still arrives whole and bit-exact, and the
    connection copies from then on."""
    real = splice._libc
    calls = [0]

    class Refusing:
        splice = real.splice

        @staticmethod
        def vmsplice(*args: Any) -> int:
            calls[0] += 1
            if calls[0] == 1:
                return int(real.vmsplice(*args))
            import ctypes
            ctypes.set_errno(errno.EFAULT)
            return -1

    pair = Pair("unix", "splice")
    monkeypatch.setattr(splice, "_libc", Refusing)
    try:
        for d in (pieces(np.random.default_rng(4), 2 * IOV_BATCH), pieces(np.random.default_rng(5), 7)):
            pair.dst[3][:] = 0
            pair.dst[7][:] = 0
            r = wait(pair, pair.consumer.read("p", "req", d))
            assert r.error is None
            pair.check(d)
        assert calls[0] == 2  # the second read did not try again
    finally:
        pair.close()


@needs_splice
def test_a_consumer_that_leaves_mid_read_frees_its_connection() -> None:
    """A consumer that takes the reply header and a few bytes of an 11 MiB read and closes: the
    producer's thread blocked in splice ends (its connection and pipe closed), and the next
    consumer reads bit-exact."""
    pair = Pair("unix", "splice")
    try:
        path = msgspec_address(pair.producer)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(path)
        send_frame(s, encode(DataHello(engine_id="leaver")))
        d = one_piece(7, 1, 11 << 20)
        send_frame(s, encode(ReadRequest(request_id="r", batch_id=1, regions=d.remote_region.tobytes(),
                                         offsets=d.remote_offset.tobytes(), lengths=d.length.tobytes())))
        reply = decode_data(recv_frame(s))
        assert isinstance(reply, ReadReply) and reply.nbytes == 11 << 20
        s.recv(1000)
        deadline = time.monotonic() + 5
        while len(pair.producer._conns) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        s.close()
        while pair.producer._conns and time.monotonic() < deadline + 5:
            time.sleep(0.01)
        assert not pair.producer._conns  # its serving thread left splice
        d = pieces(np.random.default_rng(6), 50)
        r = wait(pair, pair.consumer.read("p", "req", d))
        assert r.error is None
        pair.check(d)
    finally:
        pair.close()


def msgspec_address(plane: TcpDataPlane) -> str:
    import msgspec
    from kvxfer.connectors.tcp import Address
    return msgspec.msgpack.decode(plane.address(), type=Address).unix_path
