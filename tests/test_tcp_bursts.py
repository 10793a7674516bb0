"""tcp: a burst's small reads of one producer go as one request and one reply.

Two real tcp planes in this process (sockets, the producer's serving threads), the producer's
reads checked by a real HoldRegistry. Checked, on a Unix socket (spliced) and on loopback TCP:
the reads of a burst arrive bit-exact and are reported each alone, with one request served for
all; a read of a request the producer does not hold makes it refuse the joint request, and each
read is then asked for alone (the held ones arrive, the other fails as not held, by itself, and
writes nothing); a burst over MERGE_BYTES is cut into several requests; a read large enough to be
split over the streams is never joined; a producer checks each part of a joint request against
its own request, so a part of a request it does not hold cannot ride on one it does.
"""

from __future__ import annotations

import socket
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
from test_cma_bursts import read_many
from test_hold_board import NB, STRIDE, region
from test_hold_board import Pair as CmaPair

from kvxfer.dataplane import BatchResult
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
    monkeypatch.setattr(tcp, "MIN_SPLIT_PIECE", STRIDE)
    monkeypatch.setattr(tcp, "MERGE_BYTES", 16 << 20)
    pair.served.clear()
    pair.holds.hold("big", [10, 11], 32)
    pair.holds.hold("d", [12], 16)
    pair.holds.hold("e", [13], 16)
    out = pair.burst([("big", [10, 11], [10, 11]), ("d", [12], [12]), ("e", [13], [13])])
    assert all(r.ok for r in out.values()) and pair.arrived([10, 11, 12, 13], [10, 11, 12, 13])
    assert sorted(pair.served) == [1, 1, 2], "big: one request on each stream; d and e: one joint request"


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
