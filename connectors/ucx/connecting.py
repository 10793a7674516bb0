"""The ucx plane's consumer side of its connections: a producer's endpoint, the hello on its
control socket and, one-sided, the RMA worker it names and the keys of its regions; dropping a
producer, and moving every producer to a fresh receive worker when one is retired. Each step
of a connect is timed, so a slow or stuck one says where it stood.

Mixed into UcxDataPlane (__init__.py), whose read path (read_many, _read) uses the peers made
here; every coroutine runs on the UCX runtime's loop thread (runtime.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kvxfer.handshake import HandshakeError
from kvxfer.protocol import ErrorCode, ReadReply

from .rma import Getter, RemoteRegions
from .runtime import UcxRuntime, close_now
from .wire import Hello, HelloAck, UcxAddress

logger = logging.getLogger(__name__)

SLOW_CONNECT_S = 2.0  # a connect slower than this is logged with its steps


class ConnectSteps:
    """The step a connect is in and how long each one before it took (the loop thread writes;
    the calling thread reads once the connect has unwound there)."""

    def __init__(self, first: str = "making an endpoint to the producer") -> None:
        self.began = self._since = time.monotonic()
        self.step = first
        self.took: list[tuple[str, float]] = []

    def at(self, step: str) -> None:
        now = time.monotonic()
        self.took.append((self.step, now - self._since))
        self.step, self._since = step, now

    def finish(self) -> None:
        self.at("")

    def total_s(self) -> float:
        return time.monotonic() - self.began

    def describe(self) -> str:
        took = "; ".join(f"{s}: {t * 1000:.0f} ms" for s, t in self.took)
        if not self.step:  # finished
            return took
        now = f"{self.step} for {time.monotonic() - self._since:.2f}s"
        return f"{now} (before: {took})" if took else now


@dataclass
class Receiver:
    """One plane's receive worker, where its producers send replies, and the reads waiting on it."""

    ctx: Any  # an ApplicationContext around the worker (UcxRuntime.new_receive_worker)
    address: bytes  # the worker's UCX address, sent to producers in hellos
    reads: set[asyncio.Task[Any]] = field(default_factory=set)


@dataclass
class RmaReads:
    """One-sided reads from one producer: a worker of their own (so a producer that dies while
    its replies fill that worker's shared-memory FIFO wedges nothing of other producers'), an
    endpoint from it to the producer's RMA worker, its regions' keys unpacked there, the getter.
    Retired, never reused, when a read from that producer fails or the receive worker is renewed:
    unprogressed, it lands no late byte."""

    ctx: Any  # an ApplicationContext around the worker (UcxRuntime.new_receive_worker)
    endpoint: Any
    regions: RemoteRegions
    getter: Getter


@dataclass
class Peer:
    """A producer this plane reads from, as seen from one receive worker."""

    address: UcxAddress
    token: bytes
    dealer: Any  # ZMQ DEALER to its control socket (loop thread only)
    endpoint: Any  # on the receiver's worker
    receiver: Receiver
    rma: RmaReads | None = None  # set when this plane reads one-sided
    reading: int = 0  # reads in flight on this endpoint
    grants: dict[int, asyncio.Future[ReadReply]] = field(default_factory=dict)  # one-sided reads' batch -> grant


class Connecting:
    """The consumer side's connections (mixed into the plane). ``_peers`` and ``_receiver``
    belong to the loop thread; ``connect`` and ``disconnect`` are called from the consumer's
    worker thread and wait for the loop."""

    # the plane's, declared for the methods here
    rt: UcxRuntime
    ucxx: Any
    plane_id: int
    timeout_s: float
    one_sided: bool
    engine_id: str
    _session: bytes
    _ids: itertools.count[int]
    _peers: dict[str, Peer]
    _receiver: Receiver | None

    def connect(self, peer_id: str, address: bytes, token: bytes = b"") -> None:
        try:
            addr = msgspec.msgpack.decode(address, type=UcxAddress)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ConnectionError(f"peer {peer_id}: bad ucx address: {e}") from None
        if peer_id in self._peers:
            return
        if self.one_sided and not (addr.one_sided and addr.regions):
            raise ConnectionError(f"peer {peer_id} offers no one-sided ucx reads (an older kvxfer, or UCX would not "
                                  f"map its memory): set connector.data_plane.reads: two-sided")
        steps = ConnectSteps()
        # the deadline is kept on the loop thread: once this returns or raises, _connect has unwound
        self.rt.submit(self._connect_within(peer_id, addr, token, steps)).result(timeout=self.timeout_s + 10)
        if steps.total_s() > SLOW_CONNECT_S:
            logger.warning("ucx plane %d: slow connect to peer %s: %s", self.plane_id, peer_id, steps.describe())

    async def _connect_within(self, peer_id: str, addr: UcxAddress, token: bytes, steps: ConnectSteps) -> None:
        try:
            await asyncio.wait_for(self._connect(peer_id, addr, token, steps), self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError):  # two types on Python 3.10, one from 3.11
            raise TimeoutError(f"peer {peer_id}: ucx connect unfinished within {self.timeout_s:g}s: "
                               f"{steps.describe()}") from None
        steps.finish()

    async def _connect(self, peer_id: str, addr: UcxAddress, token: bytes, steps: ConnectSteps) -> None:
        if self._receiver is None:
            self._receiver = self._new_receiver()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(addr.control)
        try:
            self._peers[peer_id] = await self._hello(addr, token, dealer, self._receiver, steps)
        except BaseException:
            if self.one_sided:  # the producer may have made an RMA worker for this hello: it stops it
                with contextlib.suppress(zmq.ZMQError):
                    dealer.send(b"B" + self._session, zmq.NOBLOCK)
            dealer.close(linger=500 if self.one_sided else 0)
            raise

    def _new_receiver(self) -> Receiver:
        ctx = self.rt.new_receive_worker()
        return Receiver(ctx, bytes(ctx.worker_address))

    async def _hello(self, addr: UcxAddress, token: bytes, dealer: Any, receiver: Receiver,
                     steps: ConnectSteps | None = None) -> Peer:
        """An endpoint from the receive worker to the producer, and a hello that tells it where to reply."""
        steps = steps or ConnectSteps()
        ucxx = self.ucxx
        ep = await receiver.ctx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(addr.worker),
                                                                    endpoint_error_handling=False)
        hello_id = next(self._ids)
        dealer.send(b"H" + msgspec.msgpack.encode(Hello(worker=receiver.address, plane=self.plane_id,
                                                         engine_id=self.engine_id, token=token,
                                                         session=self._session, rma=self.one_sided,
                                                         hello_id=hello_id)))
        rma: RmaReads | None = None
        if self.one_sided:
            steps.at("waiting for the producer's answer to the hello")
            try:
                worker = await self._ack(dealer, hello_id)
                steps.at("wiring up the endpoint to the producer's RMA worker")
                rma = await self._rma_to(addr, worker)
            except BaseException:
                close_now(ep)
                raise
        return Peer(addr, token, dealer, ep, receiver, rma)

    async def _ack(self, dealer: Any, hello_id: int) -> bytes:
        """The producer's answer to hello ``hello_id``: the address of the RMA worker it made for
        this plane. Raises HandshakeError with the producer's code if it refused, TimeoutError
        if it did not answer within the plane's timeout."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            while dealer.poll(0):
                msg = dealer.recv(zmq.NOBLOCK)
                if msg[:1] != b"A":  # a grant to a read given up
                    continue
                try:
                    ack = msgspec.msgpack.decode(msg[1:], type=HelloAck)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    raise ConnectionError(f"bad answer to a ucx hello: {e}") from None
                if ack.hello_id != hello_id:  # to an earlier hello that timed out here
                    continue
                if ack.code is not None or not ack.rma:
                    raise HandshakeError(f"the producer refused one-sided reads: {ack.error or 'no RMA worker'}",
                                         ack.code or ErrorCode.INTERNAL)
                return ack.rma
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"no answer to a ucx hello within {self.timeout_s:g}s")
            await asyncio.sleep(0.001)

    async def _rma_to(self, addr: UcxAddress, worker: bytes) -> RmaReads:
        """A worker and endpoint for one-sided reads from one producer (``worker`` is the RMA
        worker it made for this plane), wired up now (a flush: the first load does not pay for
        it) within the plane's timeout."""
        ctx = self.rt.new_receive_worker()
        ep = None
        regions: RemoteRegions | None = None
        try:
            ep = await ctx.create_endpoint_from_worker_address(self.ucxx.get_ucx_address_from_buffer(worker),
                                                               endpoint_error_handling=False)
            handle = ep._ep.handle
            regions = RemoteRegions(handle, dict(addr.regions))
            rma = RmaReads(ctx, ep, regions, Getter(handle))
            req = rma.getter.flush()
            async with self.rt.active():
                await asyncio.wait_for(self._landed(rma.getter, req), self.timeout_s)
            return rma
        except BaseException:
            if regions is not None:  # no get was issued on them
                regions.close()
            self.rt.retire_receive_worker(ctx, [ep] if ep is not None else [], keep_s=1.0)
            raise

    @staticmethod
    async def _landed(getter: Getter, req: int | None) -> None:
        while not getter.done(req):  # a producer that died fails the flush (UcxRmaError: the peer is lost)
            await asyncio.sleep(0)

    def _retire_rma(self, peer: Peer) -> None:
        if peer.rma is not None:
            if not peer.reading:
                peer.rma.regions.close()
            keep_s = self.timeout_s + 1.0 if peer.reading else 1.0  # freed once the reads on it unwound
            self.rt.retire_receive_worker(peer.rma.ctx, [peer.rma.endpoint], keep_s=keep_s,
                                          on_free=peer.rma.regions.close if peer.reading else None)
            peer.rma = None

    def disconnect(self, peer_id: str) -> None:
        if peer_id not in self._peers:
            return
        try:
            self.rt.submit(self._drop(peer_id)).result(timeout=10)
        except Exception as e:  # the caller goes on either way: the peer is no longer used
            logger.warning("ucx plane %d: dropping peer %s: %s: %s", self.plane_id, peer_id, type(e).__name__, e)

    async def _drop(self, peer_id: str) -> None:
        """Close the endpoint and the control socket without waiting for the peer. A peer
        dropped with reads in flight may be stopped with a reply half sent, or have died
        writing into the receive worker's shared-memory FIFO and wedged it, so that worker
        is retired and every other peer moves to a fresh one (_renew_receiver)."""
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return
        if self.one_sided:  # the producer stops the RMA worker it made for this plane (linger: the bye goes out)
            peer.dealer.send(b"B" + self._session, zmq.NOBLOCK)
        peer.dealer.close(linger=500 if self.one_sided else 0)
        if peer.reading and peer.receiver is self._receiver:
            await self._renew_receiver(peer, f"peer {peer_id} dropped with {peer.reading} read(s) in flight")
        else:
            self._retire_rma(peer)
            close_now(peer.endpoint)

    async def _renew_receiver(self, dropped: Peer, why: str) -> None:
        """Retire the receive worker (no more progress: nothing more lands in the blocks of the
        reads on it, which fail now) and hello every other peer from a fresh one."""
        old, moving = dropped.receiver, dict(self._peers)
        self._receiver = self._new_receiver()
        self.rt.retire_receive_worker(old.ctx, [dropped.endpoint] + [p.endpoint for p in moving.values()],
                                      keep_s=self.timeout_s + 1.0)
        for p in (dropped, *moving.values()):  # their gets stop too; _hello gives the moved ones fresh workers
            self._retire_rma(p)
        current = asyncio.current_task()
        cancelled = [t for t in old.reads if t is not current and not t.done()]
        for task in cancelled:
            task.cancel()
        logger.warning("ucx plane %d: new receive worker (%s); %d other read(s) failed, %d peer(s) moved",
                       self.plane_id, why, len(cancelled), len(moving))
        for peer_id, peer in moving.items():
            if self._peers.get(peer_id) is not peer:  # dropped meanwhile
                continue
            try:
                self._peers[peer_id] = await self._hello(peer.address, peer.token, peer.dealer, self._receiver)
            except Exception as e:  # this peer reconnects on its next handshake
                logger.warning("ucx plane %d: peer %s not moved to the new receive worker: %s", self.plane_id,
                               peer_id, e)
                del self._peers[peer_id]
                peer.dealer.close(linger=0)
