"""The tcp plane's spliced sends on Unix sockets (``unix_send``): bit-exact for pieces at any
offset and length across several regions, used only where asked and where the connection is a
Unix socket, refused by name where it cannot work.

Two real tcp planes in this process (real sockets, the kernel's real vmsplice and splice).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from kvxfer.connectors import tcp
from kvxfer.connectors.tcp import TcpDataPlane
from kvxfer.connectors.tcp.splice import IOV_BATCH, PIPE_BYTES, splice_works

from kvxfer.cache.tensors import MemoryRegion
from kvxfer.dataplane import BatchResult, Descriptors

SIZE = 12 << 20  # per region: a read of most of two of them is many pipes' worth
REGION_IDS = (3, 7)


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


def wait(plane: TcpDataPlane, batch: int, timeout_s: float = 30.0) -> BatchResult:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in plane.poll():
            if r.batch_id == batch:
                return r
        time.sleep(0.002)
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


@pytest.mark.parametrize("unix_send", ["splice", "copy"])
def test_unix_reads_arrive_bit_exact_and_are_served_as_asked(unix_send: str) -> None:
    """Three reads on one connection (its pipe reused): one of many unaligned pieces over two
    regions, more than a pipe and an iovec batch hold, then two small ones."""
    assert splice_works() is None
    pair = Pair("unix", unix_send)
    try:
        rng = np.random.default_rng(11)
        big = pieces(rng, 3 * IOV_BATCH + 17)
        assert big.nbytes > 4 * PIPE_BYTES
        small = [pieces(rng, 3), pieces(rng, 1)]
        total = 0
        for d in (big, *small):
            r = wait(pair.consumer, pair.consumer.read("p", "req", d))
            assert r.error is None and r.nbytes == d.nbytes
            total += d.nbytes
        pair.check(Descriptors.concat([big, *small]))
        counters = pair.producer.counters()
        assert counters == ({"spliced_bytes": total, "copied_bytes": 0} if unix_send == "splice"
                            else {"spliced_bytes": 0, "copied_bytes": total})
    finally:
        pair.close()


def test_tcp_connections_are_served_with_sendmsg() -> None:
    """``unix_send`` (splice by default) leaves TCP connections to sendmsg."""
    pair = Pair("tcp", None)
    try:
        assert pair.producer.unix_send == "splice"
        d = pieces(np.random.default_rng(2), 40)
        r = wait(pair.consumer, pair.consumer.read("p", "req", d))
        assert r.error is None
        pair.check(d)
        assert pair.producer.counters() == {"spliced_bytes": 0, "copied_bytes": d.nbytes}
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
