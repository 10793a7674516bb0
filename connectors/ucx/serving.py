"""The ucx plane's producer side: hellos and read requests on the control socket, replies over UCX.

A mixin of :class:`kvxfer.connectors.ucx.UcxDataPlane` (its state is the plane's, declared below
for the methods here). Threads: the control thread receives, and grants one-sided reads itself;
everything else (hellos, two-sided replies) runs on the UCX runtime's loop thread (see runtime.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
import numpy as np

from kvxfer.dataplane import Descriptors, RegionTable, check_read_parts
from kvxfer.handshake import serve_socket
from kvxfer.protocol import ErrorCode, ReadReply, ReadRequest, Refusal, decode_data, encode
from kvxfer.supervise import describe, report

from .connecting import SLOW_CONNECT_S
from .rma import MemoryKey
from .runtime import UcxRuntime, close_now
from .staging import AddressSpace, StagingPool, chunk_ranges, chunk_sizes, gather_pieces
from .wire import GRANT_ONLY, HEADER_BYTES, KIND_DATA, KIND_HEADER, REPLY_LENGTH, Hello, HelloAck, message_tag

logger = logging.getLogger(__name__)

# RMA workers per producer plane, one per consumer plane reading one-sided; each is a native
# thread, asleep in epoll while idle
MAX_RMA_WORKERS = 64


class Serving:
    """The producer side of the ucx plane (mixed into it)."""

    # the plane's, declared for the methods here
    rt: UcxRuntime
    ucxx: Any
    plane_id: int
    timeout_s: float
    inflight: int
    _ctrl: Any
    _closed: bool
    _token_checker: Any
    _validator: Any
    _table: RegionTable
    _arrays: dict[int, np.ndarray]
    _keys: dict[int, MemoryKey]
    _clients: dict[tuple[bytes, int], Any]
    _sessions: dict[bytes, tuple[bytes, int]]
    _client_names: dict[tuple[bytes, int], str]
    _refused: set[tuple[str, str]]
    _send_staging: StagingPool
    rma_adaptive: bool
    _rma_workers: dict[bytes, Any]  # consumer session -> the RMA worker serving its gets, oldest first (loop thread)

    def _address_space(self) -> AddressSpace:
        raise NotImplementedError  # the plane's

    def _control_thread(self) -> None:
        """Hellos and read requests arrive on a ZMQ socket, not a posted UCX receive: with a
        receive always posted, ucxx's blocking progress never re-arms and spins a core."""
        serve_socket("ucx control", self._ctrl, self._on_control, lambda: self._closed)
        self._ctrl.close(linger=0)

    def _on_control(self, parts: list[bytes]) -> None:
        if len(parts) != 2 or not parts[1]:
            return
        kind, payload = parts[1][:1], parts[1][1:]
        try:
            if kind == b"H":
                # done before the next message: a read must find the endpoint back in place
                began = time.monotonic()
                ack = self.rt.submit(self._on_hello(msgspec.msgpack.decode(payload, type=Hello))).result(
                    timeout=self.timeout_s)
                took = time.monotonic() - began
                if took > SLOW_CONNECT_S:
                    logger.warning("ucx plane %d: a hello took %.2fs to answer", self.plane_id, took)
                if ack is not None:
                    self._ctrl.send_multipart([parts[0], b"A" + msgspec.msgpack.encode(ack)])
            elif kind == b"B":  # a consumer dropped this producer: the RMA worker made for it goes
                self.rt.loop.call_soon_threadsafe(self._on_bye, payload)
            elif kind == b"R":
                msg = decode_data(payload)
                if isinstance(msg, ReadRequest):
                    self._on_read(parts[0], msg)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            self._refuse_once("?", ErrorCode.BAD_MESSAGE, f"control message refused: {e}")

    def _refuse_once(self, peer: str, code: ErrorCode, why: str) -> None:
        key = (peer, code.value)
        if key not in self._refused:
            self._refused.add(key)
            logger.warning("ucx data plane refused peer %s: %s", peer, why)

    async def _on_hello(self, hello: Hello) -> HelloAck | None:
        """Where to reply to this consumer from now on; for a one-sided consumer, the answer names
        the RMA worker made for it (the one it had before, if any, stops)."""
        if self._token_checker is not None and not self._token_checker(hello.token):
            self._refuse_once(hello.engine_id, ErrorCode.AUTH, "connection without a valid handshake token: ignored")
            return HelloAck(hello.hello_id, code=ErrorCode.AUTH, error="no valid handshake token") if hello.rma \
                else None
        if hello.rma and not (self._keys and hello.session):
            why = "this producer serves no one-sided reads" if not self._keys else "a hello without a session"
            return HelloAck(hello.hello_id, code=ErrorCode.BAD_PARAMS, error=why)
        key = (hello.worker, hello.plane)
        old = self._clients.pop(key, None)
        if old is not None:  # the consumer connected again: it dropped its end after a failure
            close_now(old)
        previous = self._sessions.get(hello.session) if hello.session else None
        if previous is not None and previous != key:
            # the consumer retired its receive worker: nothing sent there will be taken (sends
            # under way to it end at their deadline, in _serve)
            self._forget_client(previous)
        ucxx = self.ucxx
        self._clients[key] = await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(hello.worker), endpoint_error_handling=False)
        self._client_names[key] = hello.engine_id
        if hello.session:
            self._sessions[hello.session] = key
        if not hello.rma:
            return None
        self._stop_rma(hello.session)  # the consumer retired its end of it
        while len(self._rma_workers) >= MAX_RMA_WORKERS:  # the oldest consumer's next read fails; it says hello again
            oldest = next(iter(self._rma_workers))
            logger.warning("ucx plane %d: %d consumers read one-sided; the oldest one's RMA worker is stopped",
                           self.plane_id, len(self._rma_workers))
            self._stop_rma(oldest)
        worker = self.rt.new_rma_worker(adaptive=self.rma_adaptive)
        self._rma_workers[hello.session] = worker
        return HelloAck(hello.hello_id, rma=bytes(worker.address.tobytes()))

    def _on_bye(self, session: bytes) -> None:  # loop thread
        """A consumer dropped this producer: its RMA worker stops and the endpoint to it closes now,
        while the consumer still runs (closed after it exited, the endpoint's flush fails and UCX
        logs an error for it)."""
        self._stop_rma(session)
        key = self._sessions.get(session)
        if key is not None:
            self._forget_client(key)

    def _stop_rma(self, session: bytes) -> None:  # loop thread
        worker = self._rma_workers.pop(session, None)
        if worker is not None:
            self.rt.stop_rma_worker(worker)

    def _forget_client(self, key: tuple[bytes, int]) -> str:
        ep = self._clients.pop(key, None)
        if ep is not None:
            close_now(ep)
        for session in [s for s, k in self._sessions.items() if k == key]:
            del self._sessions[session]
        return self._client_names.pop(key, f"unknown worker ({len(key[0])}-byte address)")

    def _on_read(self, identity: bytes, req: ReadRequest) -> None:
        """A one-sided read is granted (or refused) here, on the control thread, straight back on
        the control socket: no hop to the loop thread, no UCX message from this process's Python.
        A two-sided one is served on the loop thread (_serve)."""
        try:
            worker, plane, chunk = msgspec.msgpack.decode(req.token, type=tuple[bytes, int, int])
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._refuse_once("?", ErrorCode.BAD_MESSAGE, "read request without a reply address")
            return
        if chunk != GRANT_ONLY:
            self.rt.submit(self._serve(req, (worker, plane), chunk))
            return
        why, d = self._check_read(req, (worker, plane))
        if not why and any(int(r) not in self._keys for r in np.unique(d.remote_region).tolist()):
            why = Refusal(ErrorCode.BAD_PARAMS, "a one-sided read of a region this producer did not map for them")
        if why:
            reply = ReadReply(batch_id=req.batch_id, nbytes=0, error=why.message, code=why.code)
        else:
            reply = ReadReply(batch_id=req.batch_id, nbytes=d.nbytes)
        self._ctrl.send_multipart([identity, b"G" + encode(reply)])
        if logger.isEnabledFor(logging.DEBUG):  # monotonic: comparable with a consumer's log on this host
            logger.debug("ucx plane %d: read %d granted at %.6f (%s)", self.plane_id, req.batch_id, time.monotonic(),
                         why.code.value if why else "ok")

    def _check_read(self, req: ReadRequest, client: tuple[bytes, int]) -> tuple[Refusal | None, Descriptors]:
        """Whether ``client`` may read what ``req`` asks (said hello, regions, holds, token), and
        its pieces (control thread for one-sided reads, loop thread for two-sided)."""
        peer = self._client_names.get(client, f"unknown worker ({len(client[0])}-byte address)")
        if self._clients.get(client) is None:
            never = Refusal(ErrorCode.AUTH, "read request from a consumer that never said hello (or was refused)")
            self._refuse_once(peer, never.code, never.message)
            return never, Descriptors.from_rows([])
        try:
            why, d = check_read_parts(self._table, self._validator, req.request_id, req.regions, req.offsets,
                                      req.lengths, req.parts)
        except Exception as e:  # refused as internal: the consumer hears at once, not at its deadline
            report("ucx serve", e, f"read for {req.request_id} from {peer}")
            why, d = Refusal(ErrorCode.INTERNAL, f"serving the read failed: {describe(e)}"), Descriptors.from_rows([])
        if why:
            self._refuse_once(peer, why.code, f"read for {req.request_id}: {why.message}")
        return why, d

    async def _serve(self, req: ReadRequest, client: tuple[bytes, int], chunk: int) -> None:
        """One two-sided read, within the plane's deadline: a consumer that stops taking its reply
        (stopped, dead, or its receive worker retired) must not keep the sends, and the loop's
        continuous progress, going for ever. It is forgotten; its next connect says hello again."""
        async with self.rt.active():
            try:
                await asyncio.wait_for(self._serve_read(req, client, chunk), self.timeout_s)
            except (TimeoutError, asyncio.TimeoutError):  # two types on Python 3.10
                name = self._forget_client(client)
                logger.warning("ucx plane %d: reply for %s not taken by %s within %gs; its endpoint is closed",
                               self.plane_id, req.request_id, name, self.timeout_s)
            except Exception as e:  # supervised: this reply is given up; the next read is served
                report("ucx serve", e, f"read for {req.request_id}")

    async def _serve_read(self, req: ReadRequest, client: tuple[bytes, int], chunk: int) -> None:
        ep = self._clients.get(client)
        why, d = self._check_read(req, client)
        if ep is None:  # refused by _check_read; there is no endpoint to say so on
            return
        plane = client[1]
        peer = self._client_names.get(client, "?")
        tag = self.ucxx.types.Tag
        regions, offsets, lengths = d.remote_region, d.remote_offset, d.length
        if why:
            reply = ReadReply(batch_id=req.batch_id, nbytes=0, error=why.message, code=why.code)
        else:
            reply = ReadReply(batch_id=req.batch_id, nbytes=d.nbytes)
        payload = encode(reply)
        header = np.zeros(HEADER_BYTES, dtype=np.uint8)
        header[: 4 + len(payload)] = np.frombuffer(REPLY_LENGTH.pack(len(payload)) + payload, dtype=np.uint8)
        # the header goes while the first chunk is gathered (it was awaited before the gather began)
        header_sent = asyncio.ensure_future(ep.send(header, tag=tag(message_tag(plane, KIND_HEADER, req.batch_id)),
                                                    force_tag=True))
        try:
            if why:
                await header_sent
                return
            data_tag = tag(message_tag(plane, KIND_DATA, req.batch_id))
            if chunk:
                chunks = chunk_ranges(lengths, chunk)
                sizes = chunk_sizes(lengths, chunks)
                buf = self._send_staging.take(max(sizes))
                for (a, b), size in zip(chunks, sizes, strict=True):
                    gather_pieces(self._arrays, regions[a:b], offsets[a:b], lengths[a:b], buf,
                                  self._address_space())
                    await header_sent
                    await ep.send(buf[:size], tag=data_tag, force_tag=True)
                self._send_staging.give(buf)  # not on a failure: a send may still read from it
            else:
                await header_sent
                arrs = self._arrays
                views = [arrs[r][o : o + k] for r, o, k in zip(regions.tolist(), offsets.tolist(), lengths.tolist(),
                                                                strict=True)]
                for i in range(0, len(views), self.inflight):
                    await asyncio.gather(*(ep.send(v, tag=data_tag, force_tag=True)
                                           for v in views[i : i + self.inflight]))
        except Exception as e:
            if not header_sent.done():  # a gather failed first: the header's outcome is still collected
                await asyncio.gather(header_sent, return_exceptions=True)
            self._refuse_once(peer, ErrorCode.PEER_LOST, f"send for {req.request_id} failed: {e}")
