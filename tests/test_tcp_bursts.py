"""tcp: a burst's small reads of one producer go as one request and one reply.

Two real tcp planes in this process (sockets, the producer's serving threads), the producer's
reads checked by a real HoldRegistry. Checked, on a Unix socket (spliced) and on loopback TCP:
the reads of a burst arrive bit-exact and are reported each alone, with one request served for
all; a read of a request the producer does not hold makes it refuse the joint request, and each
read is then asked for alone (the held ones arrive, the other fails as not held, by itself, and
writes nothing); a burst over MERGE_BYTES is cut into several requests; a read large enough to be
split over the streams, or of big pieces, is never joined; a producer checks each part of a joint
request against its own request, so a part of a request it does not hold cannot ride on one it
does; a refused joint request's reads, asking alone, keep at most PIPELINE_DEPTH requests out.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import kvxfer.connectors.tcp as tcp
import numpy as np
import pytest
from burst_checks import (
    check_a_burst_is_one_request_and_each_read_is_reported_alone,
    check_a_refused_part_makes_each_read_ask_alone,
)
from kvxfer.connectors.tcp import TcpDataPlane, recv_frame, send_frame
from test_cma_bursts import descs, read_many
from test_hold_board import NB, STRIDE, region
from test_hold_board import Pair as CmaPair

from kvxfer.dataplane import BatchResult, Descriptors
from kvxfer.protocol import DataHello, ErrorCode, ReadReply, ReadRequest, decode_data, encode
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.producer import HoldRegistry


class Pair(CmaPair):
    """test_hold_board's pair with tcp planes, the requests the producer serves counted (their parts)."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:  # not super's
        self.src = np.random.default_rng(2).integers(0, 255, NB * STRIDE, dtype=np.uint8)
        self.dst = np.zeros(NB * STRIDE, dtype=np.uint8)
        self.producer, self.consumer = TcpDataPlane(options), TcpDataPlane(options)
        self.producer.register([region(0, self.src)])
        self.consumer.register([region(0, self.dst)])
        layout = ParallelLayout(tp_size=1, pp_size=1, num_layers=1, num_kv_heads=1)
        self.holds = HoldRegistry(layout, 0, 0, NB, {0: (STRIDE, NB * STRIDE)}, 60.0, 600.0,
                                  region_layers={0: (0, 1)})
        self.producer.set_read_validator(self.holds.validate)
        self.served: list[int] = []
        serve = self.producer._serve_read

        def counted(conn: Any, peer: str, req: ReadRequest, splicer: Any) -> None:
            self.served.append(len(req.parts) or 1)
            serve(conn, peer, req, splicer)

        self.producer._serve_read = counted  # type: ignore[method-assign]
        self.consumer.connect("p", self.producer.address())

    def burst(self, reads: list[tuple[str, list[int], list[int]]]) -> dict[str, BatchResult]:
        """(request id, remote blocks, local blocks) each, as one ``read_many``; each read's result."""
        return {rid: res for (rid, _, _), res in zip(reads, read_many(self, reads), strict=True)}


@pytest.fixture(params=["unix", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair({"transport": request.param})
    yield p
    p.close()


def test_a_burst_of_small_reads_is_one_request_and_each_is_reported_alone(pair: Pair) -> None:
    check_a_burst_is_one_request_and_each_read_is_reported_alone(pair)


def test_a_refused_part_makes_each_read_ask_alone(pair: Pair) -> None:
    check_a_refused_part_makes_each_read_ask_alone(pair)
    pair.holds.hold("d", [8], 16)
    assert pair.burst([("d", [8], [6])])["d"].ok and pair.arrived([8], [6]), "the connection reads on"


def test_a_burst_over_merge_bytes_is_cut_and_a_read_split_over_streams_is_never_joined(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "MERGE_BYTES", 2 * STRIDE)
    reads = [("a", [1], [0]), ("b", [2], [1]), ("c", [3], [2])]
    for rid, remote, _ in reads:
        pair.holds.hold(rid, remote, 16)
    out = pair.burst(reads)
    assert all(r.ok for r in out.values()) and all(pair.arrived(r, loc) for _, r, loc in reads)
    assert sorted(pair.served) == [1, 2], "two reads of STRIDE bytes fill a request of 2 * STRIDE; the third goes alone"
    monkeypatch.setattr(tcp, "MIN_SPLIT_BYTES", 2 * STRIDE)  # a read of 2 blocks is now split over the streams
    monkeypatch.setattr(tcp, "MIN_SPLIT_PIECE", STRIDE)  # ... and a piece of a block is a big one
    monkeypatch.setattr(tcp, "MERGE_BYTES", 16 << 20)
    pair.served.clear()
    for rid, blocks in (("big", [10, 11]), ("f", [12]), ("d", [13]), ("e", [14])):
        pair.holds.hold(rid, blocks, 16 * len(blocks))
    half = STRIDE // 2  # d and e as two pieces of half a block each: small pieces
    d_e = [Descriptors.from_rows([(0, b * STRIDE + h, 0, b * STRIDE + h, half) for h in (0, half)]) for b in (13, 14)]
    ids = pair.consumer.read_many([("p", "big", descs([10, 11], [10, 11])), ("p", "f", descs([12], [12])),
                                   ("p", "d", d_e[0]), ("p", "e", d_e[1])])
    results = wait_results(pair, ids)
    assert all(r.ok for r in results) and pair.arrived([10, 11, 12, 13, 14], [10, 11, 12, 13, 14])
    assert sorted(pair.served) == [1, 1, 1, 2], "big: one request on each stream; f (big pieces) alone; d and e joint"


def wait_results(pair: Pair, ids: list[int]) -> list[BatchResult]:
    """The results of ``ids`` in their order, each reported once, within 10 s."""
    got: dict[int, BatchResult] = {}
    deadline = time.monotonic() + 10
    while len(got) < len(ids) and time.monotonic() < deadline:
        for res in pair.consumer.poll():
            assert res.batch_id not in got, "a read reported twice"
            got[res.batch_id] = res
        time.sleep(0.001)
    assert len(got) == len(ids), "not every read finished within 10 s"
    return [got[i] for i in ids]


def test_a_joint_request_is_checked_part_by_part_by_the_producer() -> None:
    """A consumer that puts a request it has no hold for into a joint request (its own framing,
    over a real connection) is refused, by the part's request, and gets no byte of it."""
    p = Pair({"transport": "tcp"})
    try:
        p.holds.hold("a", [3], 16)
        addr = p.producer._address
        with socket.create_connection((addr.host, addr.port), timeout=5) as s:
            send_frame(s, encode(DataHello(engine_id="spy")))
            stride = np.array([STRIDE], np.int64)
            regions, offsets = np.zeros(2, np.int64).tobytes(), np.array([3, 5], np.int64) * STRIDE
            send_frame(s, encode(ReadRequest(request_id="a", batch_id=1, regions=regions, offsets=offsets.tobytes(),
                                             lengths=np.repeat(stride, 2).tobytes(), parts=[("a", 1), ("x", 1)])))
            reply = decode_data(recv_frame(s))
            assert isinstance(reply, ReadReply) and reply.nbytes == 0
            assert reply.code is ErrorCode.NOT_HELD and "request x" in reply.error
            send_frame(s, encode(ReadRequest(request_id="a", batch_id=2, regions=regions, offsets=offsets.tobytes(),
                                             lengths=np.repeat(stride, 2).tobytes(), parts=[("a", 1)])))
            reply = decode_data(recv_frame(s))
            assert isinstance(reply, ReadReply) and reply.code is ErrorCode.BAD_MESSAGE, "parts that do not cover"
    finally:
        p.close()


def test_a_refused_joint_request_keeps_at_most_pipeline_depth_requests_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """One stream, a burst of five joint requests queued while the stream is held, so that four
    are out at once; the first is refused and its two reads ask alone: requests sent ahead must
    still fit the socket buffers, so no more than PIPELINE_DEPTH are ever awaited at once."""
    monkeypatch.setattr(tcp, "MERGE_BYTES", 2 * STRIDE)
    out_now, most = [0], [0]
    request, header = tcp._Stream._request, tcp._Stream._header

    def counted_request(self: Any, sock: Any, job: Any) -> None:
        request(self, sock, job)
        out_now[0] += 1
        most[0] = max(most[0], out_now[0])

    def counted_header(self: Any, sock: Any, job: Any, wait_until: float) -> None:
        try:
            header(self, sock, job, wait_until)
        finally:
            out_now[0] -= 1

    monkeypatch.setattr(tcp._Stream, "_request", counted_request)
    monkeypatch.setattr(tcp._Stream, "_header", counted_header)
    p = Pair({"transport": "unix", "streams": 1})
    try:
        reads = [(f"r{i}", [i], [i]) for i in range(10)]
        for rid, remote, _ in reads:
            if rid != "r1":  # r0 and r1 share the first joint request: it is refused
                p.holds.hold(rid, remote, 16)
        stream = p.consumer._streams["p"][0]
        with stream._busy:  # the stream's thread takes the whole burst at once, four requests out
            ids = p.consumer.read_many([("p", rid, descs(r, loc)) for rid, r, loc in reads])
        out = {rid: res for (rid, _, _), res in zip(reads, wait_results(p, ids), strict=True)}
        assert not out["r1"].ok and out["r1"].code is ErrorCode.NOT_HELD
        assert all(out[rid].ok for rid, _, _ in reads if rid != "r1")
        assert p.arrived([i for i in range(10) if i != 1], [i for i in range(10) if i != 1])
        assert p.served[0] == 2 and sorted(p.served) == [1, 1, 2, 2, 2, 2, 2], p.served
        assert most[0] == tcp.PIPELINE_DEPTH, f"requests out at once: {most[0]}"
    finally:
        p.close()
