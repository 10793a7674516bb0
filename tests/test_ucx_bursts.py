"""ucx: a burst's staged reads of one producer go as one request and one reply.

Two real ucx planes in this process (the consumer's receive worker and the producer's worker,
over UCX), the producer's reads checked by a real HoldRegistry. Checked: the reads of a burst
arrive bit-exact and are reported each alone, with one request served for all; a read of a
request the producer does not hold makes it refuse the joint request, and each read is then
asked for alone (the held ones arrive, the other fails as not held, by itself); reads of large
pieces (sent piece by piece, not staged) are not joined two-sided; one-sided (``reads:
one-sided``) every read of a burst is one grant. The first two run both ways.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import ucxx  # noqa: F401  (the README's test install has the ucx extra: a missing ucxx is a failure, not a skip)
from burst_checks import (
    check_a_burst_is_one_request_and_each_read_is_reported_alone,
    check_a_refused_part_makes_each_read_ask_alone,
)
from kvxfer.connectors.ucx import UcxDataPlane
from test_cma_bursts import read_many
from test_hold_board import NB, STRIDE, region
from test_hold_board import Pair as CmaPair

from kvxfer.dataplane import BatchResult
from kvxfer.handshake import HandshakeError
from kvxfer.protocol import ErrorCode
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.producer import HoldRegistry

UCX_WIRE = {"same_host": "ucx"}  # every producer over UCX, this host's too (the default reads it with CMA)


class Pair(CmaPair):
    """test_hold_board's pair with ucx planes: a producer and a consumer in this process, the
    producer's holds in a registry, the requests it serves counted (their parts)."""

    def __init__(self, options: dict[str, Any] | None = None, ucx_wire: bool = True) -> None:  # not super's
        self.src = np.random.default_rng(1).integers(0, 255, NB * STRIDE, dtype=np.uint8)
        self.dst = np.zeros(NB * STRIDE, dtype=np.uint8)
        # UCX's own wire (``ucx_wire``) unless the options say otherwise: the default reads this host's
        # producer with CMA (tests/test_ucx_same_host.py)
        if ucx_wire and (options or {}).get("reads") != "two-sided":
            options = {**UCX_WIRE, **(options or {})}
        self.producer, self.consumer = UcxDataPlane(options), UcxDataPlane(options)
        self.producer.register([region(0, self.src)])
        self.consumer.register([region(0, self.dst)])
        layout = ParallelLayout(tp_size=1, pp_size=1, num_layers=1, num_kv_heads=1)
        self.holds = HoldRegistry(layout, 0, 0, NB, {0: (STRIDE, NB * STRIDE)}, 60.0, 600.0,
                                  region_layers={0: (0, 1)})
        self.producer.set_read_validator(self.holds.validate)
        self.served: list[int] = []
        check = self.producer._check_read

        def counted(req, client):  # every read request served, one-sided (granted) or two-sided
            self.served.append(len(req.parts) or 1)
            return check(req, client)

        self.producer._check_read = counted
        self.consumer.connect("p", self.producer.address())

    def burst(self, reads: list[tuple[str, list[int], list[int]]]) -> dict[str, BatchResult]:
        """(request id, remote blocks, local blocks) each, as one ``read_many``; each read's result."""
        return {rid: res for (rid, _, _), res in zip(reads, read_many(self, reads), strict=True)}

    def close(self) -> None:
        super().close()
        rt = self.consumer.rt
        deadline = time.monotonic() + 5  # the retired receive worker is freed a second later: not in later tests
        while rt._retired and time.monotonic() < deadline:
            time.sleep(0.05)
        del self.consumer, self.producer  # their UCX objects' descriptors go now, not at a later test's collection
        gc.collect()


@pytest.fixture(params=["one-sided", "two-sided"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair({"reads": request.param})
    yield p
    p.close()


def test_a_burst_of_staged_reads_is_one_request_and_each_is_reported_alone(pair: Pair) -> None:
    check_a_burst_is_one_request_and_each_read_is_reported_alone(pair)


def test_a_refused_part_makes_each_read_ask_alone(pair: Pair) -> None:
    check_a_refused_part_makes_each_read_ask_alone(pair)


@pytest.mark.parametrize("reads", ["one-sided", "two-sided"])
def test_reads_of_large_pieces_are_joined_only_one_sided(reads: str) -> None:
    """Two-sided, pieces of STRIDE bytes are sent as they are, a reply per read; one-sided, the
    grant of a burst is one request whatever the pieces' size (the consumer gets them itself)."""
    p = Pair({"staging_threshold": STRIDE, "reads": reads})
    try:
        p.holds.hold("a", [1], 16)
        p.holds.hold("b", [2], 16)
        out = p.burst([("a", [1], [8]), ("b", [2], [9])])
        assert out["a"].ok and out["b"].ok and p.arrived([1, 2], [8, 9])
        assert p.served == ([2] if reads == "one-sided" else [1, 1])
    finally:
        p.close()


def test_reads_option_refuses_a_bad_value_and_a_one_sided_consumer_refuses_a_two_sided_producer() -> None:
    with pytest.raises(ValueError, match=r"data_plane\.reads: expected one-sided or two-sided, got 'sideways'"):
        UcxDataPlane({"reads": "sideways"})
    src = np.zeros(NB * STRIDE, dtype=np.uint8)
    producer, consumer = UcxDataPlane({"reads": "two-sided"}), UcxDataPlane({"reads": "one-sided", **UCX_WIRE})
    try:
        producer.register([region(0, src)])
        with pytest.raises(ConnectionError, match=r"offers no one-sided ucx reads.*reads: two-sided"):
            consumer.connect("p", producer.address())
        assert consumer._peers == {}, "a refused connect leaves no peer behind"
    finally:
        consumer.close()
        producer.close()


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)


def test_each_one_sided_consumer_gets_an_rma_worker_of_its_own_and_dropping_the_producer_stops_it() -> None:
    """A consumer killed while writing a get into an RMA worker's shared-memory FIFO wedges that
    worker (tests/test_faults.py kills one): so each consumer plane gets a worker of its own, named
    in the producer's answer to its hello, and the producer stops it when the consumer drops it."""
    p = Pair({"reads": "one-sided"})
    dst = np.zeros(NB * STRIDE, dtype=np.uint8)
    other = UcxDataPlane({"reads": "one-sided", **UCX_WIRE})
    try:
        other.register([region(0, dst)])
        other.connect("p", p.producer.address())
        workers = p.producer._rma_workers
        assert len(workers) == 2 and len({bytes(w.address.tobytes()) for w in workers.values()}) == 2
        p.holds.hold("a", [4, 6], 32)
        out = read_many(p, [("a", [4, 6], [0, 1])]) + read_many(_as_pair(p, other), [("a", [4, 6], [2, 3])])
        assert all(r.ok for r in out), out
        assert p.arrived([4, 6], [0, 1])
        assert np.array_equal(dst[2 * STRIDE : 4 * STRIDE].reshape(2, STRIDE), p.src.reshape(NB, STRIDE)[[4, 6]])
        other.disconnect("p")
        wait_for(lambda: len(workers) == 1, "the dropped consumer's RMA worker stopped")
        p.holds.hold("b", [7], 16)
        assert read_many(p, [("b", [7], [9])])[0].ok and p.arrived([7], [9]), "the other consumer reads on"
    finally:
        other.close()
        p.close()


def _as_pair(p: Pair, consumer: UcxDataPlane) -> Pair:
    """``p`` seen through another consumer plane (read_many reads through ``.consumer``)."""
    q = Pair.__new__(Pair)
    q.consumer = consumer
    return q


def test_a_one_sided_hello_without_a_valid_token_is_refused_at_once_by_code() -> None:
    """The producer answers a one-sided hello it refuses (the consumer waits for that answer): the
    connect fails at once with the code, not at the plane's timeout."""
    src = np.zeros(NB * STRIDE, dtype=np.uint8)
    producer, consumer = (UcxDataPlane({"reads": "one-sided", **UCX_WIRE}),
                          UcxDataPlane({"reads": "one-sided", "timeout_s": 20, **UCX_WIRE}))
    try:
        producer.register([region(0, src)])
        producer.set_token_checker(lambda token: token == b"good")
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match="refused one-sided reads: no valid handshake token") as e:
            consumer.connect("p", producer.address(), b"bad")
        assert e.value.code is ErrorCode.AUTH and time.monotonic() - t0 < 10
        assert consumer._peers == {} and producer._rma_workers == {}, "nothing is left on either side"
        consumer.connect("p", producer.address(), b"good")
        assert len(producer._rma_workers) == 1
    finally:
        consumer.close()
        producer.close()


def test_a_one_sided_read_from_a_consumer_the_producer_forgot_is_refused_at_once_by_code() -> None:
    """The grant comes back on the control socket, refusals too: a consumer the producer no longer
    knows (its endpoint closed after a timeout) hears AUTH at once, not at the plane's deadline."""
    p = Pair({"reads": "one-sided", "timeout_s": 20})
    try:
        p.holds.hold("a", [3], 16)

        async def forget() -> None:
            for key in list(p.producer._clients):
                p.producer._forget_client(key)

        p.producer.rt.submit(forget()).result(5)
        t0 = time.monotonic()
        (res,) = read_many(p, [("a", [3], [0])])
        assert not res.ok and res.code is ErrorCode.AUTH and time.monotonic() - t0 < 10, res
        assert not p.dst[:STRIDE].any(), "the refused read wrote nothing"
    finally:
        p.close()


def test_a_connect_the_producer_never_answers_times_out_naming_its_step_and_leaves_no_peer() -> None:
    """A hello answered by no one (a control socket that takes messages and says nothing): the
    connect fails at the plane's timeout with a TimeoutError that says where it stood, keeps no
    half-made peer, says bye after its hello (so a producer that answers late stops the RMA
    worker it made), and a later connect to the real control socket works."""
    import msgspec
    import zmq
    from kvxfer.connectors.ucx.wire import UcxAddress

    src = np.zeros(NB * STRIDE, dtype=np.uint8)
    producer, consumer = UcxDataPlane(UCX_WIRE), UcxDataPlane({"timeout_s": 1.5, **UCX_WIRE})
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    try:
        producer.register([region(0, src)])
        real = msgspec.msgpack.decode(producer.address(), type=UcxAddress)
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        mute = msgspec.msgpack.encode(msgspec.structs.replace(real, control=f"tcp://127.0.0.1:{port}"))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"within 1.5s: waiting for the producer's answer to the hello"):
            consumer.connect("p", mute)
        assert 1.4 < time.monotonic() - t0 < 10
        assert consumer._peers == {}, "the half-made peer is not kept"
        said = [silent.recv_multipart()[1][:1] for _ in range(2) if silent.poll(2000)]
        assert said == [b"H", b"B"], "a hello, then a bye: an RMA worker made for it late would be stopped"
        consumer.connect("p", producer.address())
        assert list(consumer._peers) == ["p"] and len(producer._rma_workers) == 1
    finally:
        silent.close()
        consumer.close()
        producer.close()


def test_planes_closed_after_one_sided_reads_leave_ucx_nothing_to_warn_about_at_exit() -> None:
    """Close stops the RMA workers, then unmaps the producer's regions, and a consumer's retired
    keys are destroyed: a process that read one-sided and closed its planes exits without UCX
    warning of regions still in use or keys never returned."""
    import subprocess
    import sys
    from pathlib import Path

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from test_ucx_bursts import Pair\nfrom test_cma_bursts import read_many\n"
            "p = Pair({'reads': 'one-sided'})\np.holds.hold('a', [3], 16)\n"
            "(r,) = read_many(p, [('a', [3], [0])])\nassert r.ok, r\n"
            "assert (p.dst[:%d] == p.src[3 * %d:4 * %d]).all()\np.close()\n" % (STRIDE, STRIDE, STRIDE))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    said = out.stdout + out.stderr
    assert "destroying inuse region" not in said and "not returned to mpool" not in said, said


def test_a_connect_whose_rma_wire_up_stalls_times_out_naming_that_step_and_retires_its_worker() -> None:
    """The producer answers the hello, but the RMA worker it names never progresses (as a worker
    whose progress thread missed its wakeup, which once in CI stalled a first connect for 20 s):
    the connect fails at the plane's timeout naming the wire-up, retires the worker it made for
    those gets, keeps no peer, and says bye."""
    import threading

    import msgspec
    import zmq
    from kvxfer.connectors.ucx.wire import Hello, HelloAck, UcxAddress
    from ucxx._lib import libucxx as ux

    src = np.zeros(NB * STRIDE, dtype=np.uint8)
    producer, consumer = UcxDataPlane(UCX_WIRE), UcxDataPlane({"timeout_s": 1.5, **UCX_WIRE})
    stuck = ux.UCXWorker(producer.rt._context(), enable_delayed_submission=False, enable_python_future=False)
    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    said: list[bytes] = []
    done = threading.Event()

    def answer() -> None:  # a control socket that names the never-progressed worker
        while not done.is_set():
            if not fake.poll(50):
                continue
            identity, msg = fake.recv_multipart()
            said.append(msg[:1])
            if msg[:1] == b"H":
                hello = msgspec.msgpack.decode(msg[1:], type=Hello)
                ack = HelloAck(hello.hello_id, rma=bytes(stuck.address.tobytes()))
                fake.send_multipart([identity, b"A" + msgspec.msgpack.encode(ack)])

    answering = threading.Thread(target=answer, daemon=True)
    try:
        producer.register([region(0, src)])
        real = msgspec.msgpack.decode(producer.address(), type=UcxAddress)
        port = fake.bind_to_random_port("tcp://127.0.0.1")
        answering.start()
        retired = len(consumer.rt._retired)
        with pytest.raises(TimeoutError, match=r"within 1.5s: wiring up the endpoint to the producer's RMA worker"):
            consumer.connect("p", msgspec.msgpack.encode(msgspec.structs.replace(
                real, control=f"tcp://127.0.0.1:{port}")))
        assert consumer._peers == {}
        assert len(consumer.rt._retired) == retired + 1, "the worker made for its gets is retired"
        wait_for(lambda: said == [b"H", b"B"], f"a hello, then a bye (got {said})")
    finally:
        done.set()
        answering.join(5)
        fake.close()
        consumer.close()
        producer.close()


def test_rma_progress_option_refuses_a_bad_value_and_is_native_outside_an_agent() -> None:
    """The default is ucxx's native threads; ``auto`` polls RMA workers from a Python thread only in a
    transfer agent, and in an engine's own process (this one) keeps native threads, which need no GIL."""
    with pytest.raises(ValueError, match=r"data_plane\.rma_progress: expected auto, native or adaptive, got 'fast'"):
        UcxDataPlane({"rma_progress": "fast"})
    planes = [UcxDataPlane({}), UcxDataPlane({"rma_progress": "adaptive"}), UcxDataPlane({"rma_progress": "native"}),
              UcxDataPlane({"rma_progress": "auto"})]
    try:
        assert [p.rma_adaptive for p in planes] == [False, True, False, False]
    finally:
        for p in planes:
            p.close()
