"""The cma plane's read thread: reads the producer must grant, asked over ZMQ and copied when granted.

A read the producer's hold board does not allow one-sided (module docstring of the plane) is
queued for this thread, which owns the DEALER socket to each producer's control socket: it
sends the read's pieces, and copies with ``process_vm_readv`` once the producer's holds and
region table allowed them. A mixin of ``CmaDataPlane``.

Threads: everything here runs on the read thread ``kvxfer-cma-reads`` (``_waiting`` and the
DEALER sockets are its own); ``_wake`` is called by any thread.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from kvxfer.dataplane import BatchResult, Descriptors, ReadRefused
from kvxfer.protocol import ErrorCode, ReadReply, ReadRequest, decode_data, encode
from kvxfer.supervise import code_of, describe, report

from .memory import iovecs
from .peer import Peer

logger = logging.getLogger(__name__)

GRANT_POLL_MS = 50  # the read thread's longest wait for a grant before it checks the deadlines again
NO_JOB = object()


@dataclass
class Awaited:
    """A read whose grant request is sent and not yet answered (the read thread's)."""

    peer_id: str
    request_id: str
    d: Descriptors
    local: np.ndarray  # each piece's local region's address
    pos: np.ndarray  # index of each piece's remote region in the peer's tables
    deadline: float


class GrantedReads:
    """The read thread of ``CmaDataPlane`` (mixed into it; see the module docstring)."""

    # the plane's, declared for the methods here
    engine_id: str
    timeout_s: float
    _closed: bool
    _ctx: zmq.Context[zmq.Socket[bytes]]
    _jobs: queue.SimpleQueue[tuple[str, Any] | None]
    _peers: dict[str, Peer]
    _waiting: dict[int, Awaited]
    _wake_r: int
    _wake_w: int

    def _finish(self, result: BatchResult) -> None:
        raise NotImplementedError  # the plane's
    def _copy(self, pid: int, iov: np.ndarray, nbytes: int) -> None:
        raise NotImplementedError  # the plane's

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending (or the plane is closing)

    def _run(self) -> None:
        """The plane's reading thread: owns the DEALER sockets, so no socket crosses threads.

        Grants are pipelined: every queued read sends its grant request at once, and each copy
        runs when its grant comes, so many small reads cost one round trip, not one each.
        Supervised: a failed read fails its batch, a failed connect or disconnect drops the
        peer (its reads then fail as not connected); the thread goes on."""
        while True:
            job: Any
            try:  # block for work only while no grant is awaited
                job = self._jobs.get(timeout=None if not self._waiting else 0)
            except queue.Empty:
                job = NO_JOB
            while job is not NO_JOB:
                if self._take(job):  # the stop job
                    for batch_id in list(self._waiting):
                        self._fail_waiting(batch_id, ConnectionError("the plane is closed"))
                    for p in self._peers.values():
                        p.dealer.close(linger=0)
                    return
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    job = NO_JOB
            try:
                self._grants(GRANT_POLL_MS if self._waiting else 0)
            except Exception as e:  # a bug here must not end the thread: what was awaited fails
                report("cma reads", e, "grant replies")
                for batch_id in list(self._waiting):
                    self._fail_waiting(batch_id, e)

    def _take(self, job: Any) -> bool:
        """One queued job; True when it is the stop job."""
        if job is None:
            return True
        kind, arg = job
        if kind == "read":
            peer_id, request_id, batch_id, d, local = arg
            try:
                self._request_grant(peer_id, request_id, batch_id, d, local)
            except Exception as e:  # any failure fails the batch, named; the thread goes on
                if not isinstance(e, OSError | ReadRefused | ValueError):
                    report("cma reads", e, f"read for {request_id} from {peer_id}")
                self._finish(BatchResult.failed(batch_id, peer_id, request_id, code_of(e),
                                                f"peer {peer_id}: {describe(e)}"))
            return False
        peer_id = arg[0]
        try:
            self._drop(peer_id, ConnectionError("disconnected"))
            if kind == "connect":
                peer = arg[1]
                peer.dealer = self._ctx.socket(zmq.DEALER)
                peer.dealer.setsockopt(zmq.LINGER, 0)
                peer.dealer.connect(peer.addr.control)
                peer.dealer.send(b"H" + self.engine_id.encode()[:256])  # so refusals can name us
                self._peers[peer_id] = peer
        except Exception as e:
            report("cma reads", e, f"{kind} {peer_id}")
        finally:
            if kind == "disconnect":
                arg[1].set()  # dropped (or failed to): the caller waits no longer
        return False

    def _drop(self, peer_id: str, why: Exception) -> None:
        """Forget a peer; its awaited grants fail with ``why``."""
        old = self._peers.pop(peer_id, None)
        if old is None:
            return
        old.dealer.close(linger=0)
        for batch_id in [b for b, w in self._waiting.items() if w.peer_id == peer_id]:
            self._fail_waiting(batch_id, why)

    def _fail_waiting(self, batch_id: int, e: Exception) -> None:
        w = self._waiting.pop(batch_id)
        self._finish(BatchResult.failed(batch_id, w.peer_id, w.request_id, code_of(e), f"peer {w.peer_id}: "
                                        f"{describe(e)}"))

    def _request_grant(self, peer_id: str, request_id: str, batch_id: int, d: Descriptors,
                       local: np.ndarray) -> None:
        peer = self._peers.get(peer_id)
        if peer is None:
            raise ConnectionError("not connected")
        if self._closed:
            raise ConnectionError("the plane is closed")
        pos = np.minimum(np.searchsorted(peer.ids, d.remote_region), len(peer.ids) - 1)
        if not (peer.ids[pos] == d.remote_region).all() or (d.remote_offset + d.length > peer.sizes[pos]).any():
            raise ReadRefused(ErrorCode.OUT_OF_BOUNDS, "a piece lies outside the producer's regions")
        req = ReadRequest(request_id=request_id, batch_id=batch_id, regions=d.remote_region.tobytes(),
                          offsets=d.remote_offset.tobytes(), lengths=d.length.tobytes(), token=peer.token)
        peer.dealer.send(b"R" + encode(req))
        self._waiting[batch_id] = Awaited(peer_id, request_id, d, local, pos, time.monotonic() + self.timeout_s)

    def _grants(self, wait_ms: int) -> None:
        """Copy for every grant that came (waiting up to ``wait_ms`` for the first); fail what
        waited past its deadline (its producer is stalled: the peer is dropped)."""
        dealers = {id(p.dealer): (pid, p) for pid, p in self._peers.items()
                   if any(w.peer_id == pid for w in self._waiting.values())}
        if dealers:
            poller = zmq.Poller()
            for _, p in dealers.values():
                poller.register(p.dealer, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            for sock, _ in poller.poll(wait_ms):
                if sock == self._wake_r:
                    os.read(self._wake_r, 4096)  # new jobs: the caller's loop takes them
                    continue
                peer_id, peer = dealers[id(sock)]
                while peer_id in self._peers and peer.dealer.poll(0):
                    self._on_grant(peer_id, peer, decode_data(peer.dealer.recv()))
        now = time.monotonic()
        for batch_id, w in list(self._waiting.items()):
            if batch_id in self._waiting and now > w.deadline:
                self._drop(w.peer_id, TimeoutError(f"no grant within {self.timeout_s:g}s"))

    def _on_grant(self, peer_id: str, peer: Peer, reply: Any) -> None:
        if not isinstance(reply, ReadReply):
            return
        w = self._waiting.pop(reply.batch_id, None)
        if w is None or w.peer_id != peer_id:
            return  # the late grant of a batch that already failed
        try:
            if reply.error:
                raise ReadRefused(reply.code or ErrorCode.INTERNAL, reply.error)
            self._copy(peer.addr.pid, iovecs(w.d, w.local, peer.base[w.pos]), w.d.nbytes)
        except Exception as e:
            if not isinstance(e, OSError | ReadRefused | ValueError):
                report("cma reads", e, f"read for {w.request_id} from {peer_id}")
            self._finish(BatchResult.failed(reply.batch_id, peer_id, w.request_id, code_of(e),
                                            f"peer {peer_id}: {describe(e)}"))
        else:
            self._finish(BatchResult(reply.batch_id, peer_id, w.request_id, w.d.nbytes, None))
