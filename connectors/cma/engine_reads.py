"""cma reads made by the engine's own thread, beside its transfer agent (:class:`kvxfer.dataplane.EngineReads`).

The same one-sided read as the plane's (:meth:`CmaDataPlane._read_one_sided`): the producer's hold
board row and block ids read before the copy, the copy from this process's read-only mapping of
the producer's file (``process_vm_readv`` where a region is not mapped), the row read again after.
The copy is one native call (``memcpy_spans``: this thread and native helper threads, 2 MiB in
about half a core's ``memcpy`` time) that keeps the GIL: released, a busy Python thread of the
engine would take it and the engine would wait a switch interval to go on. With ``release_gil``
(a load of at least ``connector.engine_copy_release_gil_bytes``, off by default) the same call
lets the GIL go for the copy.

A load the board does not allow whole (not held yet, a push hold, a full board window, a producer
without a board), a copy that fails, or a row that changed: False, and the agent loads it as
before. A producer whose board cannot be read any more (it exited) is forgotten here, so its
file is not kept mapped.

``read_blocks`` (what the engine's loads call) derives what a shape's reads from one producer
need once (``PeerShape``: each piece's two region views, the largest block id each side may take)
and then, per load, checks its block ids against those bounds and the board, and copies piece by
piece, with no vectorised numpy work: a 1-block load's planning and checks cost a third of a
generic ``read`` of its descriptors (vectorised bounds checks, the board check per piece). A shape it cannot take
that way (a region not mapped, a piece that crosses a block boundary) is read through ``read``.

Threads: one caller at a time (the engine's connector holds its lock around every call).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvxfer.cache.tensors import MemoryRegion
from kvxfer.dataplane import BlockPieces, Descriptors, EngineReads, address_view
from kvxfer.transfer.hold_board import check_blocks, check_one_sided, row_unchanged
from kvxfer.transfer.planner import coalesce

from .mapped import memcpy_spans
from .memory import copy_from, iovecs
from .peer import Peer, Pieces, open_peer, pieces, unmap

logger = logging.getLogger(__name__)

MAX_SHAPES = 64  # PeerShapes kept per producer (then all are dropped and derived again)
NO_LIMIT = 1 << 62
# the generic read's vectorised work lets the GIL go on arrays over 500 elements (engine_loads.MAX_PIECES):
# a per-block shape that needs it (a region not mapped) over more pieces than this goes to the agent
GENERIC_MAX_PIECES = 500


@dataclass(frozen=True)
class PeerShape:
    """One ``BlockPieces`` read from one producer: per piece ``(local view, local unit, local
    stride, local inner, remote view, remote unit, remote stride, remote inner, length)``, and per
    unit the largest block id with which every piece of that unit stays inside its region. A
    per-block shape (``BlockPieces.per_block``) has unit 0 alone, and its limits hold for every
    block id of a load."""

    pieces: list[tuple[memoryview, int, int, int, memoryview, int, int, int, int]]
    local_limits: list[tuple[int, int]]  # (unit, largest block id)
    remote_limits: list[tuple[int, int]]
    per_block: bool = False
    addresses: list[tuple[int, int]] = field(default_factory=list)  # per piece: (local view's, remote view's)
    # a per-block shape whose every piece fills its block (length = both strides; a cache whose
    # layer tensors are [blocks, ...]): per piece (local view's address + inner, local stride),
    # the same for the remote side, and its length; ``span_addresses`` is then three list
    # comprehensions per load, not a generator's turn per span (1 block of 64: 49 -> 14-17 us)
    whole_local: list[tuple[int, int]] = field(default_factory=list)
    whole_remote: list[tuple[int, int]] = field(default_factory=list)
    whole_sizes: list[int] = field(default_factory=list)

    def in_bounds(self, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> bool:
        try:
            if self.per_block:
                if len(remote_blocks) == 0 or len(remote_blocks) != len(local_blocks):
                    return False
                r_top, l_top = max(remote_blocks), max(local_blocks)
                return (min(remote_blocks) >= 0 and min(local_blocks) >= 0
                        and all(r_top <= top for _, top in self.remote_limits)
                        and all(l_top <= top for _, top in self.local_limits))
            return (all(0 <= remote_blocks[u] <= top for u, top in self.remote_limits)
                    and all(0 <= local_blocks[u] <= top for u, top in self.local_limits))
        except (IndexError, TypeError, ValueError):  # fewer block ids than the shape's units, or not ids
            return False

    def held_blocks(self, remote_blocks: Sequence[int]) -> Sequence[int] | set[int]:
        """The producer's blocks this read touches (what its board must show held)."""
        return remote_blocks if self.per_block else {remote_blocks[u] for u, _ in self.remote_limits}

    def spans(self, remote_blocks: Sequence[int], local_blocks: Sequence[int]
              ) -> Iterator[tuple[int, int, int, int]]:
        """Each copy a read makes: (piece index, local offset, remote offset, bytes). A per-block
        shape's piece that fills its block (length = both strides) is one copy per run of block
        ids consecutive on both sides: a contiguous load's 64 pieces, not 64 a block."""
        if not self.per_block:
            for i, (_, lu, ls, li, _, ru, rs, ri, n) in enumerate(self.pieces):
                yield i, local_blocks[lu] * ls + li, remote_blocks[ru] * rs + ri, n
            return
        runs = block_runs(remote_blocks, local_blocks)
        for i, (_, _, ls, li, _, _, rs, ri, n) in enumerate(self.pieces):
            if n == ls == rs:
                for j, k in runs:
                    yield i, local_blocks[j] * ls + li, remote_blocks[j] * rs + ri, k * n
            else:
                for rb, lb in zip(remote_blocks, local_blocks, strict=True):
                    yield i, lb * ls + li, rb * rs + ri, n

    def span_addresses(self, remote_blocks: Sequence[int], local_blocks: Sequence[int]
                       ) -> tuple[list[int], list[int], list[int]]:
        """Each span's (local address, remote address, bytes) in this process, as three lists (in
        ``spans``' order; the sizes list may be the shape's own: read it, do not change it)."""
        if self.whole_sizes:
            runs = block_runs(remote_blocks, local_blocks)
            if len(runs) == 1:  # the general form below takes twice as long for one run (14 -> 32 us)
                lb, rb, k = local_blocks[0], remote_blocks[0], runs[0][1]
                return ([a + lb * s for a, s in self.whole_local], [a + rb * s for a, s in self.whole_remote],
                        self.whole_sizes if k == 1 else [n * k for n in self.whole_sizes])
            starts = [(local_blocks[j], remote_blocks[j], k) for j, k in runs]
            return ([a + lb * s for a, s in self.whole_local for lb, _, _ in starts],
                    [a + rb * s for a, s in self.whole_remote for _, rb, _ in starts],
                    [n * k for n in self.whole_sizes for _, _, k in starts])
        at = self.addresses
        dst: list[int] = []
        src: list[int] = []
        size: list[int] = []
        for i, lo, ro, n in self.spans(remote_blocks, local_blocks):
            dst.append(at[i][0] + lo)
            src.append(at[i][1] + ro)
            size.append(n)
        return dst, src, size

    def copy(self, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> None:
        """Every span a ``memcpy`` with the GIL kept, all in one call (``memcpy_spans``): a busy
        thread of the engine takes the GIL once, after the copy, not at every few spans."""
        memcpy_spans(*self.span_addresses(remote_blocks, local_blocks))

    def copy_released(self, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> None:
        """``copy`` with the GIL released during the copy (``connector.engine_copy_release_gil_bytes``)."""
        memcpy_spans(*self.span_addresses(remote_blocks, local_blocks), release_gil=True)


def block_runs(remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> list[tuple[int, int]]:
    """``(first index, count)`` of each run of block ids that are consecutive on both sides."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(remote_blocks)):
        if remote_blocks[i] != remote_blocks[i - 1] + 1 or local_blocks[i] != local_blocks[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    if len(remote_blocks):
        runs.append((start, len(remote_blocks) - start))
    return runs


def peer_shape(bp: BlockPieces, local: dict[int, memoryview], remote: dict[int, memoryview],
               remote_strides: dict[int, int]) -> PeerShape | None:
    """``bp`` against these region views (this side's, the producer's mapped ones); None when a
    region is not among them, a remote piece does not lie inside one block (the board's check
    of it then needs the generic read), or the plan's remote block stride is not the one the
    producer's cma address gives (``remote_strides``: what its board's block ids index)."""
    pieces = []
    lim: tuple[dict[int, int], dict[int, int]] = ({}, {})
    for rr, ru, rs, ri, lr, lu, ls, li, n in bp.pieces:
        lv, rv = local.get(lr), remote.get(rr)
        if lv is None or rv is None or n <= 0 or ri < 0 or li < 0 or rs <= 0 or ri + n > rs \
                or remote_strides.get(rr) != rs or (bp.per_block and (ru or lu)):
            return None
        for limits, unit, size, stride, inner in ((lim[0], lu, len(lv), ls, li), (lim[1], ru, len(rv), rs, ri)):
            top = NO_LIMIT if stride == 0 else (size - inner - n) // stride
            if stride < 0 or (stride == 0 and inner + n > size):
                return None
            limits[unit] = min(limits.get(unit, NO_LIMIT), top)
        pieces.append((lv, lu, ls, li, rv, ru, rs, ri, n))
    views = {id(p[0]): p[0] for p in pieces} | {id(p[4]): p[4] for p in pieces}
    at = {key: view_address(v) for key, v in views.items()}
    addresses = [(at[id(p[0])], at[id(p[4])]) for p in pieces]
    whole = bp.per_block and all(n == ls == rs for _, _, ls, _, _, _, rs, _, n in pieces)
    return PeerShape(pieces, list(lim[0].items()), list(lim[1].items()), bp.per_block, addresses,
                     [(a[0] + p[3], p[2]) for a, p in zip(addresses, pieces, strict=True)] if whole else [],
                     [(a[1] + p[7], p[6]) for a, p in zip(addresses, pieces, strict=True)] if whole else [],
                     [p[8] for p in pieces] if whole else [])


def view_address(view: memoryview) -> int:
    """Where a region view's bytes start in this process (read-only views too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class CmaEngineReads(EngineReads):
    """One-sided cma reads into the engine's own cache regions (see the module doc)."""

    def __init__(self, regions: Sequence[MemoryRegion], map_memory: bool) -> None:
        self.map_memory = map_memory
        ids = np.array(sorted(r.region_id for r in regions), dtype=np.int64)
        by_id = {r.region_id: r for r in regions}
        self._ids = ids
        self._sizes = np.array([by_id[int(i)].length for i in ids], dtype=np.int64)
        self._bases = np.array([by_id[int(i)].address for i in ids], dtype=np.int64)
        self._patterns: dict[bytes, Pieces] = {}
        self._peers: dict[str, Peer] = {}
        self._views = {r.region_id: address_view(r.address, r.length) for r in regions}  # this side's regions
        self._peer_views: dict[str, dict[int, memoryview]] = {}  # a peer's mapped regions, by region id
        # per peer: id(BlockPieces) -> (it, kept so that its id stays its own; its PeerShape or None)
        self._shapes: dict[str, dict[int, tuple[BlockPieces, PeerShape | None]]] = {}

    def connect(self, peer_id: str, address: bytes) -> None:
        peer, one_sided = open_peer(peer_id, address, b"", self.map_memory)
        if not one_sided:
            unmap(peer)
            raise ConnectionError(f"peer {peer_id} publishes no hold board (one_sided: false): every read of it "
                                  f"asks it for a grant")
        try:
            views = {} if peer.mapped is None else {
                rid: address_view(at, size).toreadonly()  # the mapping is PROT_READ: a write would fault, not raise
                for rid, at, size in zip(peer.ids.tolist(), peer.mapped.tolist(), peer.sizes.tolist(), strict=True)
                if at}
        except (ValueError, TypeError, OverflowError) as e:
            unmap(peer)
            raise ConnectionError(f"peer {peer_id}: its mapped regions cannot be viewed here ({e})") from None
        self.disconnect(peer_id)
        self._peers[peer_id] = peer
        self._peer_views[peer_id] = views

    def disconnect(self, peer_id: str) -> None:
        self._shapes.pop(peer_id, None)  # before the unmap: nothing may read through their views after
        self._peer_views.pop(peer_id, None)
        unmap(self._peers.pop(peer_id, None))

    def connected(self, peer_id: str) -> bool:
        return peer_id in self._peers

    def read(self, request_id: str, reads: Sequence[tuple[str, Descriptors]]) -> bool:
        allowed: list[tuple[str, Peer, Descriptors, np.ndarray, Pieces, np.ndarray]] = []
        for peer_id, d in reads:
            if not len(d):
                continue
            peer = self._peers.get(peer_id)
            if peer is None:
                return False
            local = pieces(self._patterns, self._ids, self._sizes, self._bases, None, d.local_region)
            if local is None or (d.local_offset + d.length > local.sizes).any():
                return False
            remote = pieces(peer.patterns, peer.ids, peer.sizes, peer.base, peer.strides, d.remote_region,
                            peer.mapped)
            if remote is None or remote.strides is None:
                return False
            end = d.remote_offset + d.length
            if (end > remote.sizes).any():
                return False
            row = check_one_sided(peer.board_read, peer.addr.board, request_id, d.remote_offset // remote.strides,
                                  (end - 1) // remote.strides)
            if row is None:
                self._forget_if_gone(peer_id, peer)
                return False
            allowed.append((peer_id, peer, d, local.bases, remote, row))
        for peer_id, peer, d, local_bases, remote, _ in allowed:
            try:
                if remote.mapped is not None:
                    copy_views(d, self._views, self._peer_views[peer_id])
                else:
                    iov = iovecs(d, local_bases, remote.bases)
                    copy_from(peer.addr.pid, iov[0], iov[1], keep_gil=True, nbytes=d.nbytes)
            except (OSError, ValueError, KeyError) as e:  # ruled out by the checks above; the agent loads it
                logger.debug("cma: request %s: the engine's copy failed (%s); the agent loads it", request_id, e)
                return False
        return self._rechecked([(peer_id, peer, row) for peer_id, peer, _, _, _, row in allowed])

    def read_blocks(self, request_id: str, reads: Sequence[tuple[str, BlockPieces, Sequence[int], Sequence[int]]],
                    release_gil: bool = False) -> bool:
        shaped: list[tuple[str, Peer, PeerShape, Sequence[int], Sequence[int]]] = []
        for peer_id, bp, rb, lb in reads:
            peer = self._peers.get(peer_id)
            if peer is None:
                return False
            shape = self._shape(peer_id, peer, bp)
            if shape is None:
                return self._read_generic(request_id, reads)
            shaped.append((peer_id, peer, shape, rb, lb))
        rows: list[tuple[str, Peer, np.ndarray]] = []
        for peer_id, peer, shape, rb, lb in shaped:
            if not shape.in_bounds(rb, lb):
                return False
            row = check_blocks(peer.board_read, peer.addr.board, request_id, shape.held_blocks(rb))
            if row is None:
                self._forget_if_gone(peer_id, peer)
                return False
            rows.append((peer_id, peer, row))
        for _, _, shape, rb, lb in shaped:
            try:
                if release_gil:
                    shape.copy_released(rb, lb)
                else:
                    shape.copy(rb, lb)
            except (OSError, ValueError, OverflowError, IndexError, TypeError) as e:  # ruled out; the agent loads it
                logger.debug("cma: request %s: the engine's copy failed (%s); the agent loads it", request_id, e)
                return False
        return self._rechecked(rows)

    def _rechecked(self, rows: list[tuple[str, Peer, np.ndarray]]) -> bool:
        """After the copy: every row unchanged, read from the producer's own memory (a mapping of
        its board outlives it). A producer that cannot be read any more is forgotten."""
        if all(row_unchanged(peer.peek, peer.addr.board, row) for _, peer, row in rows):
            return True
        for peer_id, peer, _ in rows:
            self._forget_if_gone(peer_id, peer)
        return False

    def _shape(self, peer_id: str, peer: Peer, bp: BlockPieces) -> PeerShape | None:
        shapes = self._shapes.setdefault(peer_id, {})
        hit = shapes.get(id(bp))
        if hit is None or hit[0] is not bp:
            if len(shapes) >= MAX_SHAPES:
                shapes.clear()
            strides = dict(zip(peer.ids.tolist(), peer.strides.tolist(), strict=True))
            hit = (bp, peer_shape(bp, self._views, self._peer_views.get(peer_id, {}), strides))
            shapes[id(bp)] = hit
        return hit[1]

    def _read_generic(self, request_id: str,
                      reads: Sequence[tuple[str, BlockPieces, Sequence[int], Sequence[int]]]) -> bool:
        """A shape ``read_blocks`` cannot take itself, through ``read`` (coalesced descriptors:
        fewer pieces for process_vm_readv); block ids the shape cannot take, or more than
        GENERIC_MAX_PIECES pieces (its numpy work would let the GIL go): False."""
        if sum(len(bp.pieces) * (len(rb) if bp.per_block else 1) for _, bp, rb, _ in reads) > GENERIC_MAX_PIECES:
            return False
        try:
            descs = [(peer_id, bp.descriptors(rb, lb)) for peer_id, bp, rb, lb in reads]
        except (IndexError, ValueError, TypeError, OverflowError):
            return False
        return self.read(request_id, [(peer_id, coalesce(d.remote_region, d.remote_offset, d.local_region,
                                                         d.local_offset, d.length)) for peer_id, d in descs])

    def _forget_if_gone(self, peer_id: str, peer: Peer) -> None:
        """The board did not allow a read: if the producer's memory cannot be read at all (it
        exited), unmap its files now rather than when its next generation is learnt."""
        try:
            peer.peek(peer.addr.board[0], 8)
        except OSError as e:
            logger.info("cma: producer %s (pid %d) cannot be read from the engine any more (%s); forgotten",
                        peer_id, peer.addr.pid, e)
            self.disconnect(peer_id)

    def close(self) -> None:
        for peer_id in list(self._peers):
            self.disconnect(peer_id)


def copy_views(d: Descriptors, local: dict[int, memoryview], remote: dict[int, memoryview]) -> None:
    """Copy ``d``'s pieces, each a slice assignment between region views: ``memcpy`` with the GIL
    kept and about 0.2 us of Python a piece, where a ``ctypes`` call costs 0.5 us and its
    arguments' conversion more (a 1-block load's 64 pieces: 250 us against 310-340). The caller
    checked every piece against both regions' sizes."""
    for lr, lo, rr, ro, n in zip(d.local_region.tolist(), d.local_offset.tolist(), d.remote_region.tolist(),
                                 d.remote_offset.tolist(), d.length.tolist(), strict=True):
        local[lr][lo : lo + n] = remote[rr][ro : ro + n]
