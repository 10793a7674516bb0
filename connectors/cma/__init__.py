"""The ``cma`` data plane: one-sided reads between processes of one host (``process_vm_readv``).

The consumer copies straight from the producer's registered memory into its own blocks with
Linux cross-memory attach, the transport UCX calls CMA and NIXL's same-host reads use. The
producer's CPU does no copying: on a host where the producer's cores are busy (a vLLM worker
spins on its core between steps) this is what keeps a transfer at memory speed.

Reads are checked against the producer's holds, one-sided where it can: the producer
publishes each pull hold on a board in its memory (:mod:`kvxfer.transfer.hold_board`), and the
consumer reads the hold's row and block ids, checks that the read touches only those blocks,
copies, and reads the row again; the copy stands only if the row did not change (the hold was
not released meanwhile). No message, no producer thread: a 1-block read costs three small
``process_vm_readv`` calls more than the copy, on the consumer's own thread. A read the board
cannot allow (the request is not on it yet, a push hold, blocks outside the hold, a producer
with ``one_sided: false``) asks the producer instead: it sends the batch's pieces to the
producer's control socket (ZMQ) and copies only after the producer's holds and region table
allowed them (the grant renews the hold's lease, so it cannot lapse mid-copy). Like RDMA
one-sided reads, either check is honoured by the consumer, not enforced by the kernel: the
kernel lets a process read another only where it could ptrace it (same user, or
CAP_SYS_PTRACE; Yama's ``ptrace_scope`` may narrow that), and such a process could read that
memory anyway. ``connect`` refuses a producer on another host (boot id) or in another pid
namespace (its pid would name another process here), then probes one byte and says plainly when
the kernel refuses (ptrace denied): use ``tcp`` or ``ucx`` there.

A producer that dies makes the copy fail with ESRCH, one that stalls makes the grant miss its
deadline: either way the batch fails within ``timeout_s`` and nothing more is written.

A one-sided read from a producer whose memory is a shared-memory file (a transfer agent's cache
always is) copies with ``memcpy`` from the consumer's own read-only mapping of that file instead,
no page pinned, through the native span copy (``kvxfer/_spancopy.c``: a copy of 512 KiB or more
is cut into parts the reading thread and native helper threads copy at once); the board is still
read before and after (:mod:`.mapped`).

A ``process_vm_readv`` copy (memory not in a shared file) of more than ``inline_copy_bytes`` is
cut into parts that the reading thread and the plane's copy threads copy at once (:mod:`.copier`).
Either copy is done when the reading thread's call returns. The copies themselves are in :mod:`.memory` and
:mod:`.mapped`; reads that ask for a grant in :mod:`.granted_reads` (the plane's read thread),
the producer's grant thread in :mod:`.grants`; what the consumer knows of a producer in
:mod:`.peer`.

Options (``connector.data_plane``): ``timeout_s`` (per batch, default 30), ``host`` (where the
control socket listens; default the side channel's host), ``one_sided`` (default true: publish
holds on the board; false: every read of this producer asks for a grant), ``copy_threads``
(helpers beside the reading thread for ``process_vm_readv`` copies; default: the CPUs this
process may run on, less one, from 1 to 3; 0: the reading thread copies alone),
``inline_copy_bytes`` (default 2 MiB: a larger ``process_vm_readv`` copy is cut into parts of at
least this size, one per copying thread), ``map_memory`` (default true: map a producer's
shared-memory files and copy from them; false: always ``process_vm_readv``).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq

from kvxfer.cache.tensors import MemoryRegion
from kvxfer.config import DataPlaneValue
from kvxfer.dataplane import (
    BatchResult,
    Descriptors,
    EngineReads,
    HostRegionPlane,
    ReadRefused,
    check_bounds,
    check_read,
)
from kvxfer.protocol import ErrorCode, ReadRequest, Refusal
from kvxfer.supervise import code_of, describe, report
from kvxfer.threads import NamedThread
from kvxfer.transfer.hold_board import HoldBoard, check_one_sided, row_unchanged

from .copier import CopyHelpers, cut
from .engine_reads import CmaEngineReads
from .granted_reads import Awaited, GrantedReads
from .grants import GrantServer
from .mapped import RegionFile, copy_mapped, region_files
from .memory import copy_from, iovecs
from .peer import CmaAddress, Peer, Pieces, boot_id, open_peer, pid_namespace, pieces, unmap

logger = logging.getLogger(__name__)

OPTIONS = {"timeout_s", "host", "one_sided", "copy_threads", "inline_copy_bytes", "map_memory"}
DISCONNECT_WAIT_S = 5.0  # disconnect waits this long at most for the read thread to drop the peer

KEEP_GIL_BYTES = 4 << 20  # copies up to this size keep it too (see _copy)
MAX_DEFAULT_COPY_THREADS = 3  # default copy_threads: the CPUs this process may use, less one, at most this
INLINE_COPY_BYTES = 2 << 20  # default inline_copy_bytes: a larger copy is cut in parts of at least this size


@dataclass
class _Read:
    """A read this side may copy one-sided, once the producer's board allows it."""

    peer_id: str
    request_id: str
    batch_id: int
    d: Descriptors
    local: np.ndarray  # each piece's local region's address


@dataclass
class _Allowed:
    """A read the board allowed: its pieces' remote regions' addresses in the producer, and in
    this process's mappings when every region is mapped."""

    read: _Read
    peer: Peer
    remote: np.ndarray
    mapped: np.ndarray | None
    row: np.ndarray  # the board row that allowed it (rechecked after the copy)


def _copy_part(pid: int, local: np.ndarray, remote: np.ndarray, nbytes: int) -> None:
    copy_from(pid, local, remote, nbytes=nbytes)


class CmaDataPlane(HostRegionPlane, GrantedReads):
    """Grant over ZMQ, then a one-sided copy with process_vm_readv; see the module docstring."""

    name = "cma"
    known_options = frozenset(OPTIONS)

    def __init__(self, options: Mapping[str, DataPlaneValue] | None = None) -> None:
        super().__init__(options)
        self.timeout_s = float(self.options.get("timeout_s", 30.0))
        if self.timeout_s <= 0:
            raise ValueError(f"connector.data_plane.timeout_s: expected > 0, got {self.timeout_s}")
        one_sided = self.options.get("one_sided", True)
        if not isinstance(one_sided, bool):
            raise ValueError(f"connector.data_plane.one_sided: expected true or false, got {one_sided!r}")
        threads = self.options.get("copy_threads",
                                   max(1, min(MAX_DEFAULT_COPY_THREADS, len(os.sched_getaffinity(0)) - 1)))
        if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= 64:
            raise ValueError(f"connector.data_plane.copy_threads: expected an integer from 0 to 64, got {threads!r}")
        inline = self.options.get("inline_copy_bytes", INLINE_COPY_BYTES)
        if isinstance(inline, bool) or not isinstance(inline, int) or inline < 0:
            raise ValueError(f"connector.data_plane.inline_copy_bytes: expected an integer >= 0, got {inline!r}")
        map_memory = self.options.get("map_memory", True)
        if not isinstance(map_memory, bool):
            raise ValueError(f"connector.data_plane.map_memory: expected true or false, got {map_memory!r}")
        self.copy_threads: int = threads
        self.inline_copy_bytes: int = inline
        self.map_memory: bool = map_memory
        self.engine_id = "kvxfer"
        self._board = HoldBoard() if one_sided else None  # producer side: the holds consumers check themselves
        self._peers: dict[str, Peer] = {}
        # consumer side, one-sided reads: the peers they may read, and the lock a copy holds (so a
        # disconnect returns only when no copy from that peer runs); taken by the reading thread
        self._direct: dict[str, Peer] = {}
        self._direct_lock = threading.Lock()
        self._local = self._local_table()  # what read() looks this side's pieces up in (_local_table)
        self._files: dict[int, RegionFile] | None = None  # address()'s region_files, found again after (un)registering
        self.one_sided_reads = 0  # reads the board allowed
        self.mapped_reads = 0  # of those, reads copied from a mapping of the producer's file
        self.granted_reads = 0  # reads that asked the producer
        self._ids: Iterator[int] = itertools.count(1)
        self._closed = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._grant_server = GrantServer(str(self.options.get("host", "127.0.0.1")), self._check_grant)  # producer side
        self._jobs: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._waiting: dict[int, Awaited] = {}  # batch id -> its awaited grant (the read thread's)
        self._wake_r, self._wake_w = os.pipe()  # a queued job wakes the read thread from its grant wait
        os.set_blocking(self._wake_w, False)
        self._read_thread = NamedThread(target=self._run, name="kvxfer-cma-reads", daemon=True)
        self._read_thread.start()
        # copies larger than inline_copy_bytes are cut in parts these threads help with (copier.py)
        self._helpers = CopyHelpers(self.copy_threads, _copy_part) if self.copy_threads else None

    def share_batch_ids(self, ids: Iterator[int]) -> None:
        """Number batches from ``ids``: a plane that reads some of its peers through this one
        (the ucx plane's ``same_host: cma``) hands out both planes' results, so ids must not repeat."""
        self._ids = ids

    # ------------------------------------------------------------------ registration
    def address(self) -> bytes:
        regions = {rid: (r.address, r.length) for rid, r in self._regions.items()}
        strides = {rid: r.block_stride for rid, r in self._regions.items()}
        board = (0, 0) if self._board is None else (self._board.address, self._board.rows)
        if self._files is None:  # once per registration: /proc/self/maps of a vLLM worker is long
            self._files = region_files(regions) if self._board is not None else {}  # only one-sided reads map them
        files = self._files
        board_file = None
        if self._board is not None and self._board.fd >= 0:
            dev, ino = self._board.file_id
            board_file = RegionFile(fd=self._board.fd, dev=dev, ino=ino, offset=0)
        return msgspec.msgpack.encode(CmaAddress(pid=os.getpid(), boot_id=boot_id(),
                                                 control=self._grant_server.address, regions=regions,
                                                 strides=strides, board=board, files=files, board_file=board_file,
                                                 pid_ns=pid_namespace()))

    def hold_changed(self, request_id: str, block_ids: np.ndarray | None) -> None:
        if self._board is None:
            return
        try:
            if block_ids is None:
                self._board.withdraw(request_id)  # even once closed: a row published in a race with close goes
            elif not self._closed:
                self._board.publish(request_id, block_ids)
        except Exception as e:  # never raise into the hold registry: the read asks for a grant instead
            report("cma hold board", e, f"request {request_id}")

    # ------------------------------------------------------------------ consumer
    def connect(self, peer_id: str, address: bytes, token: bytes = b"") -> None:
        peer, one_sided = open_peer(peer_id, address, token, self.map_memory)
        with self._direct_lock:
            old = self._direct.pop(peer_id, None)
            if one_sided:
                self._direct[peer_id] = peer
            unmap(old)
        self._jobs.put(("connect", (peer_id, peer)))
        self._wake()

    def disconnect(self, peer_id: str) -> None:
        """Forget a peer; returns once no thread copies from it (a one-sided copy in progress
        finishes first; the read thread drops it), so a failed load's blocks are not written once
        reported."""
        with self._direct_lock:
            unmap(self._direct.pop(peer_id, None))
        dropped = threading.Event()
        self._jobs.put(("disconnect", (peer_id, dropped)))
        self._wake()
        if threading.current_thread() is not self._read_thread and self._read_thread.is_alive():
            dropped.wait(DISCONNECT_WAIT_S)

    def read(self, peer_id: str, request_id: str, descriptors: Descriptors) -> int:
        return self.read_many(((peer_id, request_id, descriptors),))[0]

    def read_many(self, reads: Sequence[tuple[str, str, Descriptors]]) -> list[int]:
        """Each read the producer's board allows is copied on this thread before this returns, all
        of them in one copy cut across the copy threads (a burst of small loads then copies as
        fast as one large one); each is still checked, rechecked and reported alone. The others
        ask the producer for a grant (the reading thread copies them when it comes)."""
        batch_ids: list[int] = []
        direct: list[_Read] = []
        ids, sizes, bases, patterns = self._local
        for peer_id, request_id, d in reads:
            batch_id = next(self._ids)
            batch_ids.append(batch_id)
            if len(d) == 0:
                self._finish(BatchResult(batch_id, peer_id, request_id, 0, None))
                continue
            local = pieces(patterns, ids, sizes, bases, None, d.local_region)
            if local is None or (d.local_offset + d.length > local.sizes).any():  # check_bounds names it
                why = (check_bounds(self._table, d.local_region, d.local_offset, d.length)
                       or "a piece lies outside this side's regions")
                self._finish(BatchResult(batch_id, peer_id, request_id, 0, why, ErrorCode.OUT_OF_BOUNDS))
                continue
            direct.append(_Read(peer_id, request_id, batch_id, d, local.bases))
        asked = self._read_one_sided(direct) if direct else []
        for r in asked:
            self.granted_reads += 1
            self._jobs.put(("read", (r.peer_id, r.request_id, r.batch_id, r.d, r.local)))
        if asked:
            self._wake()
        return batch_ids

    def _read_one_sided(self, reads: list[_Read]) -> list[_Read]:
        """Copy on this thread (helped, above ``inline_copy_bytes``, by the copy threads) the reads
        the producer's board allows (module docstring); returns the others (they ask for a grant).
        A copy that fails, or whose hold ended meanwhile, fails its batch."""
        asked: list[_Read] = []
        results: list[BatchResult] = []
        with self._direct_lock:
            allowed: list[_Allowed] = []
            for r in reads:
                d = r.d
                peer = self._direct.get(r.peer_id)
                if peer is None or self._closed:
                    asked.append(r)
                    continue
                remote = pieces(peer.patterns, peer.ids, peer.sizes, peer.base, peer.strides, d.remote_region,
                                 peer.mapped)
                if remote is None or remote.strides is None:
                    asked.append(r)  # the grant path refuses it, by name
                    continue
                end = d.remote_offset + d.length
                if (end > remote.sizes).any():
                    asked.append(r)
                    continue
                end -= 1
                row = check_one_sided(peer.board_read, peer.addr.board, r.request_id, d.remote_offset // remote.strides,
                                      end // remote.strides)
                if row is None:
                    asked.append(r)
                    continue
                self.one_sided_reads += 1
                allowed.append(_Allowed(r, peer, remote.bases, remote.mapped, row))
            if len(allowed) == 1:
                results.append(self._copy_here(allowed[0]))
            elif allowed:
                results.extend(self._copy_together(allowed))
        for res in results:
            self._finish(res)  # not under _direct_lock: a completion callback may call back into the plane
        return asked

    def _copy_here(self, a: _Allowed) -> BatchResult:
        """A one-sided read the board allowed, copied on this thread. Caller holds _direct_lock."""
        r = a.read
        try:
            if a.mapped is not None:  # any size: the native span copy cuts it across its helpers
                iov = iovecs(r.d, r.local, a.mapped)
                copy_mapped(iov[0], iov[1], keep_gil=r.d.nbytes <= KEEP_GIL_BYTES)
                self.mapped_reads += 1
            else:
                self._copy(a.peer.addr.pid, iovecs(r.d, r.local, a.remote), r.d.nbytes)
        except Exception as e:
            return self._read_failed(r.peer_id, r.request_id, r.batch_id, e)
        return self._rechecked(r, a.peer, a.row)

    def _copy_together(self, allowed: list[_Allowed]) -> list[BatchResult]:
        """Several allowed reads: one copy per producer process for all of them, then each read
        rechecked alone. If a joint copy fails, its reads are copied again one by one, so each
        fails (or not) for its own reason. Caller holds _direct_lock."""
        by_pid: dict[int, list[_Allowed]] = {}
        for a in allowed:
            by_pid.setdefault(a.peer.addr.pid, []).append(a)
        results: list[BatchResult] = []
        for pid, group in by_pid.items():
            nbytes = sum(a.read.d.nbytes for a in group)
            mapped = [a.mapped for a in group if a.mapped is not None]
            try:
                if len(mapped) == len(group):  # all from mappings: one native span copy
                    iov = np.concatenate([iovecs(a.read.d, a.read.local, m)
                                          for a, m in zip(group, mapped, strict=True)], axis=1)
                    copy_mapped(iov[0], iov[1], keep_gil=nbytes <= KEEP_GIL_BYTES)
                    self.mapped_reads += len(group)
                else:
                    iov = np.concatenate([iovecs(a.read.d, a.read.local, a.remote) for a in group], axis=1)
                    self._copy(pid, iov, nbytes)
            except TimeoutError as e:  # a helper may still be copying: no read of the group may stand
                results.extend(self._read_failed(a.read.peer_id, a.read.request_id, a.read.batch_id, e)
                               for a in group)
                continue
            except Exception as e:
                logger.debug("cma: a joint copy of %d reads from pid %d failed (%s); copying them one by one",
                             len(group), pid, e)
                results.extend(self._copy_here(a) for a in group)
                continue
            results.extend(self._rechecked(a.read, a.peer, a.row) for a in group)
        return results

    def _rechecked(self, r: _Read, peer: Peer, row: np.ndarray) -> BatchResult:
        """After the copy: the batch's result, which stands only if the board row is unchanged.
        Caller holds _direct_lock (the peer's Peeker is used under it)."""
        try:
            if not row_unchanged(peer.peek, peer.addr.board, row):
                raise ReadRefused(ErrorCode.NOT_HELD, f"request {r.request_id}: the hold ended while it was read")
        except Exception as e:
            return self._read_failed(r.peer_id, r.request_id, r.batch_id, e)
        return BatchResult(r.batch_id, r.peer_id, r.request_id, r.d.nbytes, None)

    @staticmethod
    def _read_failed(peer_id: str, request_id: str, batch_id: int, e: BaseException) -> BatchResult:
        if not isinstance(e, OSError | ReadRefused | ValueError):
            report("cma reads", e, f"one-sided read for {request_id} from {peer_id}")
        return BatchResult.failed(batch_id, peer_id, request_id, code_of(e), f"peer {peer_id}: {describe(e)}")

    def _copy(self, pid: int, iov: np.ndarray, nbytes: int) -> None:
        """Copy the pieces ``iov`` (``iovecs``: [local, remote] x piece x (address, length)), of
        ``nbytes`` in all, from process ``pid``."""
        if self._helpers is not None and nbytes > self.inline_copy_bytes:  # cut in parts, copied at once
            bounds = cut(iov[0, :, 1], min(self.copy_threads + 1, nbytes // max(self.inline_copy_bytes, 1)))
            if len(bounds) > 1:
                self._helpers.copy(pid, iov[0], iov[1], bounds, self.timeout_s)
                return
        # a short copy keeps the GIL: about 0.2 ms per 2 MiB, against a switch interval (5 ms)
        # to get it back from a busy thread (a spinning engine) once released
        copy_from(pid, iov[0], iov[1], keep_gil=nbytes <= KEEP_GIL_BYTES, nbytes=nbytes)

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        super().register(regions)
        self._local = self._local_table()
        self._files = None

    def unregister(self, region_ids: Sequence[int]) -> None:
        super().unregister(region_ids)
        self._local = self._local_table()
        self._files = None

    def _local_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[bytes, Pieces]]:
        """This side's regions as sorted ids, their lengths and addresses (int64), and the region
        patterns looked up in them so far (one tuple, replaced whole on (un)registration)."""
        ids = np.array(sorted(self._regions), dtype=np.int64)
        return (ids, np.array([self._regions[int(i)].length for i in ids], dtype=np.int64),
                np.array([self._regions[int(i)].address for i in ids], dtype=np.int64), {})

    # ------------------------------------------------------------------ producer
    def _check_grant(self, req: ReadRequest) -> tuple[Refusal | None, int]:
        """A consumer's grant request against this side's regions, holds and tokens (grant thread)."""
        if self._token_checker is not None and not self._token_checker(req.token):
            return Refusal(ErrorCode.AUTH, "no valid handshake token"), 0
        why, d = check_read(self._table, self._validator, req.request_id, req.regions, req.offsets, req.lengths)
        return why, d.nbytes

    @classmethod
    def engine_reads(cls, options: Mapping[str, DataPlaneValue],
                     regions: Sequence[MemoryRegion]) -> EngineReads | None:
        """The engine's thread copies small loads one-sided itself (``engine_reads.py``); its
        options are checked as the agent's plane checks them."""
        map_memory = options.get("map_memory", True)
        if not isinstance(map_memory, bool):
            raise ValueError(f"connector.data_plane.map_memory: expected true or false, got {map_memory!r}")
        return CmaEngineReads(regions, map_memory)

    # ------------------------------------------------------------------ both
    def counters(self) -> dict[str, float]:
        return {"one_sided_reads": self.one_sided_reads, "mapped_reads": self.mapped_reads,
                "granted_reads": self.granted_reads}

    def broken(self) -> str | None:
        if self._closed:
            return "the plane is closed"
        if not self._read_thread.is_alive():
            return "its read thread stopped"
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._board is not None:  # no one-sided read is allowed from here on
            self._board.close()
        with self._direct_lock:  # no one-sided copy runs now, nor starts (closed): the mappings go
            for peer in self._direct.values():
                unmap(peer)
        self._jobs.put(None)
        self._wake()
        self._read_thread.join(timeout=5)
        self._grant_server.close()
        if self._helpers is not None:
            self._helpers.close()
        if not self._read_thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)
