"""Checks shared by the planes that send a burst's reads of one producer as one request
(``ReadRequest.parts``: tests/test_ucx_bursts.py, tests/test_tcp_bursts.py). ``pair`` is such a
test's Pair: a producer and a consumer plane, the producer's holds in ``holds``, the requests it
served in ``served`` (their parts), ``burst`` making one ``read_many``."""

from __future__ import annotations

from typing import Any

from test_hold_board import STRIDE

from kvxfer.protocol import ErrorCode


def check_a_burst_is_one_request_and_each_read_is_reported_alone(pair: Any) -> None:
    reads = [("a", [3, 9], [0, 1]), ("b", [10], [2]), ("c", [20, 21, 5], [3, 4, 5])]
    for rid, remote, _ in reads:
        pair.holds.hold(rid, remote, 16 * len(remote))
    out = pair.burst(reads)
    assert all(out[rid].ok and out[rid].nbytes == len(r) * STRIDE for rid, r, _ in reads), out
    assert all(pair.arrived(r, loc) for _, r, loc in reads)
    assert pair.served == [3], "one request, of three parts"


def check_a_refused_part_makes_each_read_ask_alone(pair: Any) -> None:
    pair.holds.hold("a", [3], 16)
    pair.holds.hold("c", [7], 16)
    out = pair.burst([("a", [3], [0]), ("x", [5], [1]), ("c", [7], [2])])
    assert out["a"].ok and out["c"].ok and pair.arrived([3, 7], [0, 2])
    assert not out["x"].ok and out["x"].code is ErrorCode.NOT_HELD
    assert not pair.dst[STRIDE:2 * STRIDE].any(), "the refused read wrote nothing"
    assert pair.served == [3, 1, 1, 1], "the joint request, refused; then each alone"
