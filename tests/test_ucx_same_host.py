"""ucx with ``same_host: cma`` (its default with one-sided reads): the producers on this host are
read through the cma plane beside the ucx plane, the others over UCX.

Real planes (UCX and process_vm_readv), the producer's reads checked by a real HoldRegistry.
Checked: a held read arrives bit-exact through the cma plane with no UCX request served; a read
of blocks not held is refused by name and writes nothing; a producer with ``same_host: ucx`` is read
over UCX; one burst to a producer of each kind gets every read back under its own batch id; a
producer killed before the read fails it as a lost peer, and this process lives on (UCX with
CMA in UCX_TLS would abort it); a bad value is refused by name. The default: ``cma`` with one-sided
reads, ``ucx`` with two-sided ones, which refuse ``cma``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import ucxx  # noqa: F401  (the README's test install has the ucx extra: a missing ucxx is a failure, not a skip)
from kvxfer.connectors.ucx import UcxDataPlane
from test_cma_bursts import descs, read_many
from test_hold_board import NB, STRIDE, region
from test_ucx_bursts import Pair as UcxPair

from kvxfer.protocol import ErrorCode

CMA = {"same_host": "cma"}
UCX_WIRE = {"same_host": "ucx"}  # every producer over UCX


class Pair(UcxPair):
    """test_ucx_bursts' pair; the producer's holds also published where its cma plane shows them."""

    def __init__(self, producer: dict[str, Any], consumer: dict[str, Any]) -> None:
        super().__init__(producer, ucx_wire=False)
        self.consumer.close()  # super's consumer has the producer's options: one of the consumer's own
        self.consumer = UcxDataPlane(consumer)
        self.consumer.register([region(0, self.dst)])
        self.holds.on_change = self.producer.hold_changed
        self.consumer.connect("p", self.producer.address())


def test_a_producer_on_this_host_is_read_through_the_cma_plane() -> None:
    p = Pair(CMA, CMA)
    try:
        p.holds.hold("a", [3, 9, 10], 48)
        [res] = read_many(p, [("a", [3, 9, 10], [0, 5, 6])])
        assert res.ok and res.nbytes == 3 * STRIDE, res
        assert p.arrived([3, 9, 10], [0, 5, 6])
        assert p.served == [], "no read request reached the producer's UCX side"
        c = p.consumer.counters()
        assert c["cma_peers"] == 1 and c["cma_one_sided_reads"] == 1, c
        [bad] = read_many(p, [("x", [4], [1])])  # never held: the board does not allow it, nor the producer
        assert not bad.ok and bad.code is ErrorCode.NOT_HELD, bad
        assert not p.dst[STRIDE:2 * STRIDE].any(), "the refused read wrote nothing"
    finally:
        p.close()


def test_the_producers_token_checker_guards_the_cma_planes_grants_too() -> None:
    """The token checker set on the ucx plane reaches the cma plane beside it: a read that must ask
    for a grant (not on the board) with a token the producer does not know is refused as AUTH."""
    p = Pair(CMA, CMA)
    try:
        p.producer.set_token_checker(lambda token: token == b"secret")
        p.holds.hold("a", [4], 16)
        p.producer.hold_changed("a", None)  # off the board: the read asks the producer
        [res] = read_many(p, [("a", [4], [0])])
        assert not res.ok and res.code is ErrorCode.AUTH, res
        assert not p.dst[:STRIDE].any()
    finally:
        p.close()


def test_a_producer_on_ucx_s_own_wire_is_read_over_ucx() -> None:
    p = Pair(UCX_WIRE, CMA)
    try:
        p.holds.hold("a", [2], 16)
        [res] = read_many(p, [("a", [2], [7])])
        assert res.ok and p.arrived([2], [7])
        assert p.served == [1], "the grant came from the producer's UCX side"
        assert p.consumer.counters()["cma_peers"] == 0
    finally:
        p.close()


def test_one_burst_to_a_cma_producer_and_a_ucx_producer() -> None:
    p = Pair(CMA, CMA)
    other = Pair(UCX_WIRE, UCX_WIRE)  # its producer serves over UCX only
    try:
        p.consumer.connect("q", other.producer.address())
        p.holds.hold("a", [1, 2], 32)
        other.holds.hold("b", [5], 16)
        ids = p.consumer.read_many([("p", "a", descs([1, 2], [0, 1])), ("q", "b", descs([5], [2])),
                                    ("p", "missing", descs([8], [3]))])
        assert len(set(ids)) == 3, ids
        got: dict[int, Any] = {}
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            got.update((r.batch_id, r) for r in p.consumer.poll())
            time.sleep(0.001)
        a, b, missing = (got[i] for i in ids)
        assert a.ok and b.ok and missing.code is ErrorCode.NOT_HELD, (a, b, missing)
        assert p.arrived([1, 2], [0, 1])
        assert np.array_equal(p.dst[2 * STRIDE:3 * STRIDE], other.src[5 * STRIDE:6 * STRIDE])
        assert other.served == [1] and p.served == []
    finally:
        other.close()
        p.close()


def _producer(conn: Any) -> None:
    plane = UcxDataPlane(CMA)
    src = np.full(NB * STRIDE, 7, dtype=np.uint8)
    plane.register([region(0, src)])
    plane.hold_changed("a", np.array([0, 1], dtype=np.int64))
    conn.send(plane.address())
    conn.recv()  # killed here


def test_a_producer_killed_before_the_read_fails_it_and_this_process_lives_on() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child,), daemon=True)
    proc.start()
    consumer = UcxDataPlane({**CMA, "timeout_s": 5.0})
    dst = np.zeros(NB * STRIDE, dtype=np.uint8)
    try:
        assert parent.poll(60), "the producer did not start"
        consumer.register([region(0, dst)])
        consumer.connect("p", parent.recv())
        assert consumer.counters()["cma_peers"] == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        t0 = time.monotonic()
        [res] = read_many_from(consumer, [("a", [0, 1], [0, 1])])
        # x86_64, the board mapped: the copy's ESRCH, at once; elsewhere the board read fails and the
        # grant asked of a dead producer runs out (timeout_s)
        assert not res.ok and res.code in (ErrorCode.PEER_LOST, ErrorCode.TIMEOUT), res
        assert time.monotonic() - t0 < 10 and not dst.any()
    finally:
        consumer.close()
        if proc.is_alive():
            proc.kill()


def read_many_from(plane: UcxDataPlane, reads: list[tuple[str, list[int], list[int]]]) -> list[Any]:
    class _P:
        consumer = plane

    return read_many(_P, reads)  # type: ignore[arg-type]


def test_a_producer_in_another_pid_namespace_is_read_over_ucx_not_by_its_pid_here() -> None:
    """Two containers on one host share the boot id, not the pid namespace: the producer's pid
    names another process here, so the cma plane refuses it by name and the ucx plane reads it over UCX."""
    import msgspec
    from kvxfer.connectors.cma.peer import CmaAddress, open_peer
    from kvxfer.connectors.ucx.wire import UcxAddress

    p = Pair(CMA, UCX_WIRE)
    try:
        addr = msgspec.msgpack.decode(p.producer.address(), type=UcxAddress)
        assert addr.cma is not None
        cma = msgspec.structs.replace(msgspec.msgpack.decode(addr.cma, type=CmaAddress), pid_ns="1:2")
        with pytest.raises(ConnectionError, match=r"another pid namespace .* use tcp or ucx"):
            open_peer("p", msgspec.msgpack.encode(cma), b"", True)
        consumer = UcxDataPlane(CMA)
        try:
            other_ns = msgspec.structs.replace(addr, cma=msgspec.msgpack.encode(cma))
            consumer.connect("p", msgspec.msgpack.encode(other_ns))
            assert consumer.counters()["cma_peers"] == 0, "read over UCX"
        finally:
            consumer.close()
    finally:
        p.close()


def test_a_bad_same_host_value_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"data_plane\.same_host: expected ucx or cma, got 'shm'"):
        UcxDataPlane({"same_host": "shm"})


def test_one_sided_planes_read_this_hosts_producer_with_cma_by_default() -> None:
    """No option on either side: the default (one-sided reads) is ``same_host: cma``."""
    p = Pair({}, {})
    try:
        p.holds.hold("a", [6], 16)
        [res] = read_many(p, [("a", [6], [2])])
        assert res.ok and p.arrived([6], [2]) and p.served == []
        assert p.consumer.counters()["cma_peers"] == 1
    finally:
        p.close()


def test_two_sided_reads_keep_ucx_and_refuse_cma_by_name() -> None:
    """A two-sided producer serves every byte itself: it publishes no cma address by default, and
    ``same_host: cma`` beside ``reads: two-sided`` is refused, naming both."""
    import msgspec
    from kvxfer.connectors.ucx.wire import UcxAddress

    with pytest.raises(ValueError, match=r"data_plane\.same_host: cma .* reads: two-sided rules out"):
        UcxDataPlane({"reads": "two-sided", "same_host": "cma"})
    plane = UcxDataPlane({"reads": "two-sided"})
    try:
        plane.register([region(0, np.zeros(NB * STRIDE, dtype=np.uint8))])
        addr = msgspec.msgpack.decode(plane.address(), type=UcxAddress)
        assert addr.cma is None and not addr.one_sided
        assert UcxDataPlane.engine_reads({"reads": "two-sided"}, []) is None
    finally:
        plane.close()
