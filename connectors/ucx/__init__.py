"""The ``ucx`` data plane: two-sided reads over UCX through the ``ucxx`` package.

UCX picks the transport (shared memory or CMA on one host, RDMA on InfiniBand/RoCE, TCP
otherwise). What makes it fast on these machines, measured: endpoints created from the
peer's worker address (exchanged in the kvxfer handshake) with UCX error handling off,
and the worker progressed in ``blocking`` mode from an event loop (one 512 MiB message:
12-17 GB/s, against 0.8-1.5 GB/s through a listener, where UCX turns error handling on
and falls back to tcp). With error handling off UCX does not report a dead peer, so
every read, and every reply a producer sends, has its own deadline; endpoints are closed
without waiting for the peer (close_now).

A read is two-sided: the consumer posts receives, then sends a read request to the
producer's control socket (ZMQ; hellos travel there too); the producer checks it
(registered regions, held blocks, token) and sends a reply header and the data over UCX.
The control messages stay off UCX on purpose: a tag receive posted while idle keeps
ucxx's blocking progress from re-arming its worker, and it spins a whole core (measured:
an idle plane at 100% CPU that way, 0.2% now). Per-message cost dominates small pieces (16-24 us
of Python per ucxx message), so a batch whose pieces average below ``staging_threshold``
is gathered on the producer into a staging buffer (one vectorised copy for all its pieces,
see _move), sent in chunks of ``chunk_bytes``, and scattered on receipt the same way. Small
chunks pipeline without a thread: the consumer scatters chunk k while the producer gathers
chunk k+1, each on its own core (16 MiB as 512 x 32 KiB: 5-6.5 ms with 1-4 MiB chunks, 7.7-8.8
with one 64 MiB chunk; 512 MiB: 118-125 ms against 250). Double-buffering the chunks with a
copy thread measured slower here (1.6-2.0 against 3.0 GB/s for 512 MiB as 16384 x 32 KiB, the
copy thread and UCX progress contending for the GIL). Staging buffers are kept for the next
batch (_StagingPool). A batch of large pieces is sent piece by piece straight from and into
the registered tensors.

The UCX worker, its progress and every coroutine run on one thread and event loop owned
by this module, shared by the planes of a process; the engine's thread never blocks on UCX.
Replies arrive on a second worker per plane (its receive worker). When a read misses its
deadline, that worker is retired: never progressed again, so no byte of a late reply can
land in blocks given back after the failure, and its other reads fail at once. The plane's
producers are told (a new hello) to reply to a fresh worker. Retiring, not reusing, also
cures a wedge: a producer killed while writing into a worker's shared-memory FIFO can leave
a slot claimed and never filled, and every later sender then waits behind it (before the
renewal, the next load timed out in 9 of 12 kill tests).

Options (``connector.data_plane``): ``progress_mode`` (blocking, polling, thread),
``tls`` (UCX_TLS pass-through), ``staging_threshold`` (bytes, default 262144),
``chunk_bytes`` (default 1 MiB), ``inflight`` (messages in flight per direct batch,
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
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq

from kvxfer.config import DataPlaneValue
from kvxfer.dataplane import (
    BatchResult,
    Descriptors,
    HostRegionPlane,
    ReadRefused,
    check_bounds,
    check_read,
)
from kvxfer.handshake import serve_socket
from kvxfer.protocol import ErrorCode, ReadReply, ReadRequest, Refusal, decode_data, encode
from kvxfer.supervise import code_of, describe, report

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
    """A consumer's hello: where the producer sends replies (its receive worker and plane)."""

    worker: bytes
    plane: int
    engine_id: str
    token: bytes
    session: bytes = b""  # random per consumer plane: a hello from a new receive worker replaces the old


@dataclass
class _Receiver:
    """One plane's receive worker, where its producers send replies, and the reads waiting on it."""

    ctx: Any  # an ApplicationContext around the worker (_Runtime.new_receive_worker)
    address: bytes  # the worker's UCX address, sent to producers in hellos
    reads: set[asyncio.Task[Any]] = field(default_factory=set)


@dataclass
class _Peer:
    """A producer this plane reads from, as seen from one receive worker."""

    address: UcxAddress
    token: bytes
    dealer: Any  # ZMQ DEALER to its control socket (loop thread only)
    endpoint: Any  # on the receiver's worker
    receiver: _Receiver
    reading: int = 0  # reads in flight on this endpoint


def close_now(ep: Any) -> None:
    """Close a ucxx endpoint without waiting for its peer (loop thread).

    ucxx's ``Endpoint.abort()``, with error handling off, closes in flush mode and, with no
    progress thread, progresses the worker until the flush completes, whatever its time
    limit: to a stopped (SIGSTOP) peer that is forever, on the thread that runs every
    transfer (seen in the stall test). The low-level close submits the close and returns, and
    marks the endpoint closing, so ucxx's finalizer does not wait either.
    """
    raw, ep._ep, ep._ctx = ep._ep, None, None
    if raw is None:
        return
    try:
        raw.close()
        raw.remove_close_callback()
    except Exception as e:  # already closed by UCX
        logger.debug("ucx endpoint close: %s", e)


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
        self.own_progress = False  # whether kvxfer progresses the main worker (else ucxx's own task does)
        self.receive_workers: set[Any] = set()  # the planes' receive workers, progressed by _tick and _spin
        self._retired: list[Any] = []  # receive workers no longer progressed, kept until their reads unwound
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
            self.own_progress = self.progress_mode == "blocking" and _own_progress(self.loop)
            if not self.own_progress:
                self.ucxx.continuous_ucx_progress(event_loop=self.loop)
            self.loop.create_task(self._tick())
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

    def new_receive_worker(self) -> Any:
        """A UCX worker of its own, on the process's UCX context, for one plane's reads (loop thread).

        Why: a producer killed while writing into a worker's shared-memory FIFO can leave a
        slot claimed and never filled, and every later sender to that worker then waits
        behind it. A plane that loses a peer mid-read swaps its receive worker for a fresh
        one (UcxDataPlane._renew_receiver); the process's main worker, which sends,
        is not touched. It is an ApplicationContext without its own UCX context, notifier
        thread or progress task, because ucxx's endpoints insist on one; kvxfer progresses it.
        """
        from ucxx._lib import libucxx
        from ucxx._lib_async.application_context import ApplicationContext

        main = self.ucxx.core._get_ctx()
        ctx = ApplicationContext.__new__(ApplicationContext)
        ctx.notifier_thread_q = ctx.notifier_thread = None
        ctx.progress_mode = self.progress_mode
        ctx.enable_delayed_submission = False
        ctx.enable_python_future = False
        ctx.connect_timeout = main.connect_timeout
        ctx.context = main.context
        ctx.worker = libucxx.UCXWorker(main.context, enable_delayed_submission=False, enable_python_future=False)
        self.receive_workers.add(ctx.worker)
        return ctx

    def retire_receive_worker(self, ctx: Any, endpoints: list[Any], keep_s: float) -> None:
        """Stop progressing a receive worker for good and close its endpoints (loop thread).

        Why stop at once: with shared memory and tcp a reply's bytes land only while the
        receiving worker is progressed, so once this returns nothing a late or half-dead
        producer still sends can reach blocks given back afterwards (RDMA puts from the
        sender are the exception: docs/security.md). The worker is freed ``keep_s`` later, once
        the reads cancelled on it have unwound.
        """
        self.receive_workers.discard(ctx.worker)
        for ep in endpoints:
            close_now(ep)
        try:
            ctx.worker.cancel_inflight_requests(period=0, max_attempts=1)
        except Exception as e:
            logger.debug("ucx: cancelling requests on a retired receive worker: %s", e)
        self._retired.append(ctx)
        self.loop.call_later(keep_s, self._retired.remove, ctx)

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
                self._progress()
            await asyncio.sleep(IDLE_TICK_S)

    async def _spin(self) -> None:
        while self.transfers > 0:
            self._progress()
            await asyncio.sleep(0)

    def _progress(self) -> None:
        """Progress every worker; supervised: a worker whose progress raises is reported and
        progressed again on the next turn (the transfers on it fail at their deadlines)."""
        try:
            if self.own_progress:
                self.ucxx.progress()
        except Exception as e:
            report("ucx progress", e, "the main worker")
        for worker in tuple(self.receive_workers):
            try:
                worker.progress()
            except Exception as e:
                report("ucx progress", e, "a receive worker")

    def broken(self) -> str | None:
        """Why the runtime cannot go on: its event-loop thread stopped (or the loop closed)."""
        if not self.thread.is_alive() or self.loop.is_closed():
            return "the UCX event-loop thread stopped"
        return None


class AddressSpace:
    """The registered regions as one flat uint8 view from the lowest region's start to the
    highest one's end, so that pieces of every region move in one vectorised call.

    Only the regions' own bytes are ever touched through it: every piece is checked against
    its region first (:func:`_move`). Rebuilt by the plane when its regions change."""

    def __init__(self, regions: Mapping[int, Any]) -> None:
        import ctypes

        ids = sorted(regions)
        self.known = np.array(ids, dtype=np.int64)
        addr = np.array([regions[i].address for i in ids], dtype=np.int64)
        self.sizes = np.array([regions[i].length for i in ids], dtype=np.int64)
        lo = int(addr.min()) if ids else 0
        span = int((addr + self.sizes).max()) - lo if ids else 0
        self.start = addr - lo  # each region's first byte in ``flat``
        self.flat = (np.frombuffer(memoryview((ctypes.c_char * span).from_address(lo)), dtype=np.uint8) if span
                     else np.empty(0, dtype=np.uint8))

    def at(self, regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Where each piece starts in ``flat``; IndexError for a piece outside its region."""
        pos = np.searchsorted(self.known, regions).clip(0, max(len(self.known) - 1, 0))
        if not len(self.known) or (self.known[pos] != regions).any() or (offsets < 0).any() \
                or (offsets + lengths > self.sizes[pos]).any():
            raise IndexError("a piece is outside its registered region")
        return self.start[pos] + offsets


def gather_pieces(arrays: Mapping[int, np.ndarray], regions: np.ndarray, offsets: np.ndarray,
                  lengths: np.ndarray, out: np.ndarray, space: AddressSpace | None = None) -> None:
    """Pack pieces back to back into ``out`` (see :func:`_move` for how)."""
    _move(arrays, regions, offsets, lengths, out, True, space)


def scatter_pieces(arrays: Mapping[int, np.ndarray], regions: np.ndarray, offsets: np.ndarray,
                   lengths: np.ndarray, src: np.ndarray, space: AddressSpace | None = None) -> None:
    """The inverse of :func:`gather_pieces`."""
    _move(arrays, regions, offsets, lengths, src, False, space)


# The pieces are moved as rows of ``g`` bytes, g the gcd of their lengths and offsets, when
# that makes at most this many rows per piece on average; else one copy per piece.
MAX_ROWS_PER_PIECE = 16


def _move(arrays: Mapping[int, np.ndarray], regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
          buf: np.ndarray, to_out: bool, space: AddressSpace | None = None) -> None:
    """Copy pieces between their regions and ``buf`` (back to back), vectorised.

    Every piece is a run of rows of ``g`` bytes (g divides every length and offset, so every
    position in ``buf`` too: block pieces are one row each). With ``space`` whose rows of ``g``
    bytes also start every region (page-aligned regions, and most allocators' large ones),
    all the pieces move in one numpy call: ``take`` into the buffer's rows, or an indexed
    assignment from them. Else each region's rows move by one call; where the pieces come
    grouped by region (the planner's order) a region's rows in ``buf`` are one slice, so
    nothing is copied twice; interleaved regions go through an index. Measured for 512 pieces
    of 32 KiB in 64 regions (16 MiB): 1.2 ms a region at a time, against 2.4-3.0 ms for a
    fancy-indexed copy each way (it made a temporary of each region's rows) and 0.8 ms for
    one 16 MiB memcpy; for 64 pieces (2 MiB) 0.2 ms a region at a time, 0.4 ms before."""
    n = len(lengths)
    if n == 0:
        return
    nbytes = int(lengths.sum())
    if space is not None:
        at = space.at(regions, offsets, lengths)
        g = int(np.gcd.reduce(np.concatenate((lengths, at))))
        if g and nbytes // g <= MAX_ROWS_PER_PIECE * n:
            rows = space.flat[: len(space.flat) // g * g].reshape(-1, g)
            idx = _row_index(at, lengths, g, nbytes)
            rows_buf = buf[:nbytes].reshape(-1, g)
            if to_out:  # mode "clip": "raise" copies through a temporary (bounds checked in at())
                np.take(rows, idx, axis=0, out=rows_buf, mode="clip")
            else:
                rows[idx] = rows_buf
            return
    g = int(np.gcd.reduce(np.concatenate((lengths, offsets))))
    if g == 0 or nbytes // g > MAX_ROWS_PER_PIECE * n:
        _move_each(arrays, regions, offsets, lengths, buf, to_out)
        return
    rows_buf = buf[:nbytes].reshape(-1, g)
    src_rows = _row_index(offsets, lengths, g, nbytes)
    if nbytes // g != n:
        regions = np.repeat(regions, lengths // g)
    change = np.flatnonzero(regions[1:] != regions[:-1]) + 1
    bounds = [0, *change.tolist(), len(regions)]
    run_ids = regions[bounds[:-1]].tolist()
    tops = np.maximum.reduceat(src_rows, bounds[:-1]).tolist()
    if len(set(run_ids)) == len(run_ids):  # grouped: each region's rows are one slice of buf
        for rid, a, b, top in zip(run_ids, bounds[:-1], bounds[1:], tops, strict=True):
            rows = _rows(arrays[rid], g, top)
            if to_out:  # mode "clip": "raise" copies through a temporary (bounds checked above)
                np.take(rows, src_rows[a:b], axis=0, out=rows_buf[a:b], mode="clip")
            else:
                rows[src_rows[a:b]] = rows_buf[a:b]
        return
    for rid in np.unique(regions).tolist():
        sel = np.flatnonzero(regions == rid)
        idx = src_rows[sel]
        rows = _rows(arrays[rid], g, int(idx.max()))
        if to_out:
            rows_buf[sel] = np.take(rows, idx, axis=0, mode="clip")
        else:
            rows[idx] = rows_buf[sel]


def _row_index(starts: np.ndarray, lengths: np.ndarray, g: int, nbytes: int) -> np.ndarray:
    """The rows of ``g`` bytes the pieces cover, in order: piece i's run from row starts[i] // g."""
    if nbytes // g == len(lengths):  # one row per piece
        return starts // g
    counts = lengths // g
    first = np.cumsum(counts) - counts  # each piece's first row in the buffer
    return np.repeat(starts // g - first, counts) + np.arange(nbytes // g, dtype=np.int64)


def _rows(arr: np.ndarray, g: int, top: int) -> np.ndarray:
    """``arr`` as rows of ``g`` bytes; IndexError unless row ``top`` is one of them."""
    rows = arr[: len(arr) // g * g].reshape(-1, g)
    if top >= len(rows):
        raise IndexError(f"row {top} of {g} bytes is past the end of a {len(arr)}-byte region")
    return rows


def _move_each(arrays: Mapping[int, np.ndarray], regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
               buf: np.ndarray, to_out: bool) -> None:
    pos = 0
    for rid, off, ln in zip(regions.tolist(), offsets.tolist(), lengths.tolist(), strict=True):
        if to_out:
            buf[pos : pos + ln] = arrays[rid][off : off + ln]
        else:
            arrays[rid][off : off + ln] = buf[pos : pos + ln]
        pos += ln


def _chunks(lengths: np.ndarray, chunk_bytes: int) -> list[tuple[int, int]]:
    """Split pieces into consecutive groups of at most ``chunk_bytes`` (a piece never splits;
    one larger than ``chunk_bytes`` is a group of its own): one search per group, not per piece."""
    n = len(lengths)
    ends = np.cumsum(lengths)
    out, start = [], 0
    while start < n:
        base = int(ends[start - 1]) if start else 0
        stop = max(int(np.searchsorted(ends, base + chunk_bytes, side="right")), start + 1)
        out.append((start, stop))
        start = stop
    return out or [(0, 0)]


def _chunk_sizes(lengths: np.ndarray, chunks: list[tuple[int, int]]) -> list[int]:
    ends = np.concatenate(([0], np.cumsum(lengths)))
    return [int(ends[b] - ends[a]) for a, b in chunks]


class _StagingPool:
    """Staging buffers kept for the next staged batch (loop thread only).

    A fresh buffer per batch cost its page faults every time (a 16 MiB one: ~0.2 ms to touch
    on each side, and UCX copies into or out of cold pages). A buffer comes back only after
    its batch succeeded: after a failure a send may still read from it, or a receive still be
    posted into it. At most ``keep`` buffers are kept, each at most a chunk (``chunk_bytes``,
    or one larger piece); sizes are rounded up to a power of two so that requests of nearby
    sizes share them."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.free: list[np.ndarray] = []  # smallest first

    def take(self, size: int) -> np.ndarray:
        for i, buf in enumerate(self.free):
            if len(buf) >= size:
                return self.free.pop(i)
        size = max(size, 1)
        return np.empty(max(size, min(1 << (size - 1).bit_length(), size + (size >> 1))), dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        self.free.append(buf)
        self.free.sort(key=len)
        if len(self.free) > self.keep:
            del self.free[0]


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
        self.chunk_bytes = int(o.get("chunk_bytes", 1 << 20))
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
        self._session = os.urandom(16)
        self._peers: dict[str, _Peer] = {}  # (loop thread only)
        self._receiver: _Receiver | None = None  # made on the first connect (loop thread only)
        self._clients: dict[tuple[bytes, int], Any] = {}  # (worker, plane) -> endpoint back to a consumer
        self._sessions: dict[bytes, tuple[bytes, int]] = {}  # consumer session -> its current (worker, plane)
        self._ids = itertools.count(1)
        self._closed = False
        self._refused: set[tuple[str, str]] = set()
        self._serving: set[asyncio.Future[None]] = set()
        self._client_names: dict[tuple[bytes, int], str] = {}  # the engine id each consumer said hello as
        self._send_staging, self._recv_staging = _StagingPool(), _StagingPool()  # (loop thread only)
        self._space = AddressSpace({})
        self._space_of: object = None  # the region table _space was built from
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._ctrl = ctx.socket(zmq.ROUTER)
        self._ctrl.setsockopt(zmq.LINGER, 0)
        self._ctrl.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        host = str(o.get("host", "127.0.0.1"))
        self._ctrl_addr = f"tcp://{host}:{self._ctrl.bind_to_random_port(f'tcp://{host}')}"
        self._ctrl_thread = threading.Thread(target=self._control_thread, name="kvxfer-ucx-control", daemon=True)
        self._ctrl_thread.start()

    # ------------------------------------------------------------------ registration
    def _address_space(self) -> AddressSpace:
        """The registered regions as one view (rebuilt when they change: a new region table)."""
        if self._space_of is not self._table:
            self._space, self._space_of = AddressSpace(self._regions), self._table
        return self._space

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
        if self._receiver is None:
            self._receiver = self._new_receiver()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(addr.control)
        try:
            self._peers[peer_id] = await self._hello(addr, token, dealer, self._receiver)
        except BaseException:
            dealer.close(linger=0)
            raise

    def _new_receiver(self) -> _Receiver:
        ctx = self.rt.new_receive_worker()
        return _Receiver(ctx, bytes(ctx.worker_address))

    async def _hello(self, addr: UcxAddress, token: bytes, dealer: Any, receiver: _Receiver) -> _Peer:
        """An endpoint from the receive worker to the producer, and a hello that tells it where to reply."""
        ucxx = self.ucxx
        ep = await receiver.ctx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(addr.worker),
                                                                    endpoint_error_handling=False)
        dealer.send(b"H" + msgspec.msgpack.encode(_Hello(worker=receiver.address, plane=self.plane_id,
                                                         engine_id=self.engine_id, token=token,
                                                         session=self._session)))
        return _Peer(addr, token, dealer, ep, receiver)

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
        peer.dealer.close(linger=0)
        if peer.reading and peer.receiver is self._receiver:
            await self._renew_receiver(peer, f"peer {peer_id} dropped with {peer.reading} read(s) in flight")
        else:
            close_now(peer.endpoint)

    async def _renew_receiver(self, dropped: _Peer, why: str) -> None:
        """Retire the receive worker (no more progress: nothing more lands in the blocks of the
        reads on it, which fail now) and hello every other peer from a fresh one."""
        old, moving = dropped.receiver, dict(self._peers)
        self._receiver = self._new_receiver()
        self.rt.retire_receive_worker(old.ctx, [dropped.endpoint] + [p.endpoint for p in moving.values()],
                                      keep_s=self.timeout_s + 1.0)
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

    def read(self, peer_id: str, request_id: str, descriptors: Descriptors) -> int:
        batch_id = next(self._ids)
        d = descriptors
        if peer_id not in self._peers:
            self._finish(BatchResult.failed(batch_id, peer_id, request_id, ErrorCode.PEER_LOST,
                                            f"peer {peer_id} is not connected"))
            return batch_id
        why = check_bounds(self._table, d.local_region, d.local_offset, d.length)
        if why is not None or len(d) == 0:
            self._finish(BatchResult(batch_id, peer_id, request_id, 0, why, ErrorCode.OUT_OF_BOUNDS if why else None))
            return batch_id
        self.rt.submit(self._read(peer_id, request_id, batch_id, d))
        return batch_id

    async def _read(self, peer_id: str, request_id: str, batch_id: int, d: Descriptors) -> None:
        peer = self._peers.get(peer_id)
        if peer is None:  # dropped since read() looked
            self._finish(BatchResult.failed(batch_id, peer_id, request_id, ErrorCode.PEER_LOST,
                                            f"peer {peer_id} is not connected"))
            return
        ep, receiver = peer.endpoint, peer.receiver
        staged = d.nbytes / len(d) < self.staging_threshold
        tag = self.ucxx.types.Tag
        task = asyncio.current_task()
        assert task is not None
        receiver.reads.add(task)
        peer.reading += 1
        try:
            header = np.empty(HEADER_BYTES, dtype=np.uint8)
            hdr = asyncio.ensure_future(ep.recv(header, tag=tag(_tag(self.plane_id, KIND_HEADER, batch_id)),
                                                force_tag=True))
            data_tag = tag(_tag(self.plane_id, KIND_DATA, batch_id))
            req = ReadRequest(request_id=request_id, batch_id=batch_id, regions=d.remote_region.tobytes(),
                              offsets=d.remote_offset.tobytes(), lengths=d.length.tobytes(),
                              token=msgspec.msgpack.encode([receiver.address, self.plane_id,
                                                            self.chunk_bytes if staged else 0]))
            peer.dealer.send(b"R" + encode(req))
            async with self.rt.active():
                await asyncio.wait_for(self._receive(ep, hdr, header, data_tag, d, staged), self.timeout_s)
            self._finish(BatchResult(batch_id, peer_id, request_id, d.nbytes, None))
        except (TimeoutError, asyncio.TimeoutError):  # two types on Python 3.10, one from 3.11
            # the receive worker stops before anyone may reuse the destination blocks
            if self._peers.get(peer_id) is peer:
                await self._drop(peer_id)
            self._finish(BatchResult.failed(batch_id, peer_id, request_id, ErrorCode.TIMEOUT,
                                            f"peer {peer_id}: no complete reply within {self.timeout_s:g}s"))
        except asyncio.CancelledError:  # by _renew_receiver: another peer was dropped mid-read
            self._finish(BatchResult.failed(batch_id, peer_id, request_id, ErrorCode.CANCELLED,
                                            f"peer {peer_id}: read cancelled: its receive worker was retired "
                                            "when another peer was dropped mid-read"))
        except ReadRefused as e:  # nothing was posted beyond the header: no byte can land later
            self._finish(BatchResult.failed(batch_id, peer_id, request_id, e.code, f"peer {peer_id}: {e}"))
        except Exception as e:
            # receives may still be posted into the destination: stop the receive worker first
            if not isinstance(e, OSError | ValueError):
                report("ucx read", e, f"read for {request_id} from {peer_id}")
            if self._peers.get(peer_id) is peer:
                await self._drop(peer_id)
            self._finish(BatchResult.failed(batch_id, peer_id, request_id, code_of(e),
                                            f"peer {peer_id}: {describe(e)}"))
        finally:
            receiver.reads.discard(task)
            peer.reading -= 1

    async def _receive(self, ep: Any, hdr: Any, header: np.ndarray, data_tag: Any, d: Descriptors,
                       staged: bool) -> None:
        await hdr
        (n,) = _LEN.unpack(header[:4].tobytes())
        reply = decode_data(header[4 : 4 + n].tobytes())
        if not isinstance(reply, ReadReply):
            raise ConnectionError(f"unexpected reply {type(reply).__name__}")
        if reply.error:
            raise ReadRefused(reply.code or ErrorCode.INTERNAL, reply.error)
        if staged:
            chunks = _chunks(d.length, self.chunk_bytes)
            sizes = _chunk_sizes(d.length, chunks)
            buf = self._recv_staging.take(max(sizes))
            for (a, b), size in zip(chunks, sizes, strict=True):
                await ep.recv(buf[:size], tag=data_tag, force_tag=True)
                scatter_pieces(self._arrays, d.local_region[a:b], d.local_offset[a:b], d.length[a:b], buf,
                               self._address_space())
            self._recv_staging.give(buf)  # not on a failure: a receive may still be posted into it
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
        serve_socket("ucx control", self._ctrl, self._on_control, lambda: self._closed)
        self._ctrl.close(linger=0)

    def _on_control(self, parts: list[bytes]) -> None:
        if len(parts) != 2 or not parts[1]:
            return
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
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            self._refuse_once("?", ErrorCode.BAD_MESSAGE, f"control message refused: {e}")

    def _refuse_once(self, peer: str, code: ErrorCode, why: str) -> None:
        key = (peer, code.value)
        if key not in self._refused:
            self._refused.add(key)
            logger.warning("ucx data plane refused peer %s: %s", peer, why)

    async def _on_hello(self, hello: _Hello) -> None:
        if self._token_checker is not None and not self._token_checker(hello.token):
            self._refuse_once(hello.engine_id, ErrorCode.AUTH, "connection without a valid handshake token: ignored")
            return
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

    def _forget_client(self, key: tuple[bytes, int]) -> str:
        ep = self._clients.pop(key, None)
        if ep is not None:
            close_now(ep)
        for session in [s for s, k in self._sessions.items() if k == key]:
            del self._sessions[session]
        return self._client_names.pop(key, f"unknown worker ({len(key[0])}-byte address)")

    async def _serve(self, req: ReadRequest) -> None:
        """One read, within the plane's deadline: a consumer that stops taking its reply (stopped,
        dead, or its receive worker retired) must not keep the sends, and the loop's continuous
        progress, going for ever. It is forgotten; its next connect says hello again."""
        try:
            worker, plane, chunk = msgspec.msgpack.decode(req.token, type=tuple[bytes, int, int])
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._refuse_once("?", ErrorCode.BAD_MESSAGE, "read request without a reply address")
            return
        async with self.rt.active():
            try:
                await asyncio.wait_for(self._serve_read(req, (worker, plane), chunk), self.timeout_s)
            except (TimeoutError, asyncio.TimeoutError):  # two types on Python 3.10
                name = self._forget_client((worker, plane))
                logger.warning("ucx plane %d: reply for %s not taken by %s within %gs; its endpoint is closed",
                               self.plane_id, req.request_id, name, self.timeout_s)
            except Exception as e:  # supervised: this reply is given up; the next read is served
                report("ucx serve", e, f"read for {req.request_id}")

    async def _serve_read(self, req: ReadRequest, client: tuple[bytes, int], chunk: int) -> None:
        worker, plane = client
        ep = self._clients.get(client)
        peer = self._client_names.get(client, f"unknown worker ({len(worker)}-byte address)")
        if ep is None:
            self._refuse_once(peer, ErrorCode.AUTH, "read request from a consumer that never said hello (or was "
                              "refused)")
            return
        tag = self.ucxx.types.Tag
        try:
            why, d = check_read(self._table, self._validator, req.request_id, req.regions, req.offsets,
                                req.lengths)
        except Exception as e:  # refused as internal: the consumer hears at once, not at its deadline
            report("ucx serve", e, f"read for {req.request_id} from {peer}")
            why, d = Refusal(ErrorCode.INTERNAL, f"serving the read failed: {describe(e)}"), Descriptors.from_rows([])
        regions, offsets, lengths = d.remote_region, d.remote_offset, d.length
        if why:
            self._refuse_once(peer, why.code, f"read for {req.request_id}: {why.message}")
            reply = ReadReply(batch_id=req.batch_id, nbytes=0, error=why.message, code=why.code)
        else:
            reply = ReadReply(batch_id=req.batch_id, nbytes=d.nbytes)
        payload = encode(reply)
        header = np.zeros(HEADER_BYTES, dtype=np.uint8)
        header[: 4 + len(payload)] = np.frombuffer(_LEN.pack(len(payload)) + payload, dtype=np.uint8)
        try:
            await ep.send(header, tag=tag(_tag(plane, KIND_HEADER, req.batch_id)), force_tag=True)
            if why:
                return
            data_tag = tag(_tag(plane, KIND_DATA, req.batch_id))
            if chunk:
                chunks = _chunks(lengths, chunk)
                sizes = _chunk_sizes(lengths, chunks)
                buf = self._send_staging.take(max(sizes))
                for (a, b), size in zip(chunks, sizes, strict=True):
                    gather_pieces(self._arrays, regions[a:b], offsets[a:b], lengths[a:b], buf,
                                  self._address_space())
                    await ep.send(buf[:size], tag=data_tag, force_tag=True)
                self._send_staging.give(buf)  # not on a failure: a send may still read from it
            else:
                arrs = self._arrays
                views = [arrs[r][o : o + k] for r, o, k in zip(regions.tolist(), offsets.tolist(), lengths.tolist(),
                                                                strict=True)]
                for i in range(0, len(views), self.inflight):
                    await asyncio.gather(*(ep.send(v, tag=data_tag, force_tag=True)
                                           for v in views[i : i + self.inflight]))
        except Exception as e:
            self._refuse_once(peer, ErrorCode.PEER_LOST, f"send for {req.request_id} failed: {e}")

    # ------------------------------------------------------------------ both
    def broken(self) -> str | None:
        if self._closed:
            return "the plane is closed"
        return self.rt.broken()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ctrl_thread.join(timeout=5)

        async def shutdown() -> None:
            for peer_id in list(self._peers):
                await self._drop(peer_id)
            for key in list(self._clients):
                self._forget_client(key)
            if self._receiver is not None:
                self.rt.retire_receive_worker(self._receiver.ctx, [], keep_s=1.0)
                self._receiver = None

        try:
            self.rt.submit(shutdown()).result(timeout=10)
        except Exception as e:  # the loop may already be gone at interpreter exit
            logger.debug("ucx plane close: %s", e)
