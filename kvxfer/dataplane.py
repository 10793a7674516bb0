"""The data-plane interface connectors implement, and their discovery by entry point.

Connectors register in the ``kvxfer.connectors`` entry-point group exactly as a
third-party plugin would; the core never imports a connector module by name.
``kvxfer.connector`` re-exports everything here beside the engine-facing ``Connector``.

Contract for implementations:
- serve only registered regions, and only reads the validator allows;
- every ``read`` reports exactly one ``BatchResult`` through ``poll``, ok or failed (with an
  :class:`~kvxfer.protocol.ErrorCode`), within the data plane's own time limit; after
  reporting, it never touches the destination again;
- with a token checker set, a connection that does not present a valid token is closed;
- no exception ends a plane's thread: one that escapes an iteration fails what it touched and
  goes to :func:`kvxfer.supervise.report`; a plane that cannot go on says why in ``broken``.
"""

from __future__ import annotations

import functools
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import ClassVar

import numpy as np

from kvxfer.cache.tensors import MemoryRegion
from kvxfer.config import DataPlaneValue
from kvxfer.protocol import MAX_READ_PIECES, ErrorCode, Refusal
from kvxfer.supervise import describe, report

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvxfer.connectors"
_INT64 = np.dtype(np.int64)


@dataclass(frozen=True)
class Descriptors:
    """A batch of ``(remote region, offset, local region, offset, length)`` copies, as arrays."""

    remote_region: np.ndarray
    remote_offset: np.ndarray
    local_region: np.ndarray
    local_offset: np.ndarray
    length: np.ndarray

    def __post_init__(self) -> None:
        arrays = (self.remote_region, self.remote_offset, self.local_region, self.local_offset, self.length)
        n = len(self.length)
        for a in arrays:
            if a.ndim != 1 or len(a) != n or a.dtype != _INT64:
                raise ValueError("Descriptors: expected five 1-d int64 arrays of one length")
        if n and (self.length.min() <= 0 or self.remote_offset.min() < 0 or self.local_offset.min() < 0):
            raise ValueError("Descriptors: lengths must be > 0 and offsets >= 0")

    def __len__(self) -> int:
        return len(self.length)

    @functools.cached_property
    def nbytes(self) -> int:
        """The batch's bytes (summed once: the planner, the plane and its result each ask)."""
        return int(self.length.sum())

    @classmethod
    def concat(cls, parts: Sequence[Descriptors]) -> Descriptors:
        """One batch of every part's pieces, in order."""
        return cls(*(np.concatenate([getattr(d, f) for d in parts]) for f in
                     ("remote_region", "remote_offset", "local_region", "local_offset", "length")))

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[int, int, int, int, int]]) -> Descriptors:
        a = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
        return cls(*(np.ascontiguousarray(a[:, i]) for i in range(5)))


# a piece of a BlockPieces: (remote region, remote unit, remote stride, remote inner offset,
#                            local region, local unit, local stride, local inner offset, length)
BlockPiece = tuple[int, int, int, int, int, int, int, int, int]


@dataclass(frozen=True, eq=False)
class BlockPieces:
    """A read of one shape for any block ids, as Python tuples an engine's thread walks with the
    GIL kept (``EngineReads.read_blocks``): piece ``(rr, ru, rs, ri, lr, lu, ls, li, n)`` copies
    ``n`` bytes from remote region ``rr`` at ``remote_blocks[ru] * rs + ri`` to local region ``lr``
    at ``local_blocks[lu] * ls + li``. Made once per shape and kept (a reader may keep what it
    derives from one by its identity).

    ``per_block``: the pieces of one block (every unit 0), read for each block of the lists in
    turn (remote block ``i`` into local block ``i``; the lists as long as each other). One such
    shape serves loads of any length, where a shape of the whole load is made per prompt length
    and grows with it (``nbytes`` is then one block's)."""

    pieces: tuple[BlockPiece, ...]
    nbytes: int
    per_block: bool = False

    def bytes_for(self, blocks: int) -> int:
        """The bytes a read of ``blocks`` block ids (per remote list) moves."""
        return self.nbytes * blocks if self.per_block else self.nbytes

    def descriptors(self, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> Descriptors:
        """The pieces for these block ids, as a plane's ``read`` takes them (a per-block shape's
        piece by piece, each over every block in turn: neighbours a coalescing pass can join)."""
        a = np.array(self.pieces, dtype=np.int64).reshape(-1, 9)
        rb, lb = np.asarray(remote_blocks, dtype=np.int64), np.asarray(local_blocks, dtype=np.int64)
        if self.per_block:
            if len(rb) != len(lb):
                raise ValueError(f"a per-block read needs as many local block ids as remote ({len(lb)} != {len(rb)})")
            n = len(rb)
            ro = rb[None, :] * a[:, 2:3] + a[:, 3:4]
            lo = lb[None, :] * a[:, 6:7] + a[:, 7:8]
            return Descriptors(np.repeat(a[:, 0], n), ro.ravel(), np.repeat(a[:, 4], n), lo.ravel(),
                               np.repeat(a[:, 8], n))
        return Descriptors(a[:, 0].copy(), rb[a[:, 1]] * a[:, 2] + a[:, 3], a[:, 4].copy(),
                           lb[a[:, 5]] * a[:, 6] + a[:, 7], a[:, 8].copy())


class RegionTable:
    """Sorted region ids and sizes for vectorised bounds checks; rebuilt only on (un)registration."""

    def __init__(self, regions: Mapping[int, MemoryRegion]) -> None:
        known = np.fromiter(regions.keys(), dtype=np.int64, count=len(regions))
        sizes = np.fromiter((r.length for r in regions.values()), dtype=np.int64, count=len(regions))
        bases = np.fromiter((r.address for r in regions.values()), dtype=np.int64, count=len(regions))
        order = np.argsort(known)
        self.known, self.sizes, self.bases = known[order], sizes[order], bases[order]

    def addresses(self, region_ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """This process's address of each piece (regions checked registered: ``check_bounds``)."""
        return self.bases[np.searchsorted(self.known, region_ids)] + offsets


def check_bounds(regions: Mapping[int, MemoryRegion] | RegionTable, region_ids: np.ndarray,
                 offsets: np.ndarray, lengths: np.ndarray) -> str | None:
    """Why a set of (region, offset, length) pieces falls outside ``regions``, or None.

    Pass a RegionTable (kept by the data plane) on hot paths to skip rebuilding it."""
    if not len(lengths):
        return None
    t = regions if isinstance(regions, RegionTable) else RegionTable(regions)
    known, sizes = t.known, t.sizes
    pos = np.minimum(np.searchsorted(known, region_ids), max(len(known) - 1, 0))  # (clip: 9 us of dtype checks)
    registered = (known[pos] == region_ids) if len(known) else np.zeros(len(region_ids), bool)
    if not registered.all():
        bad = int(region_ids[~registered][0])
        return f"region {bad} is not registered"
    ends = offsets + lengths
    past = ends > sizes[pos]
    if past.any():
        i = int(np.flatnonzero(past)[0])
        return (f"piece [{int(offsets[i])}, {int(ends[i])}) is past the end of region "
                f"{int(region_ids[i])} ({int(sizes[pos][i])} bytes)")
    return None


_NO_PIECES = Descriptors.from_rows([])  # a refused read's pieces (made once: 14 us a read), read-only
for _a in (_NO_PIECES.remote_region, _NO_PIECES.remote_offset, _NO_PIECES.local_region, _NO_PIECES.local_offset,
           _NO_PIECES.length):
    _a.setflags(write=False)


def check_read_parts(table: RegionTable, validator: ReadValidator | None, request_id: str, regions: bytes,
                     offsets: bytes, lengths: bytes, parts: Sequence[tuple[str, int]]
                     ) -> tuple[Refusal | None, Descriptors]:
    """``check_read`` of a request that carries several requests' pieces (``ReadRequest.parts``):
    each part checked against its own request; the first refusal, named by its request, refuses
    the whole (the reader then reads the parts one by one, each answered alone)."""
    if not parts:
        return check_read(table, validator, request_id, regions, offsets, lengths)
    empty = _NO_PIECES
    counts = [n for _, n in parts]
    if parts[0][0] != request_id or min(counts) < 1 or sum(counts) * 8 != len(lengths) \
            or sum(counts) > MAX_READ_PIECES:
        return Refusal(ErrorCode.BAD_MESSAGE, "malformed read request: its parts do not cover its pieces"), empty
    done: list[Descriptors] = []
    a = 0
    for rid, n in parts:
        cut = slice(a * 8, (a + n) * 8)
        a += n
        why, d = check_read(table, validator, rid, regions[cut], offsets[cut], lengths[cut])
        if why is not None:
            return Refusal(why.code, f"request {rid}: {why.message}"), empty
        done.append(d)
    return None, Descriptors.concat(done)


def check_read(table: RegionTable, validator: ReadValidator | None, request_id: str, regions: bytes,
               offsets: bytes, lengths: bytes, allow_empty: bool = False) -> tuple[Refusal | None, Descriptors]:
    """The serving side's check of a read request's packed int64 arrays: why it must be refused
    (malformed, out of bounds, or not allowed by ``validator``), or None; and its pieces as
    Descriptors whose ``remote_*`` fields are this side's regions (empty when refused).

    A validator that raises refuses the read as ``internal`` (reported once, see
    :mod:`kvxfer.supervise`): a bug there must not end the serving loop that called it."""
    empty = _NO_PIECES
    if len(regions) % 8 or len(offsets) % 8 or len(lengths) % 8:
        return Refusal(ErrorCode.BAD_MESSAGE, "malformed read request"), empty
    arrays = [np.frombuffer(b, dtype="<i8").astype(np.int64) for b in (regions, offsets, lengths)]
    n = len(arrays[0])
    if any(len(a) != n for a in arrays) or n > MAX_READ_PIECES or (n == 0 and not allow_empty):
        return Refusal(ErrorCode.BAD_MESSAGE, "malformed read request"), empty
    if n and ((arrays[2] <= 0).any() or (arrays[1] < 0).any()):
        return Refusal(ErrorCode.BAD_MESSAGE, "lengths must be > 0 and offsets >= 0"), empty
    zeros = np.zeros(n, dtype=np.int64)
    d = Descriptors(arrays[0], arrays[1], zeros, zeros, arrays[2])
    out_of_bounds = check_bounds(table, d.remote_region, d.remote_offset, d.length)
    if out_of_bounds is not None:
        return Refusal(ErrorCode.OUT_OF_BOUNDS, out_of_bounds), empty
    if validator is None:
        return None, d
    try:
        why = validator(request_id, d)
    except Exception as e:
        report("read validator", e, f"read for {request_id}")
        why = Refusal(ErrorCode.INTERNAL, f"the read check failed: {describe(e)}")
    return why, (empty if why else d)


@dataclass(frozen=True)
class BatchResult:
    """The outcome of one ``read`` batch: ``error`` (a message) and ``code`` are None on success."""

    batch_id: int
    peer_id: str
    request_id: str
    nbytes: int
    error: str | None = None
    code: ErrorCode | None = None

    def __post_init__(self) -> None:
        if self.error is not None and self.code is None:  # a plugin that gives no code: still typed
            object.__setattr__(self, "code", ErrorCode.INTERNAL)

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def failed(cls, batch_id: int, peer_id: str, request_id: str, code: ErrorCode, error: str) -> BatchResult:
        return cls(batch_id, peer_id, request_id, 0, error, code)


class ReadRefused(Exception):
    """A read the serving side refused, with its typed code (raised inside planes)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"read refused: {message}")
        self.code = code


class PlaneBroken(RuntimeError):
    """A data plane cannot go on (its threads or transport are gone): every load on it fails."""

    code = ErrorCode.PLANE_BROKEN


ReadValidator = Callable[[str, Descriptors], Refusal | None]
"""Called on the serving side with (request id, descriptors whose ``remote_*`` fields are in
the server's own regions); returns a typed refusal, or None to allow the read."""

TokenChecker = Callable[[bytes], bool]
"""Called on the serving side with the token a new connection presents."""


class EngineReads(ABC):
    """Reads a data plane lets an engine's own thread make while its transfer agent does the rest.

    With a transfer agent, a small load costs two process hops (engine -> agent -> engine) that
    take longer than its bytes. A plane that reads one-sided (cma) can copy such a load on the
    thread that calls ``start_load``, as NIXL's caller does, from producers the agent has
    handshaken (``connect`` with what their handshake published). It is only ever an
    optimisation: a read it cannot make whole returns None and the agent loads it as before.
    ``read`` runs on the engine's thread and must keep the GIL (a busy thread of the engine given
    it keeps it a switch interval, 5 ms): no blocking call, no ``CDLL`` function, none of the
    numpy calls that release it whatever the size (``tests/test_gil_kept.py``).

    Threads: one caller at a time (the engine's connector serialises calls)."""

    @abstractmethod
    def connect(self, peer_id: str, address: bytes) -> None:
        """Be ready to read the producer whose ``DataPlane.address()`` this is; raises
        ConnectionError naming why it cannot be read from here."""

    @abstractmethod
    def disconnect(self, peer_id: str) -> None:
        """Forget a producer (restarted, or unreadable)."""

    @abstractmethod
    def connected(self, peer_id: str) -> bool:
        """Whether the producer is still read from here (it may have been forgotten as unreadable)."""

    @abstractmethod
    def read(self, request_id: str, reads: Sequence[tuple[str, Descriptors]]) -> bool:
        """Copy all of ``reads`` (peer id, descriptors; ``local_*`` in this process's regions) for
        the producer's ``request_id`` now, checked against its holds, or report False: then the
        caller's agent loads it (what was written went only into the load's own blocks)."""

    def read_blocks(self, request_id: str, reads: Sequence[tuple[str, BlockPieces, Sequence[int], Sequence[int]]],
                    release_gil: bool = False) -> bool:
        """``read`` of (peer id, pieces, remote block ids, local block ids): a plane may derive
        what a shape's reads need once and keep it (cma does); by default, ``read`` of each
        shape's descriptors. ``release_gil``: a large load, whose copy may let the GIL go (the
        engine's other threads run meanwhile); else the copy keeps it."""
        return self.read(request_id, [(peer_id, bp.descriptors(rb, lb)) for peer_id, bp, rb, lb in reads])

    @abstractmethod
    def close(self) -> None:
        """Unmap and forget every producer."""


class DataPlane(ABC):
    """Moves bytes between registered regions of two ranks; never interprets them."""

    name: ClassVar[str]
    engine_id: str = "kvxfer"  # set by the Connector; planes name themselves with it to their peers
    known_options: ClassVar[frozenset[str] | None] = None  # None: accept any option
    cross_process: ClassVar[bool] = True  # False: both ranks must live in one process (tests)

    def __init__(self, options: Mapping[str, DataPlaneValue] | None = None) -> None:
        self.options = dict(options or {})
        if self.known_options is not None:
            unknown = set(self.options) - self.known_options
            if unknown:
                raise ValueError(f"connector.data_plane: unknown option(s) {sorted(unknown)} for {self.name}; "
                                 f"known: {sorted(self.known_options)}")

    @abstractmethod
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Make ``regions`` readable by peers (and writable by this rank's reads)."""

    @abstractmethod
    def address(self) -> bytes:
        """What a peer needs to connect, published in the handshake."""

    @abstractmethod
    def connect(self, peer_id: str, address: bytes, token: bytes = b"") -> None:
        """Open a path to the peer whose ``address()`` this is, presenting ``token``."""

    def disconnect(self, peer_id: str) -> None:  # noqa: B027 - optional for simple planes
        """Forget a peer (it restarted, or failed); later reads to it fail."""

    @abstractmethod
    def set_read_validator(self, validator: ReadValidator) -> None:
        """Serving side: every incoming read is checked by ``validator`` before it is served."""

    def set_token_checker(self, checker: TokenChecker) -> None:  # noqa: B027
        """Serving side: refuse connections whose token ``checker`` rejects."""

    def unregister(self, region_ids: Sequence[int]) -> None:  # noqa: B027
        """Stop serving and writing these regions (temporary staging areas)."""

    def hold_changed(self, request_id: str, block_ids: np.ndarray | None) -> None:  # noqa: B027
        """Serving side: a pull hold was made on ``block_ids``, or (None) it ended. A plane whose
        consumers read one-sided publishes it (``kvxfer.transfer.hold_board``). Called under the
        hold registry's lock, before the engine can free an ended hold's blocks: be quick, never
        raise, never call back into the connector."""

    def set_completion_callback(self, callback: Callable[[], None]) -> None:  # noqa: B027
        """Called (from any thread) whenever a batch finishes, so a waiter need not poll."""

    @abstractmethod
    def read(self, peer_id: str, request_id: str, descriptors: Descriptors) -> int:
        """Start copying remote pieces into local regions; returns a batch id."""

    def read_many(self, reads: Sequence[tuple[str, str, Descriptors]]) -> list[int]:
        """``read`` for each (peer id, request id, descriptors), in order; their batch ids. A
        plane may move them together (cma: one copy cut across its threads for all), but each
        is still its own batch, checked and reported alone."""
        return [self.read(peer_id, request_id, d) for peer_id, request_id, d in reads]

    @abstractmethod
    def poll(self) -> list[BatchResult]:
        """Batches finished since the last call (non-blocking)."""

    @abstractmethod
    def close(self) -> None:
        """Stop every thread and socket this data plane started."""

    @classmethod
    def engine_reads(cls, options: Mapping[str, DataPlaneValue],
                     regions: Sequence[MemoryRegion]) -> EngineReads | None:
        """Reads the engine's own thread may make into ``regions`` (its cache, in its process),
        beside a transfer agent running this plane with ``options``; None (the default): none,
        the agent makes every read (see :class:`EngineReads`)."""
        return None

    def counters(self) -> dict[str, float]:
        """The plane's own counters (``Connector.stats()`` shows them as ``plane_<name>``)."""
        return {}

    def broken(self) -> str | None:
        """Why this plane cannot go on (a thread it needs has stopped), or None while it can.

        Checked by the consumer on every turn: once it says why, every pending and later load
        on this plane fails at once with that reason (code ``plane_broken``)."""
        return None


def available_data_planes() -> dict[str, EntryPoint]:
    """Installed data planes by name, from the ``kvxfer.connectors`` entry-point group."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_data_plane(name: str) -> type[DataPlane]:
    """The DataPlane class registered under ``name``; an unknown name lists the installed ones."""
    found = available_data_planes()
    if name not in found:
        installed = ", ".join(sorted(found)) or "none"
        raise ValueError(
            f"connector.name: no data plane {name!r} in entry-point group "
            f"{ENTRY_POINT_GROUP!r}; installed: {installed}"
        )
    cls = found[name].load()
    if not (isinstance(cls, type) and issubclass(cls, DataPlane)):
        raise TypeError(f"entry point {name!r} ({found[name].value}) is not a DataPlane subclass")
    return cls


def join_adjacent(dst: np.ndarray, src: np.ndarray, size: np.ndarray,
                  same: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Pieces (``dst``, ``src``, ``size`` per piece, addresses) with each run of pieces adjacent on
    both sides joined into one, so a copy or get per piece makes fewer calls. ``same`` (one value
    per piece, e.g. a remote key): pieces join only where it is equal too; returned joined alike."""
    if len(dst) < 2:
        return dst, src, size, same
    joins = (dst[:-1] + size[:-1] == dst[1:]) & (src[:-1] + size[:-1] == src[1:])
    if same is not None:
        joins &= same[:-1] == same[1:]
    if not joins.any():
        return dst, src, size, same
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return dst[starts], src[starts], run_sums(size, starts), None if same is None else same[starts]


def run_sums(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The sum of each run of ``values`` beginning at ``starts`` (increasing, the first 0): what
    ``np.add.reduceat`` gives, without its release of the GIL whatever the size (an engine's
    thread planning or copying a small load would hand the GIL to any busy thread of the engine
    for a switch interval). Empty ``values``: an empty result."""
    if not len(values):
        return np.zeros(0, dtype=np.result_type(values.dtype, np.int64))
    ends = np.cumsum(values)
    return ends[np.append(starts[1:] - 1, len(values) - 1)] - ends[starts] + values[starts]


def address_view(address: int, length: int) -> memoryview:
    """A byte view of ``length`` bytes this process maps at ``address`` (zero-copy)."""
    import ctypes

    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


def region_array(r: MemoryRegion) -> np.ndarray:
    """A zero-copy uint8 numpy view of a registered host region."""
    return np.frombuffer(address_view(r.address, r.length), dtype=np.uint8)


class HostRegionPlane(DataPlane):
    """What data planes that move host memory share: a zero-copy view per region (numpy array
    and memoryview), the region table used for bounds checks, the serving side's validator and
    token checker, and the finished batches ``poll`` hands out."""

    def __init__(self, options: Mapping[str, DataPlaneValue] | None = None) -> None:
        super().__init__(options)
        self._regions: dict[int, MemoryRegion] = {}
        self._arrays: dict[int, np.ndarray] = {}
        self._views: dict[int, memoryview] = {}
        self._table = RegionTable(self._regions)
        self._validator: ReadValidator | None = None
        self._token_checker: TokenChecker | None = None
        self._on_complete: Callable[[], None] | None = None
        self._results: list[BatchResult] = []
        self._results_lock = threading.Lock()

    def set_read_validator(self, validator: ReadValidator) -> None:
        self._validator = validator

    def set_token_checker(self, checker: TokenChecker) -> None:
        self._token_checker = checker

    def set_completion_callback(self, callback: Callable[[], None]) -> None:
        self._on_complete = callback

    def _finish(self, result: BatchResult) -> None:
        """Report a batch (from any thread) and wake the waiter."""
        with self._results_lock:
            self._results.append(result)
        if self._on_complete is not None:
            self._on_complete()

    def poll(self) -> list[BatchResult]:
        with self._results_lock:
            out, self._results = self._results, []
        return out

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        for r in regions:
            if r.device != "cpu":
                raise ValueError(f"region {r.region_id}: the {self.name} data plane moves host memory, got "
                                 f"{r.device} (device caches are staged through a host mirror)")
            if r.region_id in self._regions:
                raise ValueError(f"region {r.region_id} is already registered")
        for r in regions:
            self._arrays[r.region_id] = region_array(r)
            self._views[r.region_id] = self._arrays[r.region_id].data
            self._regions[r.region_id] = r
        self._table = RegionTable(self._regions)

    def unregister(self, region_ids: Sequence[int]) -> None:
        for rid in region_ids:
            self._regions.pop(rid, None)
            self._arrays.pop(rid, None)
            self._views.pop(rid, None)
        self._table = RegionTable(self._regions)
