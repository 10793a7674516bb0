"""The ``ucx`` data plane: two-sided reads over UCX through the ``ucxx`` package.

UCX picks the transport (shared memory or CMA on one host, RDMA on InfiniBand/RoCE, TCP
otherwise). What makes it fast on these machines, measured: endpoints created from the
peer's worker address (exchanged in the kvxfer handshake) with UCX error handling off,
and the worker progressed in ``blocking`` mode from an event loop (one 512 MiB message:
12-17 GB/s, against 0.8-1.5 GB/s through a listener, where UCX turns error handling on
and falls back to tcp). With error handling off UCX does not report a dead peer, so
every read has its own deadline; a read that misses it aborts its endpoint, which
cancels the receives posted on it before the batch is reported failed.

A read is two-sided: the consumer posts receives, then sends a read request to the
producer's control socket (ZMQ; hellos travel there too); the producer checks it
(registered regions, held blocks, token) and sends a reply header and the data over UCX.
The control messages stay off UCX on purpose: a tag receive posted while idle keeps
ucxx's blocking progress from re-arming its worker, and it spins a whole core (measured:
an idle plane at 100% CPU that way, 0.2% now). Per-message cost dominates small pieces (16-24 us
of Python per ucxx message), so a batch whose pieces average below ``staging_threshold``
is gathered on the producer into staging buffers with one vectorised copy per region,
sent in chunks of ``chunk_bytes``, and scattered on receipt the same way (double-buffering
the chunks with a copy thread measured slower here: 1.6-2.0 against 3.0 GB/s for 512 MiB as
16384 x 32 KiB, the copy thread and UCX progress contending for the GIL); a batch of large
pieces is sent piece by piece straight from and into the registered tensors.

The UCX worker, its progress and every coroutine run on one thread and event loop owned
by this module, shared by the planes of a process; the engine's thread never blocks on UCX.

Options (``connector.data_plane``): ``progress_mode`` (blocking, polling, thread),
``tls`` (UCX_TLS pass-through), ``staging_threshold`` (bytes, default 262144),
``chunk_bytes`` (default 64 MiB), ``inflight`` (messages in flight per direct batch,
default 16: 512 MiB as 64 x 8 MiB measured 0.82x raw one-message with 1 in flight, 0.88x
with 4, 1.03x with 16, 0.66x with 64), ``timeout_s`` (per batch), ``host`` (where the control
socket listens; default the side channel's host).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import struct
import threading
from collections.abc import AsyncIterator, Coroutine, Mapping
from concurrent.futures import Future
from typing import Any

import msgspec
import numpy as np
import zmq

from kvxfer.config import DataPlaneValue
from kvxfer.dataplane import (
    BatchResult,
    Descriptors,
    HostRegionPlane,
    check_bounds,
    check_read,
)
from kvxfer.protocol import ReadReply, ReadRequest, decode_data, encode

logger = logging.getLogger(__name__)

# UCX_TLS unless the user sets it (option ``tls`` or the environment). CMA is out because,
# with error handling off, a producer that dies mid-read makes the reader's
# process_vm_readv fail and UCX abort the reading process (seen in the kill test); the
# CUDA transports are out because host-only caches gain nothing from them and, on a host
# with no GPU, probing them cut one 512 MiB message from 12 to 3.6 GB/s. Everything else,
# RDMA included, stays. Measured here: 12.0 GB/s for one 512 MiB message with this set.
DEFAULT_TLS = "^cma,cuda_ipc,cuda_copy,gdr_copy"
OPTIONS = {"progress_mode", "tls", "staging_threshold", "chunk_bytes", "inflight", "timeout_s", "host"}
MAX_CONTROL_BYTES = 32 << 20  # a read request of MAX_READ_PIECES pieces is 24 MiB
HEADER_BYTES = 4096
KIND_HEADER, KIND_DATA = 2, 3
_LEN = struct.Struct("<I")


def _tag(plane: int, kind: int, seq: int) -> int:
    return (plane & 0xFFFF) << 48 | (kind & 0xFF) << 40 | (seq & 0xFF_FFFF_FFFF)


class UcxAddress(msgspec.Struct, frozen=True):
    worker: bytes
    plane: int
    control: str  # the producer's ZMQ endpoint for hellos and read requests


class _Hello(msgspec.Struct, frozen=True):
    """Carried inside a DataHello's engine id field is not enough: the reply path needs this."""

    worker: bytes
    plane: int
    engine_id: str
    token: bytes


IDLE_TICK_S = 0.005


def _own_progress(loop: asyncio.AbstractEventLoop) -> bool:
    """Keep ucxx from starting its own progress task on ``loop`` (it would on the first
    endpoint): kvxfer progresses the worker itself. False where this ucxx has no such hook."""
    try:
        from ucxx._lib_async import application_context
        from ucxx._lib_async.continuous_ucx_progress import ProgressTask

        tasks = application_context.ProgressTasks
    except (ImportError, AttributeError):
        logger.warning("ucx: this ucxx has no ProgressTasks; using its blocking progress (an idle worker with "
                       "shared-memory endpoints may spin a core)")
        return False
    tasks[loop] = ProgressTask(None, loop)
    return True


class _Runtime:
    """The process's UCX worker, progressed on one event loop in one thread."""

    _instance: _Runtime | None = None
    _lock = threading.Lock()

    def __init__(self, progress_mode: str, tls: str | None) -> None:
        if tls:
            os.environ.setdefault("UCX_TLS", tls)
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        import ucxx  # the optional extra: imported only when a ucx plane is made

        self.ucxx = ucxx
        self.progress_mode = progress_mode
        self.transfers = 0  # in flight; set before the loop thread's idle tick reads it
        self._spinner: asyncio.Future[None] | None = None
        self.loop = asyncio.new_event_loop()
        ready: Future[None] = Future()
        self.thread = threading.Thread(target=self._run, args=(ready,), name="kvxfer-ucx", daemon=True)
        self.thread.start()
        ready.result(timeout=30)
        self.plane_ids = itertools.count(1)

    def _run(self, ready: Future[None]) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.ucxx.init(progress_mode=self.progress_mode)
            if self.progress_mode == "blocking" and _own_progress(self.loop):
                self.loop.create_task(self._tick())
            else:
                self.ucxx.continuous_ucx_progress(event_loop=self.loop)
            self.address = bytes(self.ucxx.get_worker_address())
        except Exception as e:
            ready.set_exception(e)
            return
        ready.set_result(None)
        self.loop.run_forever()

    @classmethod
    def get(cls, progress_mode: str, tls: str | None) -> _Runtime:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls(progress_mode, tls)
            elif cls._instance.progress_mode != progress_mode:
                raise ValueError(f"connector.data_plane.progress_mode: this process already runs UCX in "
                                 f"{cls._instance.progress_mode!r} mode, got {progress_mode!r}")
            return cls._instance

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    @contextlib.asynccontextmanager
    async def active(self) -> AsyncIterator[None]:
        """Progress the worker continuously while a transfer is in flight (loop thread only).

        Blocking progress waits for worker events between calls; large shared-memory
        rendezvous transfers then crawl (512 MiB: 3.3 GB/s against 9.6 with continuous
        progress). Idle, the worker is progressed every IDLE_TICK_S (see _tick).
        """
        self.transfers += 1
        if self.transfers == 1:
            self._spinner = asyncio.ensure_future(self._spin())
        try:
            yield
        finally:
            self.transfers -= 1

    async def _tick(self) -> None:
        """Idle progress: every IDLE_TICK_S, for what arrives outside a transfer (endpoint
        wire-up). ucxx's own blocking mode re-arms the worker's event fd, but once a
        shared-memory endpoint exists the arm keeps failing and its loop spins a core for as
        long as the process lives (measured: 100% of a core on both sides after one load)."""
        while True:
            if self.transfers == 0:
                self.ucxx.progress()
            await asyncio.sleep(IDLE_TICK_S)

    async def _spin(self) -> None:
        while self.transfers > 0:
            self.ucxx.progress()
            await asyncio.sleep(0)


def gather_pieces(arrays: Mapping[int, np.ndarray], regions: np.ndarray, offsets: np.ndarray,
                  lengths: np.ndarray, out: np.ndarray) -> None:
    """Pack pieces back to back into ``out``: one vectorised copy per region when every piece
    has one length and sits on a multiple of it (block pieces); else a copy per piece."""
    _move(arrays, regions, offsets, lengths, out, to_out=True)


def scatter_pieces(arrays: Mapping[int, np.ndarray], regions: np.ndarray, offsets: np.ndarray,
                   lengths: np.ndarray, src: np.ndarray) -> None:
    """The inverse of :func:`gather_pieces`."""
    _move(arrays, regions, offsets, lengths, src, to_out=False)


def _move(arrays: Mapping[int, np.ndarray], regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
          buf: np.ndarray, to_out: bool) -> None:
    n = len(lengths)
    if n == 0:
        return
    L = int(lengths[0])
    if (lengths == L).all() and (offsets % L == 0).all():
        rows_buf = buf[: n * L].reshape(n, L)
        for rid in np.unique(regions).tolist():
            sel = np.flatnonzero(regions == rid)
            arr = arrays[rid]
            rows = arr[: len(arr) // L * L].reshape(-1, L)
            if to_out:
                rows_buf[sel] = rows[offsets[sel] // L]
            else:
                rows[offsets[sel] // L] = rows_buf[sel]
        return
    pos = 0
    for rid, off, ln in zip(regions.tolist(), offsets.tolist(), lengths.tolist(), strict=True):
        if to_out:
            buf[pos : pos + ln] = arrays[rid][off : off + ln]
        else:
            arrays[rid][off : off + ln] = buf[pos : pos + ln]
        pos += ln


def _chunks(lengths: np.ndarray, chunk_bytes: int) -> list[tuple[int, int]]:
    """Split pieces into consecutive groups of at most ``chunk_bytes`` (a piece never splits)."""
    out, start, acc = [], 0, 0
    for i, ln in enumerate(lengths.tolist()):
        if acc and acc + ln > chunk_bytes:
            out.append((start, i))
            start, acc = i, 0
        acc += ln
    out.append((start, len(lengths)))
    return out


class UcxDataPlane(HostRegionPlane):
    """Reads over UCX tag messages; see the module docstring for the protocol."""

    name = "ucx"
    known_options = frozenset(OPTIONS)

    def __init__(self, options: Mapping[str, DataPlaneValue] | None = None) -> None:
        super().__init__(options)
        o = self.options
        self.progress_mode = str(o.get("progress_mode", "blocking"))
        if self.progress_mode not in ("blocking", "polling", "thread", "thread-polling"):
            raise ValueError(f"connector.data_plane.progress_mode: expected blocking, polling, thread or "
                             f"thread-polling, got {self.progress_mode!r}")
        self.staging_threshold = int(o.get("staging_threshold", 256 << 10))
        self.chunk_bytes = int(o.get("chunk_bytes", 64 << 20))
        self.inflight = int(o.get("inflight", 16))
        self.timeout_s = float(o.get("timeout_s", 30.0))
        for name, v in (("chunk_bytes", self.chunk_bytes), ("inflight", self.inflight),
                        ("timeout_s", self.timeout_s)):
            if v <= 0:
                raise ValueError(f"connector.data_plane.{name}: expected > 0, got {v}")
        try:
            self.rt = _Runtime.get(self.progress_mode, str(o.get("tls", DEFAULT_TLS)))
        except ImportError as e:
            raise RuntimeError("connector.name 'ucx' needs the ucxx package: pip install 'kvxfer[ucx]'") from e
        self.ucxx = self.rt.ucxx
        self.plane_id = next(self.rt.plane_ids)
        self.engine_id = "kvxfer"
        self._peers: dict[str, Any] = {}  # peer id -> endpoint to it
        self._clients: dict[tuple[bytes, int], Any] = {}  # (worker, plane) -> endpoint back to a consumer
        self._ids = itertools.count(1)
        self._closed = False
        self._refused: set[tuple[str, str]] = set()
        self._serving: set[asyncio.Future[None]] = set()
        self._client_names: dict[tuple[bytes, int], str] = {}  # the engine id each consumer said hello as
        self._ctrl = zmq.Context.instance().socket(zmq.ROUTER)
        self._ctrl.setsockopt(zmq.LINGER, 0)
        self._ctrl.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        host = str(o.get("host", "127.0.0.1"))
        self._ctrl_addr = f"tcp://{host}:{self._ctrl.bind_to_random_port(f'tcp://{host}')}"
        self._dealers: dict[str, Any] = {}  # peer id -> DEALER to its control socket (loop thread only)
        self._ctrl_thread = threading.Thread(target=self._control_thread, name="kvxfer-ucx-control", daemon=True)
        self._ctrl_thread.start()

    # ------------------------------------------------------------------ registration
    def address(self) -> bytes:
        return msgspec.msgpack.encode(UcxAddress(worker=self.rt.address, plane=self.plane_id, control=self._ctrl_addr))

    # ------------------------------------------------------------------ consumer
    def connect(self, peer_id: str, address: bytes, token: bytes = b"") -> None:
        try:
            addr = msgspec.msgpack.decode(address, type=UcxAddress)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ConnectionError(f"peer {peer_id}: bad ucx address: {e}") from None
        if peer_id in self._peers:
            return
        self.rt.submit(self._connect(peer_id, addr, token)).result(timeout=self.timeout_s)

    async def _connect(self, peer_id: str, addr: UcxAddress, token: bytes) -> None:
        ucxx = self.ucxx
        ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(addr.worker),
                                                           endpoint_error_handling=False)
        hello = msgspec.msgpack.encode(_Hello(worker=self.rt.address, plane=self.plane_id,
                                              engine_id=self.engine_id, token=token))
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(addr.control)
        dealer.send(b"H" + hello)
        self._peers[peer_id] = ep
        self._dealers[peer_id] = dealer

    def disconnect(self, peer_id: str) -> None:
        if peer_id in self._peers:
            self.rt.submit(self._drop(peer_id)).result(timeout=10)

    async def _drop(self, peer_id: str) -> None:
        """Abort the endpoint (cancelling receives posted on it) and close the control socket."""
        ep = self._peers.pop(peer_id, None)
        dealer = self._dealers.pop(peer_id, None)
        if ep is not None:
            ep.abort()
        if dealer is not None:
            dealer.close(linger=0)

    def read(self, peer_id: str, request_id: str, descriptors: Descriptors) -> int:
        batch_id = next(self._ids)
        d = descriptors
        why = None if peer_id in self._peers else f"peer {peer_id} is not connected"
        if why is None:
            why = check_bounds(self._table, d.local_region, d.local_offset, d.length)
        if why is not None or len(d) == 0:
            self._finish(BatchResult(batch_id, peer_id, request_id, 0, why))
            return batch_id
        self.rt.submit(self._read(peer_id, request_id, batch_id, d))
        return batch_id

    async def _read(self, peer_id: str, request_id: str, batch_id: int, d: Descriptors) -> None:
        ep = self._peers.get(peer_id)
        staged = d.nbytes / len(d) < self.staging_threshold
        tag = self.ucxx.types.Tag
        try:
            header = np.empty(HEADER_BYTES, dtype=np.uint8)
            hdr = asyncio.ensure_future(ep.recv(header, tag=tag(_tag(self.plane_id, KIND_HEADER, batch_id)),
                                                force_tag=True))
            data_tag = tag(_tag(self.plane_id, KIND_DATA, batch_id))
            req = ReadRequest(request_id=request_id, batch_id=batch_id, regions=d.remote_region.tobytes(),
                              offsets=d.remote_offset.tobytes(), lengths=d.length.tobytes(),
                              token=msgspec.msgpack.encode([self.rt.address, self.plane_id,
                                                            self.chunk_bytes if staged else 0]))
            self._dealers[peer_id].send(b"R" + encode(req))
            async with self.rt.active():
                await asyncio.wait_for(self._receive(ep, hdr, header, data_tag, d, staged), self.timeout_s)
            self._finish(BatchResult(batch_id, peer_id, request_id, d.nbytes, None))
        except TimeoutError:
            # cancel what is still posted before anyone may reuse the destination blocks
            await self._drop(peer_id)
            self._finish(BatchResult(batch_id, peer_id, request_id, 0,
                                     f"peer {peer_id}: no complete reply within {self.timeout_s:g}s"))
        except Exception as e:
            self._finish(BatchResult(batch_id, peer_id, request_id, 0, f"peer {peer_id}: {type(e).__name__}: {e}"))

    async def _receive(self, ep: Any, hdr: Any, header: np.ndarray, data_tag: Any, d: Descriptors,
                       staged: bool) -> None:
        await hdr
        (n,) = _LEN.unpack(header[:4].tobytes())
        reply = decode_data(header[4 : 4 + n].tobytes())
        if not isinstance(reply, ReadReply):
            raise ConnectionError(f"unexpected reply {type(reply).__name__}")
        if reply.error:
            raise ValueError(f"read refused: {reply.error}")
        if staged:
            buf = np.empty(min(self.chunk_bytes, max(d.nbytes, 1)) + max(int(d.length.max()), 0), dtype=np.uint8)
            for a, b in _chunks(d.length, self.chunk_bytes):
                size = int(d.length[a:b].sum())
                await ep.recv(buf[:size], tag=data_tag, force_tag=True)
                scatter_pieces(self._arrays, d.local_region[a:b], d.local_offset[a:b], d.length[a:b], buf)
        else:
            arrays = self._arrays
            views = [arrays[r][o : o + k] for r, o, k in zip(d.local_region.tolist(), d.local_offset.tolist(),
                                                              d.length.tolist(), strict=True)]
            for i in range(0, len(views), self.inflight):
                await asyncio.gather(*(ep.recv(v, tag=data_tag, force_tag=True) for v in views[i : i + self.inflight]))

    # ------------------------------------------------------------------ producer
    def _control_thread(self) -> None:
        """Hellos and read requests arrive on a ZMQ socket, not a posted UCX receive: with a
        receive always posted, ucxx's blocking progress never re-arms and spins a core."""
        poller = zmq.Poller()
        poller.register(self._ctrl, zmq.POLLIN)
        while not self._closed:
            try:
                if not poller.poll(100):
                    continue
                parts = self._ctrl.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._closed:
                    break
                continue
            if len(parts) != 2 or not parts[1]:
                continue
            kind, payload = parts[1][:1], parts[1][1:]
            try:
                if kind == b"H":
                    # done before the next message: a read must find the endpoint back in place
                    self.rt.submit(self._on_hello(msgspec.msgpack.decode(payload, type=_Hello))).result(
                        timeout=self.timeout_s)
                elif kind == b"R":
                    msg = decode_data(payload)
                    if isinstance(msg, ReadRequest):
                        self.rt.submit(self._serve(msg))
            except Exception as e:
                self._refuse_once("?", f"control message refused: {e}")
        self._ctrl.close(linger=0)

    def _refuse_once(self, peer: str, why: str) -> None:
        key = (peer, why.split(":")[0])
        if key not in self._refused:
            self._refused.add(key)
            logger.warning("ucx data plane refused peer %s: %s", peer, why)

    async def _on_hello(self, hello: _Hello) -> None:
        if self._token_checker is not None and not self._token_checker(hello.token):
            self._refuse_once(hello.engine_id, "connection without a valid handshake token: ignored")
            return
        key = (hello.worker, hello.plane)
        old = self._clients.pop(key, None)
        if old is not None:  # the consumer connected again: it dropped its end after a failure
            old.abort()
        ucxx = self.ucxx
        self._clients[key] = await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(hello.worker), endpoint_error_handling=False)
        self._client_names[key] = hello.engine_id

    async def _serve(self, req: ReadRequest) -> None:
        async with self.rt.active():
            await self._serve_read(req)

    async def _serve_read(self, req: ReadRequest) -> None:
        try:
            worker, plane, chunk = msgspec.msgpack.decode(req.token, type=tuple[bytes, int, int])
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._refuse_once("?", "read request without a reply address")
            return
        ep = self._clients.get((worker, plane))
        peer = self._client_names.get((worker, plane), f"unknown worker ({len(worker)}-byte address)")
        if ep is None:
            self._refuse_once(peer, "read request from a consumer that never said hello (or was refused)")
            return
        tag = self.ucxx.types.Tag
        why, d = check_read(self._table, self._validator, req.request_id, req.regions, req.offsets, req.lengths)
        regions, offsets, lengths = d.remote_region, d.remote_offset, d.length
        reply = ReadReply(batch_id=req.batch_id, nbytes=d.nbytes, error=why or "")
        if why:
            self._refuse_once(peer, f"read for {req.request_id}: {why}")
        payload = encode(reply)
        header = np.zeros(HEADER_BYTES, dtype=np.uint8)
        header[: 4 + len(payload)] = np.frombuffer(_LEN.pack(len(payload)) + payload, dtype=np.uint8)
        try:
            await ep.send(header, tag=tag(_tag(plane, KIND_HEADER, req.batch_id)), force_tag=True)
            if why:
                return
            data_tag = tag(_tag(plane, KIND_DATA, req.batch_id))
            if chunk:
                buf = np.empty(min(chunk, int(lengths.sum())) + int(lengths.max()), dtype=np.uint8)
                for a, b in _chunks(lengths, chunk):
                    size = int(lengths[a:b].sum())
                    gather_pieces(self._arrays, regions[a:b], offsets[a:b], lengths[a:b], buf)
                    await ep.send(buf[:size], tag=data_tag, force_tag=True)
            else:
                arrs = self._arrays
                views = [arrs[r][o : o + k] for r, o, k in zip(regions.tolist(), offsets.tolist(), lengths.tolist(),
                                                                strict=True)]
                for i in range(0, len(views), self.inflight):
                    await asyncio.gather(*(ep.send(v, tag=data_tag, force_tag=True)
                                           for v in views[i : i + self.inflight]))
        except Exception as e:
            self._refuse_once(peer, f"send for {req.request_id} failed: {e}")

    # ------------------------------------------------------------------ both
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ctrl_thread.join(timeout=5)

        async def shutdown() -> None:
            for peer_id in list(self._peers):
                await self._drop(peer_id)
            for ep in self._clients.values():
                ep.abort()
            self._clients.clear()

        try:
            self.rt.submit(shutdown()).result(timeout=10)
        except Exception as e:  # the loop may already be gone at interpreter exit
            logger.debug("ucx plane close: %s", e)
