"""What a consumer rank reads for a load: the slices it needs of each producer rank, and the reads.

Pure planning over the topology (:mod:`kvxfer.topology`) and the descriptor planner
(:mod:`kvxfer.transfer.planner`); the one side effect is registering a staging area with the
plane when the two sides' layouts differ. What depends only on the producer's layout is
remembered (at most 64 layouts each), so a load of a known shape only adds its blocks' offsets.

Threads: one ``LoadPlanner`` per consumer, used only by whoever holds the consumer's turn lock
(its worker thread, or the fast path's caller); it has no lock of its own.
"""

from __future__ import annotations

import itertools

import numpy as np

from kvxfer.cache.tensors import MemoryRegion
from kvxfer.dataplane import DataPlane, Descriptors
from kvxfer.metrics import ConnectorMetrics
from kvxfer.protocol import KVTransferParams
from kvxfer.topology import ParallelLayout, SourceSlice, readers_of, remote_sources
from kvxfer.transfer.load import Load, Peer
from kvxfer.transfer.planner import SideLayout, concat, plan_staged

STAGING_REGION_BASE = 1 << 30  # staging areas' region ids start here (the cache's are below)


class LoadPlanner:
    """One consumer rank's load planning (module doc)."""

    def __init__(self, layout: ParallelLayout, tp_rank: int, pp_rank: int, local_side: SideLayout,
                 plane: DataPlane, stats: ConnectorMetrics) -> None:
        self.layout = layout
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.local_side = local_side
        self.plane = plane
        self.stats = stats
        self._staging_ids = itertools.count(STAGING_REGION_BASE)
        self._slices: dict[ParallelLayout, dict[int, list[SourceSlice]]] = {}
        self._unread: dict[ParallelLayout, frozenset[int]] = {}

    def slices_by_rank(self, params: KVTransferParams) -> dict[int, list[SourceSlice]]:
        """What this rank reads of each producer rank (remembered per producer layout: read only)."""
        by_rank = self._slices.get(params.layout)
        if by_rank is None:
            by_rank = {}
            for s in remote_sources(self.layout, self.tp_rank, self.pp_rank, params.layout):
                by_rank.setdefault(s.remote_rank, []).append(s)
            if len(self._slices) >= 64:
                self._slices.clear()
            self._slices[params.layout] = by_rank
        return by_rank

    def unread_ranks(self, layout: ParallelLayout) -> frozenset[int]:
        """The producer ranks of ``layout`` that no rank of this instance reads (remembered)."""
        unread = self._unread.get(layout)
        if unread is None:
            unread = frozenset(r for r in range(layout.tp_size * layout.pp_size)
                               if readers_of(layout, r % layout.tp_size, r // layout.tp_size, self.layout) == 0)
            if len(self._unread) >= 64:
                self._unread.clear()
            self._unread[layout] = unread
        return unread

    def plan_rank(self, load: Load, peer: Peer, sls: list[SourceSlice]) -> Descriptors:
        """Every read of a load from one producer rank (staging areas registered as needed)."""
        params = load.source
        remote_blocks = np.asarray(params.block_ids, dtype=np.int64)
        parts: list[Descriptors] = []
        for s in sls:
            if peer.side.layout == self.local_side.layout and not (
                    peer.side.head_factor == 2 and peer.side.block_size != self.local_side.block_size):
                shape = peer.direct_plan(self.local_side, s, load.skip_tokens, params.num_tokens)
                parts.append(shape.descriptors(remote_blocks, load.local_blocks_full))
            else:
                rid = next(self._staging_ids)
                d, plan = plan_staged(peer.side, s, remote_blocks, load.skip_tokens, params.num_tokens, rid)
                st = plan.staging
                self.plane.register([MemoryRegion(region_id=rid, address=st.data_ptr(), length=st.numel(),
                                                  block_stride=st.numel(), num_blocks=1,
                                                  layers=(0, 0), kind="KV")])
                load.staged.append((plan, peer))
                parts.append(d)
        descs = concat(parts)
        self.stats.planned(len(descs))
        load.nbytes += descs.nbytes
        return descs
