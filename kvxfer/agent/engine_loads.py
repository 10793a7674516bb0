"""Small loads copied by the engine's own thread, beside its transfer agent.

Through an agent a 1-block load crosses two processes and back (engine -> agent -> engine), each
woken cold: 0.6-0.8 ms on the test machine where NIXL, whose caller copies a CMA read itself,
takes 0.25. A data plane that reads one-sided (``DataPlane.engine_reads``: cma) lets the engine's
thread copy a small load in ``start_load`` instead, from producer ranks its agent has handshaken
(the agent passes on each handshake's answer with its events): planned here from that answer, the
way the consumer plans (:class:`kvxfer.transfer.load.Peer`'s direct plans), checked against the
producer's hold board by the plane, copied, and reported at the next ``poll``. The agent is then
told (``EngineCopied``, one-way) and sends the done notices, as for a load of its own.

Anything else goes to the agent, which is always right: a load larger than
``connector.engine_copy_bytes`` or of more than ``MAX_PIECES`` pieces, a producer not handshaken
yet or of another generation, layouts that need a repack (staging), a hold not on the board, a
failed copy or recheck.

The GIL is never released here, from planning to the recheck (but in a copy of at least
``connector.engine_copy_release_gil_bytes``, off by default): a busy Python thread of the engine
given it keeps it a switch interval (5 ms), ten times a load. So no numpy call that releases it
whatever the size (``searchsorted``, ``sort``, ``add.reduceat``, ``arange`` of three or more, the
copy of a broadcast view: the planner and the board check avoid them), and no array over numpy's
threshold per load. Shapes are made once and kept: from a producer of this engine's block size
(block ``i`` of the prompt is block ``i`` on both sides) a per-block shape for whole blocks and
one per partial block's token count (``BlockPieces.per_block``), whatever the prompt's length, so
their rare builds may be larger (``MAX_BLOCK_PIECES`` a block); from one of another block size a
shape of the whole load, made per prompt length, and over ``MAX_PIECES`` pieces passed on. A
per-block piece that fills its block is copied once per run of consecutive block ids: a contiguous
16 MiB load is 64 copies, not 512.

Threads: the engine's; the owning ``EngineCopies`` serialises calls (its ``_copy_lock``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvxfer.dataplane import BlockPieces, EngineReads
from kvxfer.protocol import HandshakeResponse, KVTransferParams
from kvxfer.topology import ParallelLayout, SourceSlice, remote_sources
from kvxfer.transfer.load import Peer
from kvxfer.transfer.planner import DirectPlan, SideLayout

logger = logging.getLogger(__name__)

MAX_PEERS = 256  # producer ranks kept (the oldest is forgotten, its files unmapped)
MAX_LAYOUTS = 64  # producer layouts whose slices are kept
# numpy releases the GIL in element-wise loops over more than 500 elements (NPY_BEGIN_THREADS_THRESHOLDED),
# and a busy thread of the engine given it keeps it a switch interval (5 ms): loads of more pieces
# than this go to the agent, so every array the engine's copy makes stays under that
MAX_PIECES = 500
# a producer of this engine's block size is read with per-block shapes, made once per producer, layout
# and tokens in the block (not per prompt length), so their plans may be larger: the bound here is the
# Python work per block of a load (about 0.3 us a piece; an 8-head cache's partial block is 512)
MAX_BLOCK_PIECES = 4096
MAX_SHAPES = 256  # load shapes whose pieces are kept (then all are dropped and made again)


class EngineLoads:
    """The engine's own small loads (see the module doc)."""

    def __init__(self, reads: EngineReads, layout: ParallelLayout, tp_rank: int, pp_rank: int,
                 local_side: SideLayout, max_bytes: int, bytes_per_block: int,
                 release_gil_bytes: int | None = None) -> None:
        self.reads = reads
        # copies of this many bytes or more let the GIL go (connector.engine_copy_release_gil_bytes;
        # None: never; the connector made the engine's switch interval short first): kept through a
        # copy longer than the interval, a busy thread of the engine would take the GIL mid-copy and
        # the engine wait an interval to go on
        self.release_gil_bytes = release_gil_bytes
        self.layout = layout
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.local_side = local_side
        self.max_bytes = max_bytes
        self.bytes_per_block = bytes_per_block
        self._peers: OrderedDict[tuple[str, int], Peer] = OrderedDict()  # (engine, rank) -> its latest generation
        self._slices: dict[ParallelLayout, dict[int, list[SourceSlice]]] = {}
        # (producer peer id, its layout, skip tokens, tokens) -> that load's pieces; None: the agent's
        self._shapes: dict[tuple[str, ParallelLayout, int, int], BlockPieces | None] = {}
        self.copied = 0  # loads copied here
        self.passed = 0  # small loads passed to the agent

    def learn(self, engine_id: str, meta: HandshakeResponse) -> None:
        """The agent handshook with producer ``engine_id`` rank ``meta.rank``: read it here from now
        on where the plane can (a producer it cannot read, or one whose layout needs a repack, is
        left to the agent)."""
        key = (engine_id, meta.rank)
        old = self._peers.pop(key, None)
        if old is not None:
            self.reads.disconnect(old.peer_id)
        side = SideLayout.from_remote(meta.spec, meta.regions)
        if not self._direct(side):
            return
        peer_id = f"{engine_id}/{meta.rank}/{meta.generation}"
        try:
            self.reads.connect(peer_id, meta.data_address)
        except ConnectionError as e:
            logger.info("producer %s rank %d is loaded through the transfer agent only: %s", engine_id, meta.rank, e)
            return
        self._peers[key] = Peer(meta, b"", peer_id, side, "", 0)
        while len(self._peers) > MAX_PEERS:
            _, oldest = self._peers.popitem(last=False)
            self.reads.disconnect(oldest.peer_id)

    def fits(self, local_blocks: np.ndarray, skip_tokens: int) -> bool:
        """Whether a load of these blocks is small enough to be copied here (``max_bytes``)."""
        return (len(local_blocks) - skip_tokens // self.local_side.block_size) * self.bytes_per_block <= self.max_bytes

    def load(self, params: KVTransferParams, local_blocks: np.ndarray, skip_tokens: int) -> tuple[int, float] | None:
        """Copy a checked load (``local_blocks``: one id per local block of the prompt) now: its
        bytes and when its reads were planned; None: the agent must load it."""
        if not self.fits(local_blocks, skip_tokens):
            return None
        ranks = {r.rank: r for r in params.ranks}
        local = local_blocks.tolist()
        reads: list[tuple[str, BlockPieces, Sequence[int], Sequence[int]]] = []
        whole = 0  # pieces of whole-load shapes (per-block shapes have a cap of their own)
        for rr, sls in self._slices_by_rank(params.layout).items():
            r = ranks.get(rr)
            peer = self._peers.get((params.engine_id, rr))
            if r is None or peer is None or peer.meta.generation != r.generation:
                self.passed += 1
                return None
            if peer.side.block_size == self.local_side.block_size:
                rank_reads = self._per_block(peer, params.layout, sls, skip_tokens, params.num_tokens,
                                             params.block_ids, local)
            else:
                shape = self._pieces(peer, params.layout, sls, skip_tokens, params.num_tokens)
                rank_reads = None if shape is None else [(peer.peer_id, shape, params.block_ids, local)]
                whole += 0 if shape is None else len(shape.pieces)
            if not rank_reads or whole > MAX_PIECES:  # several producer ranks: the cap is the load's
                self.passed += 1
                return None
            reads.extend(rank_reads)
        nbytes = sum(bp.bytes_for(len(rb)) for _, bp, rb, _ in reads)
        release = self.release_gil_bytes is not None and nbytes >= self.release_gil_bytes
        planned = time.monotonic()
        if not self.reads.read_blocks(params.request_id, reads, release_gil=release):
            self.passed += 1
            return None
        self.copied += 1
        return nbytes, planned

    def _per_block(self, peer: Peer, layout: ParallelLayout, sls: list[SourceSlice], skip_tokens: int,
                   num_tokens: int, remote_blocks: Sequence[int], local: Sequence[int]
                   ) -> list[tuple[str, BlockPieces, Sequence[int], Sequence[int]]] | None:
        """A load from a producer of this engine's block size, as per-block shapes: one for its
        whole blocks, one for a partial last block (block ``i`` of the prompt is block ``i`` on
        both sides). None: the agent loads it."""
        size = self.local_side.block_size
        first, full, tail = skip_tokens // size, num_tokens // size, num_tokens % size
        reads: list[tuple[str, BlockPieces, Sequence[int], Sequence[int]]] = []
        for tokens, lo, hi in ((size, first, full), (tail, full, full + 1)):
            if tokens == 0 or hi <= lo:
                continue
            shape = self._block_shape(peer, layout, sls, tokens)
            if shape is None:
                return None
            reads.append((peer.peer_id, shape, remote_blocks[lo:hi], local[lo:hi]))
        return reads or None

    def _block_shape(self, peer: Peer, layout: ParallelLayout, sls: list[SourceSlice], tokens: int
                     ) -> BlockPieces | None:
        """The per-block pieces of a block's first ``tokens`` tokens from ``peer`` (made once per
        producer, layout and token count, then kept: at most a block size of them per producer);
        None: the agent loads it (a shape the planner refuses, or over MAX_BLOCK_PIECES pieces)."""
        key = (peer.peer_id, layout, -1, tokens)  # skip -1: a per-block shape, never a load's own
        if key in self._shapes:
            return self._shapes[key]
        try:
            plans = [DirectPlan.build(peer.side, self.local_side, s, 0, tokens) for s in sls]
        except ValueError:
            shape = None
        else:
            pieces = [p for plan in plans for p in plan.block_pieces()] \
                if sum(len(plan.length) for plan in plans) <= MAX_BLOCK_PIECES else []
            shape = BlockPieces(tuple(pieces), sum(p[-1] for p in pieces), per_block=True) if pieces else None
        if len(self._shapes) >= MAX_SHAPES:
            self._shapes.clear()
        self._shapes[key] = shape
        return shape

    def _pieces(self, peer: Peer, layout: ParallelLayout, sls: list[SourceSlice], skip_tokens: int,
                num_tokens: int) -> BlockPieces | None:
        """The pieces of a load of this shape from ``peer`` (made once per shape, then kept); None:
        the agent loads it (a shape the planner refuses, which the agent then names, or more than
        MAX_PIECES pieces)."""
        key = (peer.peer_id, layout, skip_tokens, num_tokens)
        if key in self._shapes:
            return self._shapes[key]
        try:
            plans = [DirectPlan.build(peer.side, self.local_side, s, skip_tokens, num_tokens) for s in sls]
        except ValueError:
            shape = None
        else:
            pieces = [p for plan in plans for p in plan.block_pieces()] \
                if sum(len(plan.length) for plan in plans) <= MAX_PIECES else []
            shape = BlockPieces(tuple(pieces), sum(p[-1] for p in pieces)) if pieces else None
        if len(self._shapes) >= MAX_SHAPES:
            self._shapes.clear()
        self._shapes[key] = shape
        return shape

    @property
    def producers(self) -> int:
        """Producer ranks this engine may read now (its ``EngineReads`` forgets one it cannot read)."""
        return sum(1 for p in self._peers.values() if self.reads.connected(p.peer_id))

    def close(self) -> None:
        self._peers.clear()
        self.reads.close()

    def _direct(self, side: SideLayout) -> bool:
        """Whether loads from a producer of this layout are direct reads (no staging, no repack):
        the condition of :meth:`kvxfer.transfer.load_planner.LoadPlanner.plan_rank`."""
        local = self.local_side
        return side.layout == local.layout and not (side.head_factor == 2 and side.block_size != local.block_size)

    def _slices_by_rank(self, layout: ParallelLayout) -> dict[int, list[SourceSlice]]:
        by_rank = self._slices.get(layout)
        if by_rank is None:
            by_rank = {}
            for s in remote_sources(self.layout, self.tp_rank, self.pp_rank, layout):
                by_rank.setdefault(s.remote_rank, []).append(s)
            if len(self._slices) >= MAX_LAYOUTS:
                self._slices.clear()
            self._slices[layout] = by_rank
        return by_rank
