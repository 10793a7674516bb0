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
memory anyway. ``connect`` probes one byte and says plainly when the kernel refuses (another
host, another pid namespace, ptrace denied): use ``tcp`` or ``ucx`` there.

A producer that dies makes the copy fail with ESRCH, one that stalls makes the grant miss its
deadline: either way the batch fails within ``timeout_s`` and nothing more is written.

A copy of more than ``inline_copy_bytes`` is cut into parts that the reading thread and the
plane's copy threads copy at once (:mod:`.copier`); it is still done when the reading thread's
call returns. The copies themselves are in :mod:`.memory`; the producer's grant thread in
:mod:`.grants`.

Options (``connector.data_plane``): ``timeout_s`` (per batch, default 30), ``host`` (where the
control socket listens; default the side channel's host), ``one_sided`` (default true: publish
holds on the board; false: every read of this producer asks for a grant), ``copy_threads``
(helpers beside the reading thread; default: the CPUs this process may run on, less one, from 1
to 3; 0: the reading thread copies alone), ``inline_copy_bytes`` (default 2 MiB: a larger copy is
cut into parts of at least this size, one per copying thread; one 2 MiB block is copied whole).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from kvxfer.cache.tensors import MemoryRegion
from kvxfer.config import DataPlaneValue
from kvxfer.dataplane import (
    BatchResult,
    Descriptors,
    HostRegionPlane,
    ReadRefused,
    check_bounds,
    check_read,
)
from kvxfer.protocol import ErrorCode, ReadReply, ReadRequest, Refusal, decode_data, encode
from kvxfer.supervise import code_of, describe, report
from kvxfer.transfer.hold_board import WINDOW, HoldBoard, check_one_sided, row_unchanged

from .copier import CopyHelpers, cut
from .grants import GrantServer
from .memory import Peeker, copy_from, iovecs

logger = logging.getLogger(__name__)

OPTIONS = {"timeout_s", "host", "one_sided", "copy_threads", "inline_copy_bytes"}
GRANT_POLL_MS = 50  # the read thread's longest wait for a grant before it checks the deadlines again
DISCONNECT_WAIT_S = 5.0  # disconnect waits this long at most for the read thread to drop the peer
_NO_JOB = object()

KEEP_GIL_BYTES = 4 << 20  # copies up to this size keep it too (see _copy)
MAX_PATTERNS = 64  # region patterns whose per-piece tables are kept (per peer, and for this side)
MAX_KEPT_PIECES = 4096  # only patterns up to this many pieces are kept: the small loads it is for, bounded memory
MAX_DEFAULT_COPY_THREADS = 3  # default copy_threads: the CPUs this process may use, less one, at most this
INLINE_COPY_BYTES = 2 << 20  # default inline_copy_bytes: a larger copy is cut in parts of at least this size


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class CmaAddress(msgspec.Struct, frozen=True):
    pid: int
    boot_id: str  # another host's process with the same pid must not be read
    control: str  # the producer's ZMQ endpoint for grants
    regions: dict[int, tuple[int, int]]  # region id -> (address, length) in the producer
    strides: dict[int, int] = {}  # region id -> bytes per block (what the board's block ids index)
    board: tuple[int, int] = (0, 0)  # the producer's hold board: (address, rows); (0, 0): none, ask for grants


@dataclass(frozen=True)
class _Pieces:
    """A batch's regions looked up once per region pattern (its region ids, in order): per
    piece, its region's length, address and bytes per block. Loads of one plan shape repeat
    one pattern, so a read then costs no search of the region table."""

    sizes: np.ndarray
    bases: np.ndarray
    strides: np.ndarray | None  # None: not asked for (this side's regions)


def _pieces(cache: dict[bytes, _Pieces], ids: np.ndarray, sizes: np.ndarray, bases: np.ndarray,
            strides: np.ndarray | None, regions: np.ndarray) -> _Pieces | None:
    """The per-piece tables of ``regions`` (``ids`` sorted, the rest by position in it), kept in
    ``cache``; None when some region is not among ``ids``."""
    key = regions.tobytes()
    hit = cache.get(key)
    if hit is None:
        if not len(ids):
            return None
        pos = np.minimum(np.searchsorted(ids, regions), len(ids) - 1)
        if not (ids[pos] == regions).all():
            return None
        hit = _Pieces(sizes[pos], bases[pos], None if strides is None else strides[pos])
        for a in (hit.sizes, hit.bases, hit.strides):
            if a is not None:
                a.flags.writeable = False
        if len(regions) <= MAX_KEPT_PIECES:  # a large load's tables would cost MBs each, for little gain
            if len(cache) >= MAX_PATTERNS:
                cache.clear()
            cache[key] = hit
    return hit


@dataclass
class _Peer:
    addr: CmaAddress
    dealer: Any  # zmq DEALER to the producer's control socket (plane thread only)
    token: bytes
    base: np.ndarray  # remote region id -> address (int64), indexed by position in ids
    ids: np.ndarray
    sizes: np.ndarray
    strides: np.ndarray  # bytes per block, by position in ids (0: unknown, no one-sided reads)
    peek: Peeker  # small reads of its memory (the board), under the plane's _direct_lock
    patterns: dict[bytes, _Pieces] = field(default_factory=dict)  # one-sided reads' (under _direct_lock)


@dataclass
class _Awaited:
    """A read whose grant request is sent and not yet answered (the read thread's)."""

    peer_id: str
    request_id: str
    d: Descriptors
    local: np.ndarray  # each piece's local region's address
    pos: np.ndarray  # index of each piece's remote region in the peer's tables
    deadline: float


@dataclass
class _Read:
    """A read this side may copy one-sided, once the producer's board allows it."""

    peer_id: str
    request_id: str
    batch_id: int
    d: Descriptors
    local: np.ndarray  # each piece's local region's address


def _copy_part(pid: int, local: np.ndarray, remote: np.ndarray, nbytes: int) -> None:
    copy_from(pid, local, remote, nbytes=nbytes)


class CmaDataPlane(HostRegionPlane):
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
        self.copy_threads: int = threads
        self.inline_copy_bytes: int = inline
        self.engine_id = "kvxfer"
        self._board = HoldBoard() if one_sided else None  # producer side: the holds consumers check themselves
        self._peers: dict[str, _Peer] = {}
        # consumer side, one-sided reads: the peers they may read, and the lock a copy holds (so a
        # disconnect returns only when no copy from that peer runs); taken by the reading thread
        self._direct: dict[str, _Peer] = {}
        self._direct_lock = threading.Lock()
        self._local = self._local_table()  # what read() looks this side's pieces up in (_local_table)
        self.one_sided_reads = 0  # reads the board allowed
        self.granted_reads = 0  # reads that asked the producer
        self._ids = itertools.count(1)
        self._closed = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._grant_server = GrantServer(str(self.options.get("host", "127.0.0.1")), self._check_grant)  # producer side
        self._jobs: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._waiting: dict[int, _Awaited] = {}  # batch id -> its awaited grant (the read thread's)
        self._wake_r, self._wake_w = os.pipe()  # a queued job wakes the read thread from its grant wait
        os.set_blocking(self._wake_w, False)
        self._read_thread = threading.Thread(target=self._run, name="kvxfer-cma-reads", daemon=True)
        self._read_thread.start()
        # copies larger than inline_copy_bytes are cut in parts these threads help with (copier.py)
        self._helpers = CopyHelpers(self.copy_threads, _copy_part) if self.copy_threads else None

    # ------------------------------------------------------------------ registration
    def address(self) -> bytes:
        regions = {rid: (r.address, r.length) for rid, r in self._regions.items()}
        strides = {rid: r.block_stride for rid, r in self._regions.items()}
        board = (0, 0) if self._board is None else (self._board.address, self._board.rows)
        return msgspec.msgpack.encode(CmaAddress(pid=os.getpid(), boot_id=_boot_id(),
                                                 control=self._grant_server.address, regions=regions,
                                                 strides=strides, board=board))

    def hold_changed(self, request_id: str, block_ids: np.ndarray | None) -> None:
        if self._board is None:
            return
        try:
            if block_ids is None:
                self._board.withdraw(request_id)
            else:
                self._board.publish(request_id, block_ids)
        except Exception as e:  # never raise into the hold registry: the read asks for a grant instead
            report("cma hold board", e, f"request {request_id}")

    # ------------------------------------------------------------------ consumer
    def connect(self, peer_id: str, address: bytes, token: bytes = b"") -> None:
        try:
            addr = msgspec.msgpack.decode(address, type=CmaAddress)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ConnectionError(f"peer {peer_id}: bad cma address: {e}") from None
        if addr.boot_id != _boot_id():
            raise ConnectionError(f"peer {peer_id} runs on another host: the cma data plane reads only on one "
                                  f"host (use tcp or ucx)")
        if not addr.regions:
            raise ConnectionError(f"peer {peer_id} registered no regions")
        base, _length = next(iter(addr.regions.values()))
        probe = np.zeros(1, dtype=np.uint8)
        try:
            copy_from(addr.pid, np.array([[probe.ctypes.data, 1]], dtype=np.uint64),
                      np.array([[base, 1]], dtype=np.uint64))
        except OSError as e:
            raise ConnectionError(f"peer {peer_id} (pid {addr.pid}): the kernel refuses cross-memory reads ({e}); "
                                  f"another pid namespace, or ptrace denied: use tcp or ucx") from None
        ids = np.array(sorted(addr.regions), dtype=np.int64)
        peer = _Peer(addr, None, token, np.array([addr.regions[int(i)][0] for i in ids], dtype=np.int64), ids,
                     np.array([addr.regions[int(i)][1] for i in ids], dtype=np.int64),
                     np.array([max(addr.strides.get(int(i), 0), 0) for i in ids], dtype=np.int64), Peeker(addr.pid))
        with self._direct_lock:
            if addr.board[1] > WINDOW and (peer.strides > 0).all():
                self._direct[peer_id] = peer
            else:
                self._direct.pop(peer_id, None)
        self._jobs.put(("connect", (peer_id, peer)))
        self._wake()

    def disconnect(self, peer_id: str) -> None:
        """Forget a peer; returns once no thread copies from it (a one-sided copy in progress
        finishes first; the read thread drops it), so a failed load's blocks are not written once
        reported."""
        with self._direct_lock:
            self._direct.pop(peer_id, None)
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
            local = _pieces(patterns, ids, sizes, bases, None, d.local_region)
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
            allowed: list[tuple[_Read, _Peer, np.ndarray, np.ndarray]] = []  # read, peer, remote bases, row
            for r in reads:
                d = r.d
                peer = self._direct.get(r.peer_id)
                if peer is None or self._closed:
                    asked.append(r)
                    continue
                remote = _pieces(peer.patterns, peer.ids, peer.sizes, peer.base, peer.strides, d.remote_region)
                if remote is None or remote.strides is None:
                    asked.append(r)  # the grant path refuses it, by name
                    continue
                end = d.remote_offset + d.length
                if (end > remote.sizes).any():
                    asked.append(r)
                    continue
                end -= 1
                row = check_one_sided(peer.peek, peer.addr.board, r.request_id, d.remote_offset // remote.strides,
                                      end // remote.strides)
                if row is None:
                    asked.append(r)
                    continue
                self.one_sided_reads += 1
                allowed.append((r, peer, remote.bases, row))
            if len(allowed) == 1:
                results.append(self._copy_here(*allowed[0]))
            elif allowed:
                results.extend(self._copy_together(allowed))
        for res in results:
            self._finish(res)  # not under _direct_lock: a completion callback may call back into the plane
        return asked

    def _copy_here(self, r: _Read, peer: _Peer, remote: np.ndarray, row: np.ndarray) -> BatchResult:
        """A one-sided read the board allowed, copied on this thread. Caller holds _direct_lock."""
        try:
            iov = iovecs(r.d, r.local, remote)
            self._copy(peer.addr.pid, iov, r.d.nbytes)
        except Exception as e:
            return self._read_failed(r.peer_id, r.request_id, r.batch_id, e)
        return self._rechecked(r, peer, row)

    def _copy_together(self, allowed: list[tuple[_Read, _Peer, np.ndarray, np.ndarray]]) -> list[BatchResult]:
        """Several allowed reads: one copy per producer process for all of them, then each read
        rechecked alone. If a joint copy fails, its reads are copied again one by one, so each
        fails (or not) for its own reason. Caller holds _direct_lock."""
        by_pid: dict[int, list[tuple[_Read, _Peer, np.ndarray, np.ndarray]]] = {}
        for a in allowed:
            by_pid.setdefault(a[1].addr.pid, []).append(a)
        results: list[BatchResult] = []
        for pid, group in by_pid.items():
            try:
                iov = np.concatenate([iovecs(r.d, r.local, remote) for r, _, remote, _ in group], axis=1)
                self._copy(pid, iov, sum(r.d.nbytes for r, _, _, _ in group))
            except TimeoutError as e:  # a helper may still be copying: no read of the group may stand
                results.extend(self._read_failed(r.peer_id, r.request_id, r.batch_id, e) for r, _, _, _ in group)
                continue
            except Exception as e:
                logger.debug("cma: a joint copy of %d reads from pid %d failed (%s); copying them one by one",
                             len(group), pid, e)
                results.extend(self._copy_here(*a) for a in group)
                continue
            results.extend(self._rechecked(r, peer, row) for r, peer, _, row in group)
        return results

    def _rechecked(self, r: _Read, peer: _Peer, row: np.ndarray) -> BatchResult:
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
                job = _NO_JOB
            while job is not _NO_JOB:
                if self._take(job):  # the stop job
                    for batch_id in list(self._waiting):
                        self._fail_waiting(batch_id, ConnectionError("the plane is closed"))
                    for p in self._peers.values():
                        p.dealer.close(linger=0)
                    return
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    job = _NO_JOB
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
        pos = np.searchsorted(peer.ids, d.remote_region).clip(0, len(peer.ids) - 1)
        if not (peer.ids[pos] == d.remote_region).all() or (d.remote_offset + d.length > peer.sizes[pos]).any():
            raise ReadRefused(ErrorCode.OUT_OF_BOUNDS, "a piece lies outside the producer's regions")
        req = ReadRequest(request_id=request_id, batch_id=batch_id, regions=d.remote_region.tobytes(),
                          offsets=d.remote_offset.tobytes(), lengths=d.length.tobytes(), token=peer.token)
        peer.dealer.send(b"R" + encode(req))
        self._waiting[batch_id] = _Awaited(peer_id, request_id, d, local, pos, time.monotonic() + self.timeout_s)

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

    def _on_grant(self, peer_id: str, peer: _Peer, reply: Any) -> None:
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

    def unregister(self, region_ids: Sequence[int]) -> None:
        super().unregister(region_ids)
        self._local = self._local_table()

    def _local_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[bytes, _Pieces]]:
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

    # ------------------------------------------------------------------ both
    def broken(self) -> str | None:
        if self._closed:
            return "the plane is closed"
        if not self._read_thread.is_alive():
            return "its read thread stopped"
        return None

    def close(self) -> None:
        if self._closed:
            return
        if self._board is not None:  # no one-sided read is allowed from here on
            self._board.table[:] = 0
        self._closed = True
        self._jobs.put(None)
        self._wake()
        self._read_thread.join(timeout=5)
        self._grant_server.close()
        if self._helpers is not None:
            self._helpers.close()
        if not self._read_thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)
