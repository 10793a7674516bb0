"""The ``ucx`` data plane: reads over UCX through the ``ucxx`` package, one-sided by default.

UCX picks the transport (RDMA on InfiniBand/RoCE, TCP otherwise; on one host shared memory, CMA
being left out of the default ``UCX_TLS``, below). A producer on this host is read by kvxfer's
cma plane instead (``same_host: cma``, the default with one-sided reads: one copy, made by the
reader, where UCX's own same-host gets are two copies in two processes; same_host.py).
What makes it fast on these machines, measured: endpoints created from the peer's worker
address (exchanged in the kvxfer handshake) with UCX error handling off,
and the worker progressed in ``blocking`` mode from an event loop (one 512 MiB message:
12-17 GB/s, against 0.8-1.5 GB/s through a listener, where UCX turns error handling on
and falls back to tcp). With error handling off UCX does not report a dead peer, so
every read, and every reply a producer sends, has its own deadline; endpoints are closed
without waiting for the peer (close_now).

With ``reads: one-sided`` (the default) the consumer's hello to the producer's control socket
(ZMQ) is answered with the address of an RMA worker the producer made for that consumer plane
(serving.py); a read is a request to the control socket, which the producer's control thread
checks (registered regions, held blocks, token) and answers there (a grant: no hop to its UCX
loop, no UCX message from its Python; the consumer's loop drains the grants); the consumer then
gets the pieces itself (``ucp_get_nbx``, rma.py) from an endpoint to that RMA worker, and one
endpoint flush tells it they landed. UCX serves the gets by RDMA where the fabric has
it, and otherwise (one host, CMA out) emulates them on the producer's RMA worker, which a native
ucxx progress thread answers: no byte waits for the producer's Python (a busy prefill worker,
vLLM's) nor for a bounded shared-memory FIFO that both processes must refill. Measured here
(benchmarks/ucx_rma.py, 2 MiB as 64 pieces, p50 of three rounds): 0.48-0.66 ms against 1.0-1.2 ms
two-sided; 16 MiB 3.4-4.3 against 11-13 ms; with a Python thread spinning in the producer
0.51-0.75 against 2.6-5.6 ms. The grant
keeps every check on the producer; the producer maps each region (``ucp_mem_map``) at
registration and publishes the packed keys in its address.

Why a worker per peer on both sides: a process killed while writing into a worker's
shared-memory FIFO leaves a slot claimed and never filled, and every later message to that
worker waits behind it. Each producer's gets run on a consumer worker of their own (RmaReads,
retired after a failed read), and each consumer's get requests go to a producer RMA worker of
their own (tests/test_faults.py's consumer-killed-mid-read case: with one shared worker the
next consumer could not connect).

With ``reads: two-sided`` the consumer posts receives
and the producer sends a reply header and the data over UCX. A producer set so maps nothing and
hands out no keys, so every byte it serves is one it sent itself (docs/security.md); a one-sided
consumer refuses to connect to it, by name.
The control messages stay off UCX on purpose: a tag receive posted while idle keeps
ucxx's blocking progress from re-arming its worker, and it spins a whole core (measured:
an idle plane at 100% CPU that way, 0.2% now). Per-message cost dominates small pieces (16-24 us
of Python per ucxx message), so a batch whose pieces average below ``staging_threshold``
is gathered on the producer into a staging buffer (one vectorised copy for all its pieces,
see staging.py), sent in chunks of ``chunk_bytes``, and scattered on receipt the same way. Small
chunks pipeline without a thread: the consumer scatters chunk k while the producer gathers
chunk k+1, each on its own core (16 MiB as 512 x 32 KiB: 5-6.5 ms with 1-4 MiB chunks, 7.7-8.8
with one 64 MiB chunk; 512 MiB: 118-125 ms against 250). Double-buffering the chunks with a
copy thread measured slower here (1.6-2.0 against 3.0 GB/s for 512 MiB as 16384 x 32 KiB, the
copy thread and UCX progress contending for the GIL). Staging buffers are kept for the next
batch (StagingPool). A batch of large pieces is sent piece by piece straight from and into
the registered tensors. Staged batches to one producer started together (``read_many``: a burst
of small loads) go as one request and one reply, each load still its own batch (``_Part``).

The UCX worker, its progress and every coroutine run on one thread and event loop owned
by runtime.py, shared by the planes of a process; the engine's thread never blocks on UCX.
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
socket listens; default the side channel's host), ``reads`` (one-sided or two-sided),
``rma_progress`` (how a producer's RMA workers are progressed: ``native``, ucxx's thread, no
GIL, the default; ``adaptive``, a Python thread that polls for 1 ms after each event; ``auto``:
adaptive in a transfer agent, native in an engine's process; see rma_progress.py), ``same_host``
(``cma``, the default with one-sided reads: producers on this host read through a cma plane beside
this one, as UCX itself would with CMA allowed; ``ucx``: every producer over UCX, the default with
``reads: two-sided``, which refuses ``cma``; same_host.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq

from kvxfer.config import DataPlaneValue
from kvxfer.dataplane import (
    BatchResult,
    Descriptors,
    EngineReads,
    HostRegionPlane,
    MemoryRegion,
    ReadRefused,
    ReadValidator,
    TokenChecker,
    check_bounds,
)
from kvxfer.protocol import ErrorCode, ReadReply, ReadRequest, decode_data, encode
from kvxfer.supervise import code_of, describe, report
from kvxfer.threads import NamedThread

from .connecting import Connecting, Peer, Receiver, RmaReads
from .rma import MemoryKey, UcxRmaError, map_region
from .runtime import UcxRuntime
from .same_host import SameHostEngineReads, SameHostReads, cma_address_of, same_host_option
from .serving import Serving
from .staging import AddressSpace, StagingPool, chunk_ranges, chunk_sizes, scatter_pieces
from .wire import (
    GRANT_ONLY,
    HEADER_BYTES,
    KIND_DATA,
    KIND_HEADER,
    MAX_CONTROL_BYTES,
    REPLY_LENGTH,
    UcxAddress,
    message_tag,
)

logger = logging.getLogger(__name__)

# UCX_TLS unless the user sets it (option ``tls`` or the environment). CMA is out because,
# with error handling off, a producer that dies mid-read makes the reader's
# process_vm_readv fail and UCX abort the reading process (seen in the kill test); the
# CUDA transports are out because host-only caches gain nothing from them and, on a host
# with no GPU, probing them cut one 512 MiB message from 12 to 3.6 GB/s. Everything else,
# RDMA included, stays. Measured here: 12.0 GB/s for one 512 MiB message with this set.
DEFAULT_TLS = "^cma,cuda_ipc,cuda_copy,gdr_copy"
MAX_MERGED_PIECES = 1 << 14  # pieces of the staged reads that go to a producer as one request
OPTIONS = {"progress_mode", "tls", "staging_threshold", "chunk_bytes", "inflight", "timeout_s", "host", "reads",
           "rma_progress", "same_host"}


@dataclass(frozen=True)
class _Part:
    """One read (its batch) within a request to a producer; a burst's staged reads share one."""

    batch_id: int
    request_id: str
    d: Descriptors


class UcxDataPlane(Connecting, Serving, HostRegionPlane):
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
        reads = str(o.get("reads", "one-sided"))
        if reads not in ("one-sided", "two-sided"):
            raise ValueError(f"connector.data_plane.reads: expected one-sided or two-sided, got {reads!r}")
        self.one_sided = reads == "one-sided"
        rma_progress = str(o.get("rma_progress", "native"))  # adaptive lost the busy transfer bench
        if rma_progress not in ("auto", "native", "adaptive"):
            raise ValueError(f"connector.data_plane.rma_progress: expected auto, native or adaptive, "
                             f"got {rma_progress!r}")
        from kvxfer.agent.server import in_agent  # here: the agent's modules import the planes' registry

        # auto: adaptive in a transfer agent (its Python is kvxfer's), native in an engine's process
        self.rma_adaptive = rma_progress == "adaptive" or (rma_progress == "auto" and in_agent())
        same_host = same_host_option(o)
        for name, v in (("chunk_bytes", self.chunk_bytes), ("inflight", self.inflight),
                        ("timeout_s", self.timeout_s)):
            if v <= 0:
                raise ValueError(f"connector.data_plane.{name}: expected > 0, got {v}")
        try:
            self.rt = UcxRuntime.get(self.progress_mode, str(o.get("tls", DEFAULT_TLS)))
        except ImportError as e:
            raise RuntimeError("connector.name 'ucx' needs the ucxx package: pip install 'kvxfer[ucx]'") from e
        self.ucxx = self.rt.ucxx
        self.plane_id = next(self.rt.plane_ids)
        self.engine_id = "kvxfer"
        self._session = os.urandom(16)
        self._peers: dict[str, Peer] = {}  # (loop thread only)
        self._receiver: Receiver | None = None  # made on the first connect (loop thread only)
        self._clients: dict[tuple[bytes, int], Any] = {}  # (worker, plane) -> endpoint back to a consumer
        self._sessions: dict[bytes, tuple[bytes, int]] = {}  # consumer session -> its current (worker, plane)
        self._ids = itertools.count(1)
        self._closed = False
        self._refused: set[tuple[str, str]] = set()
        self._serving: set[asyncio.Future[None]] = set()
        self._client_names: dict[tuple[bytes, int], str] = {}  # the engine id each consumer said hello as
        self._send_staging, self._recv_staging = StagingPool(), StagingPool()  # (loop thread only)
        self._keys: dict[int, MemoryKey] = {}  # producer side: each region mapped for one-sided reads
        self._rma_workers: dict[bytes, Any] = {}  # producer side: consumer session -> its RMA worker (loop thread)
        self._space = AddressSpace({})
        self._space_of: object = None  # the region table _space was built from
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._ctrl = ctx.socket(zmq.ROUTER)
        self._ctrl.setsockopt(zmq.LINGER, 0)
        self._ctrl.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        host = str(o.get("host", "127.0.0.1"))
        self._ctrl_addr = f"tcp://{host}:{self._ctrl.bind_to_random_port(f'tcp://{host}')}"
        self._ctrl_thread = NamedThread(target=self._control_thread, name="kvxfer-ucx-control", daemon=True)
        self._ctrl_thread.start()
        # same_host: cma: the cma plane beside this one, for the producers on this host (same_host.py)
        self._same_host = SameHostReads(o, self._ids) if same_host == "cma" else None

    # ------------------------------------------------------------------ registration
    def _address_space(self) -> AddressSpace:
        """The registered regions as one view (rebuilt when they change: a new region table)."""
        if self._space_of is not self._table:
            self._space, self._space_of = AddressSpace(self._regions), self._table
        return self._space

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register, and map each region on the UCX context for one-sided reads (its packed key
        goes out in ``address``). A region UCX will not map is logged, and one-sided reads of it
        are refused by name (the consumer sets ``reads: two-sided``)."""
        super().register(regions)
        if self._same_host is not None:
            self._same_host.plane.register(regions)
        if not self.one_sided:  # a two-sided producer hands out no keys: it serves every byte itself
            return
        for r in regions:
            try:
                self._keys[r.region_id] = map_region(self.rt.context_handle, r.address, r.length)
            except (UcxRmaError, ValueError) as e:  # not in _keys: its one-sided reads are refused (serving.py)
                logger.warning("ucx plane %d: region %d not mapped for one-sided reads: %s", self.plane_id,
                               r.region_id, e)

    def unregister(self, region_ids: Sequence[int]) -> None:
        super().unregister(region_ids)
        if self._same_host is not None:
            self._same_host.plane.unregister(region_ids)
        for rid in region_ids:
            key = self._keys.pop(rid, None)
            if key is not None:
                key.close()

    def address(self) -> bytes:
        keys = {rid: (k.address, k.length, k.rkey) for rid, k in self._keys.items()}
        cma = self._same_host.plane.address() if self._same_host is not None else None
        return msgspec.msgpack.encode(UcxAddress(worker=self.rt.address, plane=self.plane_id, control=self._ctrl_addr,
                                                 one_sided=bool(keys), regions=keys, cma=cma))

    # ------------------------------------------------------------------ the cma plane beside (same_host: cma)
    def connect(self, peer_id: str, address: bytes, token: bytes = b"") -> None:
        """A producer this process can read with CMA goes to the cma plane beside this one
        (``same_host: cma``); any other is connected over UCX."""
        if self._same_host is not None and self._same_host.connect(peer_id, cma_address_of(peer_id, address), token):
            Connecting.disconnect(self, peer_id)  # read over UCX before (another address): no longer
            return
        super().connect(peer_id, address, token)

    def disconnect(self, peer_id: str) -> None:
        if self._same_host is None or not self._same_host.disconnect(peer_id):
            super().disconnect(peer_id)

    def set_read_validator(self, validator: ReadValidator) -> None:
        super().set_read_validator(validator)
        if self._same_host is not None:
            self._same_host.plane.set_read_validator(validator)

    def set_token_checker(self, checker: TokenChecker) -> None:
        super().set_token_checker(checker)
        if self._same_host is not None:
            self._same_host.plane.set_token_checker(checker)

    def set_completion_callback(self, callback: Callable[[], None]) -> None:
        super().set_completion_callback(callback)
        if self._same_host is not None:
            self._same_host.plane.set_completion_callback(callback)

    def hold_changed(self, request_id: str, block_ids: np.ndarray | None) -> None:
        if self._same_host is not None:  # its board: consumers on this host check holds there
            self._same_host.plane.hold_changed(request_id, block_ids)

    def poll(self) -> list[BatchResult]:
        out = super().poll()
        if self._same_host is not None:
            out += self._same_host.plane.poll()
        return out

    def counters(self) -> dict[str, float]:
        return self._same_host.counters() if self._same_host is not None else {}

    @classmethod
    def engine_reads(cls, options: Mapping[str, DataPlaneValue],
                     regions: Sequence[MemoryRegion]) -> EngineReads | None:
        """With ``same_host: cma``, the cma plane's: the engine's thread copies small loads from
        this host's producers itself, as on the cma plane; else none."""
        if same_host_option(options) != "cma":
            return None
        from kvxfer.connectors.cma import CmaDataPlane

        cma = CmaDataPlane.engine_reads({}, regions)
        return SameHostEngineReads(cma) if cma is not None else None

    # ------------------------------------------------------------------ consumer
    def read(self, peer_id: str, request_id: str, descriptors: Descriptors) -> int:
        return self.read_many(((peer_id, request_id, descriptors),))[0]

    def read_many(self, reads: Sequence[tuple[str, str, Descriptors]]) -> list[int]:
        """``read`` for each: through the cma plane for the producers it reads (``same_host: cma``),
        over UCX for the others."""
        if self._same_host is None or not self._same_host.peers:
            return self._read_many_ucx(reads)
        mine, others = self._same_host.split(reads)
        if not others:
            return self._same_host.plane.read_many(reads)
        ids = [0] * len(reads)
        # the UCX reads first: they are only queued, while the cma plane's copies run on this thread
        for positions, read in ((others, self._read_many_ucx), (mine, self._same_host.plane.read_many)):
            for i, batch_id in zip(positions, read([reads[i] for i in positions]), strict=True):
                ids[i] = batch_id
        return ids

    def _read_many_ucx(self, reads: Sequence[tuple[str, str, Descriptors]]) -> list[int]:
        """``read`` for each over UCX. The staged ones (small pieces) of one producer go as one request and
        one reply: a burst of small loads costs one control message, one reply header and one
        staged copy each way, not one of each per load (``ReadRequest.parts``). Each is still its
        own batch, reported alone; the producer checks each against its own hold, and if it
        refuses any, each is read again alone, so each gets its own answer."""
        batch_ids: list[int] = []
        staged: dict[str, list[_Part]] = {}
        for peer_id, request_id, d in reads:
            batch_id = next(self._ids)
            batch_ids.append(batch_id)
            if peer_id not in self._peers:
                self._finish(BatchResult.failed(batch_id, peer_id, request_id, ErrorCode.PEER_LOST,
                                                f"peer {peer_id} is not connected"))
                continue
            why = check_bounds(self._table, d.local_region, d.local_offset, d.length)
            if why is not None or len(d) == 0:
                self._finish(BatchResult(batch_id, peer_id, request_id, 0, why,
                                         ErrorCode.OUT_OF_BOUNDS if why else None))
                continue
            part = _Part(batch_id, request_id, d)
            if self.one_sided or self._staged(d):
                staged.setdefault(peer_id, []).append(part)
            else:
                self.rt.submit(self._read(peer_id, [part]))
        for peer_id, parts in staged.items():
            group: list[_Part] = []
            pieces = 0
            for part in parts:
                if group and pieces + len(part.d) > MAX_MERGED_PIECES:
                    self.rt.submit(self._read(peer_id, group))
                    group, pieces = [], 0
                group.append(part)
                pieces += len(part.d)
            self.rt.submit(self._read(peer_id, group))
        return batch_ids

    def _staged(self, d: Descriptors) -> bool:
        return d.nbytes / len(d) < self.staging_threshold

    def _fail(self, peer_id: str, parts: list[_Part], code: ErrorCode, why: str) -> None:
        for p in parts:
            self._finish(BatchResult.failed(p.batch_id, peer_id, p.request_id, code, why))

    async def _read(self, peer_id: str, parts: list[_Part]) -> None:
        """One request and reply for ``parts`` (one read, or a burst's staged reads of one producer)."""
        peer = self._peers.get(peer_id)
        if peer is None:  # dropped since read() looked
            self._fail(peer_id, parts, ErrorCode.PEER_LOST, f"peer {peer_id} is not connected")
            return
        ep, receiver = peer.endpoint, peer.receiver
        first = parts[0]
        d = first.d if len(parts) == 1 else Descriptors.concat([p.d for p in parts])
        staged = self._staged(d)
        if self.one_sided and peer.rma is None:  # retired with a failed read; never read two-sided instead
            self._fail(peer_id, parts, ErrorCode.PEER_LOST, f"peer {peer_id}: its one-sided reads were stopped")
            return
        chunk = GRANT_ONLY if self.one_sided else self.chunk_bytes if staged else 0
        tag = self.ucxx.types.Tag
        task = asyncio.current_task()
        assert task is not None
        receiver.reads.add(task)
        peer.reading += 1
        each_alone = False
        try:
            header: np.ndarray | None = None
            if self.one_sided:  # the grant comes back on the control socket (_drain)
                hdr = peer.grants[first.batch_id] = asyncio.get_running_loop().create_future()
            else:
                header = np.empty(HEADER_BYTES, dtype=np.uint8)
                hdr = asyncio.ensure_future(ep.recv(header, tag=tag(message_tag(self.plane_id, KIND_HEADER,
                                                                                first.batch_id)), force_tag=True))
            data_tag = tag(message_tag(self.plane_id, KIND_DATA, first.batch_id))
            req = ReadRequest(request_id=first.request_id, batch_id=first.batch_id, regions=d.remote_region.tobytes(),
                              offsets=d.remote_offset.tobytes(), lengths=d.length.tobytes(),
                              token=msgspec.msgpack.encode([receiver.address, self.plane_id, chunk]),
                              parts=[(p.request_id, len(p.d)) for p in parts] if len(parts) > 1 else [])
            peer.dealer.send(b"R" + encode(req))
            async with self.rt.active():
                await asyncio.wait_for(self._receive(peer, hdr, header, data_tag, d, staged), self.timeout_s)
            for p in parts:
                self._finish(BatchResult(p.batch_id, peer_id, p.request_id, p.d.nbytes, None))
        except (TimeoutError, asyncio.TimeoutError):  # two types on Python 3.10, one from 3.11
            # the receive worker stops before anyone may reuse the destination blocks
            if self._peers.get(peer_id) is peer:
                await self._drop(peer_id)
            self._fail(peer_id, parts, ErrorCode.TIMEOUT,
                       f"peer {peer_id}: no complete reply within {self.timeout_s:g}s")
        except asyncio.CancelledError:  # by _renew_receiver: another peer was dropped mid-read
            self._fail(peer_id, parts, ErrorCode.CANCELLED, f"peer {peer_id}: read cancelled: its receive worker was "
                       "retired when another peer was dropped mid-read")
        except ReadRefused as e:  # nothing was posted beyond the header: no byte can land later
            if len(parts) > 1:
                each_alone = True
            else:
                self._fail(peer_id, parts, e.code, f"peer {peer_id}: {e}")
        except Exception as e:
            # receives may still be posted into the destination: stop the receive worker first
            if not isinstance(e, OSError | ValueError):
                report("ucx read", e, f"read for {first.request_id} from {peer_id}")
            if self._peers.get(peer_id) is peer:
                await self._drop(peer_id)
            self._fail(peer_id, parts, code_of(e), f"peer {peer_id}: {describe(e)}")
        finally:
            receiver.reads.discard(task)
            peer.reading -= 1
            peer.grants.pop(first.batch_id, None)
        if each_alone:
            await asyncio.gather(*(self._read(peer_id, [p]) for p in parts))

    async def _receive(self, peer: Peer, hdr: Any, header: np.ndarray | None, data_tag: Any, d: Descriptors,
                       staged: bool) -> None:
        ep = peer.endpoint
        asked = time.monotonic()
        if header is None:  # one-sided: the grant, then the gets
            while not hdr.done():
                self._drain(peer)
                if not hdr.done():
                    await asyncio.sleep(0)
            reply = hdr.result()
        else:
            await hdr
            (n,) = REPLY_LENGTH.unpack(header[:4].tobytes())
            reply = decode_data(header[4 : 4 + n].tobytes())
        if not isinstance(reply, ReadReply):
            raise ConnectionError(f"unexpected reply {type(reply).__name__}")
        if reply.error:
            raise ReadRefused(reply.code or ErrorCode.INTERNAL, reply.error)
        if header is None:
            if peer.rma is None:  # retired meanwhile: never read two-sided instead
                raise ConnectionError("its one-sided reads were stopped")
            granted = time.monotonic()
            await self._get(peer.rma, d)
            if logger.isEnabledFor(logging.DEBUG):  # where a read's time went (monotonic: as the producer's here)
                logger.debug("ucx plane %d: read %d, %d pieces, %d bytes: asked at %.6f, granted +%.2f ms, landed "
                             "+%.2f ms", self.plane_id, reply.batch_id, len(d), d.nbytes, asked,
                             (granted - asked) * 1e3, (time.monotonic() - granted) * 1e3)
        elif staged:
            chunks = chunk_ranges(d.length, self.chunk_bytes)
            sizes = chunk_sizes(d.length, chunks)
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

    @staticmethod
    def _drain(peer: Peer) -> None:
        """Hand each grant that came back on the peer's control socket to the read waiting for
        it (loop thread; every one-sided read waiting on this peer drains for all)."""
        if peer.dealer.closed:
            raise ConnectionError("its control socket was closed (the peer was dropped)")
        while True:
            try:
                msg = peer.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] != b"G":  # an answer to a hello given up
                continue
            try:
                reply = decode_data(msg[1:])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise ConnectionError(f"bad grant: {e}") from None
            if not isinstance(reply, ReadReply):
                raise ConnectionError(f"unexpected grant {type(reply).__name__}")
            fut = peer.grants.pop(reply.batch_id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def _get(self, rma: RmaReads, d: Descriptors) -> None:
        """The granted pieces, got one-sided into this side's regions; returns once they landed
        (an endpoint flush, progressed by the loop's spinner while the caller is active)."""
        space = self._address_space()
        local = space.at(d.local_region, d.local_offset, d.length).astype(np.uint64) + np.uint64(
            space.flat.ctypes.data)
        remote, keys = rma.regions.at(d.remote_region, d.remote_offset, d.length)
        rma.getter.get_pieces(keys, local, remote, d.length.astype(np.uint64))
        await self._landed(rma.getter, rma.getter.flush())

    # ------------------------------------------------------------------ both
    def broken(self) -> str | None:
        if self._closed:
            return "the plane is closed"
        if self._same_host is not None and (why := self._same_host.plane.broken()) is not None:
            return f"the cma plane beside it: {why}"
        return self.rt.broken()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._same_host is not None:
            self._same_host.plane.close()
        self._ctrl_thread.join(timeout=5)

        async def shutdown() -> None:
            for peer_id in list(self._peers):
                await self._drop(peer_id)
            for key in list(self._clients):
                self._forget_client(key)
            for session in list(self._rma_workers):
                self._stop_rma(session)
            for mapped in self._keys.values():  # gets of them fail from now (RDMA ones too)
                mapped.close()
            self._keys.clear()
            if self._receiver is not None:
                self.rt.retire_receive_worker(self._receiver.ctx, [], keep_s=1.0)
                self._receiver = None

        try:
            self.rt.submit(shutdown()).result(timeout=10)
        except Exception as e:  # the loop may already be gone at interpreter exit
            logger.debug("ucx plane close: %s", e)
