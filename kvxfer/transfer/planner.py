"""Descriptor planning: which bytes of which remote region go where in which local region.

For one source slice (layers, remote heads, local heads from :mod:`kvxfer.topology`) and a
request's block ids on both sides, the planner emits ``(remote region, offset, local region,
offset, length)`` arrays with numpy, one vectorised pass per (layer, K/V), and coalesces
pieces that are contiguous on both sides (consecutive block ids become one descriptor).

Two kinds of plan:

- direct, when both sides use one layout: bytes go straight to their final place. The unit
  moved is the largest run contiguous on both sides: whole token runs of ``min(R, L)``
  tokens when every head moves (NHD), one token's head slice when only some heads move
  (NHD), or one head's token run (HND);
- staged, when the layouts differ: the remote blocks land whole in a staging buffer in the
  remote format, and :func:`finish_staged` rearranges them into the local blocks with
  :func:`kvxfer.repack.to_local` and :func:`kvxfer.repack.place_heads`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from kvxfer.cache.spec import QUANT_HEADER_BYTES, KVCacheSpec, torch_dtype
from kvxfer.cache.tensors import KVCache, MemoryRegion
from kvxfer.dataplane import BlockPiece, Descriptors, run_sums
from kvxfer.protocol import RegionInfo, SpecInfo
from kvxfer.repack import place_heads, to_local
from kvxfer.topology import SourceSlice

# The fused order kvxfer can re-cut between block sizes: vLLM's CPU vec/vec16 kernels keep, per
# block and head, K transposed ([head_size][block_size]) and then V token-major ([block_size][head_size])
FUSED_REPACKABLE = "vec"
SMALL_RANGE = 512  # int_range: ranges up to this long are built from Python's range (the GIL kept)


def spec_info(s: KVCacheSpec) -> SpecInfo:
    """The essentials of a rank's spec as sent in the handshake."""
    return SpecInfo(num_layers=s.num_layers, first_layer=s.first_layer, num_kv_heads=s.num_kv_heads,
                    head_size=s.head_size, block_size=s.block_size, dtype=s.dtype, layout=s.layout,
                    kv_split=s.kv_split, mla=s.mla, cross_layer=s.cross_layer, kv_fused=s.kv_fused,
                    fused_order=s.fused_order)


def region_info(r: MemoryRegion) -> RegionInfo:
    return RegionInfo(region_id=r.region_id, length=r.length, block_stride=r.block_stride, num_blocks=r.num_blocks,
                      layers=r.layers, kind=r.kind)


@dataclass(frozen=True)
class SideLayout:
    """What planning needs of one side: geometry and where each (layer, K/V) lives."""

    layout: str
    block_size: int
    num_heads: int  # heads this rank holds (a fused cache counts K and V of a head as two)
    row_bytes: int  # one token of one head: storage head size x itemsize
    kv_bytes: int  # one block of one layer's K (or V)
    num_kv: int
    first_layer: int
    num_layers: int
    cross_layer: bool
    kv_split: bool
    mla: bool
    regions: dict[int, tuple[int, int]]  # region id -> (block_stride, length)
    head_factor: int  # stored heads per model head: 2 for a fused cache (its K and V run one after the other)
    by_layer: dict[tuple[int, int], int]  # (layer, kv) -> region id
    fused_order: str = ""  # a fused cache's order inside a block (CacheConfig.fused_order)
    # locations() per layer range: planning a small request is mostly this table (about 60% of
    # a 1-block plan); written by the consumer's worker thread only
    _locations: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def locations(self, layers: range) -> np.ndarray:
        """int64 [len(layers) * num_kv, 3]: ``locate`` of every (layer, K/V) pair, layer-major (cached)."""
        key = (layers.start, layers.stop, layers.step)
        loc = self._locations.get(key)
        if loc is None:
            loc = np.array([self.locate(layer, kv) for layer in layers for kv in range(self.num_kv)],
                           dtype=np.int64).reshape(-1, 3)
            loc.flags.writeable = False
            self._locations[key] = loc
        return loc

    def locate(self, layer: int, kv: int) -> tuple[int, int, int]:
        """(region id, byte offset of this layer/kv inside a block, block stride)."""
        if self.cross_layer:
            rid = next(iter(self.regions))
            inner = ((layer - self.first_layer) * self.num_kv + kv) * self.kv_bytes
        elif self.num_kv == 1 or not self.kv_split:
            rid = self.by_layer[(layer, 0)]
            inner = kv * self.kv_bytes
        else:
            rid = self.by_layer[(layer, kv)]
            inner = 0
        return rid, inner, self.regions[rid][0]

    @classmethod
    def from_cache(cls, cache: KVCache) -> SideLayout:
        return cls.from_remote(spec_info(cache.spec), [region_info(r) for r in cache.regions])

    @classmethod
    def from_remote(cls, spec: SpecInfo, regions: list[RegionInfo]) -> SideLayout:
        storage = spec.head_size + QUANT_HEADER_BYTES if spec.dtype == "uint8" else spec.head_size
        return cls.build(spec, torch_dtype(spec.dtype).itemsize, storage, regions)

    @classmethod
    def build(cls, spec: SpecInfo, itemsize: int, storage_head_size: int,
              regions: list[RegionInfo]) -> SideLayout:
        by_layer: dict[tuple[int, int], int] = {}
        for r in regions:
            if r.kind == "V":
                by_layer[(r.layers[0], 1)] = r.region_id
            else:
                by_layer[(r.layers[0], 0)] = r.region_id
        row = storage_head_size * itemsize
        # a fused cache is planned as HND with K and V of each head as two heads of token rows
        factor = 2 if spec.kv_fused else 1
        heads = spec.num_kv_heads * factor
        return cls(
            layout=spec.layout, block_size=spec.block_size, num_heads=heads, row_bytes=row,
            kv_bytes=spec.block_size * heads * row, num_kv=1 if spec.mla or spec.kv_fused else 2, head_factor=factor,
            first_layer=spec.first_layer, num_layers=spec.num_layers, cross_layer=spec.cross_layer,
            kv_split=spec.kv_split, mla=spec.mla,
            regions={r.region_id: (r.block_stride, r.length) for r in regions}, by_layer=by_layer,
            fused_order=spec.fused_order if spec.kv_fused else "",
        )


def coalesce(rr: np.ndarray, ro: np.ndarray, lr: np.ndarray, lo: np.ndarray, ln: np.ndarray) -> Descriptors:
    """Merge neighbours that continue each other on both sides (same regions, adjacent bytes)."""
    if len(ln) == 0:
        return Descriptors.from_rows([])
    starts = np.ones(len(ln), dtype=bool)
    starts[1:] = ~((rr[1:] == rr[:-1]) & (lr[1:] == lr[:-1])
                   & (ro[1:] == ro[:-1] + ln[:-1]) & (lo[1:] == lo[:-1] + ln[:-1]))
    idx = np.flatnonzero(starts)
    lengths = run_sums(ln, idx)
    rr, ro, lr, lo = (np.ascontiguousarray(a[idx]) for a in (rr, ro, lr, lo))
    return Descriptors(rr, ro, lr, lo, lengths)


def concat(parts: list[Descriptors]) -> Descriptors:
    if not parts:
        return Descriptors.from_rows([])
    if len(parts) == 1:
        return parts[0]
    return Descriptors(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                         ("remote_region", "remote_offset", "local_region", "local_offset", "length")))


def check_alignment(skip_tokens: int, remote_bs: int, local_bs: int) -> None:
    unit = max(remote_bs, local_bs)
    if skip_tokens % unit:
        raise ValueError(
            f"num_cached_tokens={skip_tokens} must be a multiple of both block sizes "
            f"(remote {remote_bs}, local {local_bs}); pass the largest such prefix and fresh blocks for the rest"
        )


def int_range(*args: int) -> np.ndarray:
    """``np.arange(*args)`` as int64: from Python's ``range`` when short, as numpy's fills more
    than two elements with the GIL released (an engine's thread plans small loads, engine_loads.py)."""
    r = range(*args)
    return np.array(r, dtype=np.int64) if len(r) <= SMALL_RANGE else np.arange(*args, dtype=np.int64)


def plan_direct(remote: SideLayout, local: SideLayout, sl: SourceSlice, remote_blocks: np.ndarray,
                local_blocks: np.ndarray, skip_tokens: int, num_tokens: int) -> Descriptors:
    """Bytes straight into the local blocks; both sides use one layout."""
    return DirectPlan.build(remote, local, sl, skip_tokens, num_tokens).descriptors(remote_blocks, local_blocks)


@dataclass(frozen=True)
class DirectPlan:
    """What a direct plan is for any block ids: the pieces of (layer, K/V) pair x unit, with
    where each lies inside its block; ``descriptors`` adds the blocks' offsets. One depends only
    on the two layouts, the slice and the token range, so a consumer keeps it per producer and
    reuses it for every load of that shape (a 1-block plan then costs a few array operations)."""

    remote_unit: np.ndarray  # [units] index into the remote block ids
    local_unit: np.ndarray  # [units] index into the local block ids
    remote_stride: np.ndarray  # [pairs, 1] bytes per remote block
    local_stride: np.ndarray  # [pairs, 1]
    remote_inner: np.ndarray  # [pairs, units] offset inside the remote block
    local_inner: np.ndarray  # [pairs, units]
    remote_region: np.ndarray  # [pairs * units]
    local_region: np.ndarray  # [pairs * units]
    length: np.ndarray  # [pairs * units]
    # whether some neighbours share both regions (only those may coalesce, by their block ids):
    # False for a 1-block load of a cache with a region per layer and K/V, whose pieces then go
    # out as they are, with no coalescing pass (about half of a 1-block plan's numpy calls)
    mergeable: bool = True

    @classmethod
    def build(cls, remote: SideLayout, local: SideLayout, sl: SourceSlice, skip_tokens: int,
              num_tokens: int) -> DirectPlan:
        if remote.layout != local.layout:
            raise ValueError("plan_direct needs one layout on both sides")
        R, L = remote.block_size, local.block_size
        f = remote.head_factor
        if f != local.head_factor:
            raise ValueError("plan_direct: one side is fused (K and V per head), the other is not")
        if f == 2 and R != L:  # inside a block, vLLM's kernels order tokens their own way (tiled)
            raise ValueError(f"fused caches move whole blocks: block sizes must match (remote {R}, local {L})")
        nh = len(sl.remote_heads) * f
        r_head0, l_head0 = sl.remote_heads.start * f, sl.local_heads.start * f
        full = nh == remote.num_heads == local.num_heads
        rowb = remote.row_bytes
        if remote.layout == "NHD":
            if full:  # token runs of min(R, L) tokens, every head at once
                u = min(R, L)
                p = int_range(skip_tokens, num_tokens, u)
                n_tok = np.minimum(u, num_tokens - p)
                r_in = (p % R) * remote.num_heads * rowb
                l_in = (p % L) * local.num_heads * rowb
                length = n_tok * remote.num_heads * rowb
            else:  # one token's slice of heads
                p = int_range(skip_tokens, num_tokens)
                r_in = ((p % R) * remote.num_heads + r_head0) * rowb
                l_in = ((p % L) * local.num_heads + l_head0) * rowb
                length = np.full(len(p), nh * rowb, dtype=np.int64)
        elif full and R == L:  # HND, all heads, one block size: whole blocks, one piece each
            p = int_range(skip_tokens, num_tokens, R)  # skip_tokens is block-aligned
            block_bytes = R * nh * rowb
            length = np.full(len(p), block_bytes, dtype=np.int64)
            r_in = np.zeros(len(p), dtype=np.int64)
            l_in = np.zeros(len(p), dtype=np.int64)
            tail = num_tokens - p[-1] if len(p) else R
            if f == 1 and tail < R:  # a partial last block: each head's valid rows (a fused block moves whole)
                h = int_range(nh)
                p = np.concatenate([p[:-1], np.full(nh, p[-1], dtype=np.int64)])
                r_in = np.concatenate([r_in[:-1], h * R * rowb])
                l_in = np.concatenate([l_in[:-1], h * L * rowb])
                length = np.concatenate([length[:-1], np.full(nh, tail * rowb, dtype=np.int64)])
        else:  # HND: per head, token runs of min(R, L)
            u = min(R, L)
            p1 = int_range(skip_tokens, num_tokens, u)
            h = int_range(nh)
            hh, p = np.meshgrid(h, p1, indexing="ij")  # head-major, so runs of a head coalesce
            hh, p = hh.ravel(), p.ravel()
            # a fused block's rows are in its engine's own order: always whole blocks
            n_tok = np.full(len(p), u, dtype=np.int64) if f == 2 else np.minimum(u, num_tokens - p)
            r_in = ((r_head0 + hh) * R + p % R) * rowb
            l_in = ((l_head0 + hh) * L + p % L) * rowb
            length = n_tok * rowb
        # every (layer, K/V) pair at once: [pairs, 1] against [1, units]
        r_loc = remote.locations(sl.layers)  # [pairs, 3]: region, inner, stride
        l_loc = local.locations(sl.layers)
        # np.repeat and np.tile, not a copy of a broadcast view: that copy releases the GIL whatever
        # its size, which an engine's thread planning a small load must not (engine_loads.py)
        rr = np.repeat(r_loc[:, 0], len(p))
        lr = np.repeat(l_loc[:, 0], len(p))
        ln = np.tile(length.astype(np.int64, copy=False), len(r_loc))
        mergeable = bool(((rr[1:] == rr[:-1]) & (lr[1:] == lr[:-1])).any())
        for a in (rr, lr, ln):  # handed out as they are when nothing can merge: never written
            a.flags.writeable = False
        return cls(p // R, p // L, r_loc[:, 2:3], l_loc[:, 2:3], r_loc[:, 1:2] + r_in[None, :],
                   l_loc[:, 1:2] + l_in[None, :], rr, lr, ln, mergeable)

    def block_pieces(self) -> list[BlockPiece]:
        """The plan's pieces as ``BlockPieces`` tuples (uncoalesced: coalescing depends on the
        block ids), in ``descriptors``' order. In Python from ``tolist``s: an engine's thread makes
        them, and numpy's ``repeat``/``tile`` may let the GIL go."""
        ru, lu = self.remote_unit.tolist(), self.local_unit.tolist()
        rs, ls = self.remote_stride[:, 0].tolist(), self.local_stride[:, 0].tolist()
        ri, li = self.remote_inner.tolist(), self.local_inner.tolist()
        rr, lr, n = self.remote_region.tolist(), self.local_region.tolist(), self.length.tolist()
        units = len(ru)
        return [(rr[k], ru[u], rs[p], ri[p][u], lr[k], lu[u], ls[p], li[p][u], n[k])
                for p in range(len(rs)) for u in range(units) for k in (p * units + u,)]

    def descriptors(self, remote_blocks: np.ndarray, local_blocks: np.ndarray) -> Descriptors:
        """The plan for these block ids (int64; as many as the token range covers), coalesced."""
        ro = remote_blocks[self.remote_unit][None, :] * self.remote_stride + self.remote_inner
        lo = local_blocks[self.local_unit][None, :] * self.local_stride + self.local_inner
        if not self.mergeable:  # no two neighbours share their regions: coalescing would change nothing
            return Descriptors(self.remote_region, ro.ravel(), self.local_region, lo.ravel(), self.length)
        return coalesce(self.remote_region, ro.ravel(), self.local_region, lo.ravel(), self.length)


@dataclass
class StagedPlan:
    """Remote blocks staged whole, in the remote format, for a layout change."""

    staging: torch.Tensor  # uint8 [num (layer, kv) pairs, n_remote_blocks, remote kv_bytes]
    region_id: int
    pairs: list[tuple[int, int]]  # (layer, kv) in staging order
    slice: SourceSlice
    first_remote_block: int  # index into the request's remote block list
    n_remote_blocks: int


def plan_staged(remote: SideLayout, sl: SourceSlice, remote_blocks: np.ndarray, skip_tokens: int,
                num_tokens: int, staging_region_id: int) -> tuple[Descriptors, StagedPlan]:
    """Descriptors that copy whole remote blocks of the slice's layers into a staging tensor."""
    R = remote.block_size
    j0, j1 = skip_tokens // R, math.ceil(num_tokens / R)
    n = j1 - j0
    pairs = [(layer, kv) for layer in sl.layers for kv in range(remote.num_kv)]
    staging = torch.zeros((len(pairs), n, remote.kv_bytes), dtype=torch.uint8)
    rblk = remote_blocks[j0:j1]
    parts = []
    for i, (layer, kv) in enumerate(pairs):
        r_rid, r_inner, r_stride = remote.locate(layer, kv)
        ro = rblk * r_stride + r_inner
        lo = (i * n + np.arange(n, dtype=np.int64)) * remote.kv_bytes
        parts.append(coalesce(np.full(n, r_rid, dtype=np.int64), ro, np.full(n, staging_region_id, np.int64),
                              lo, np.full(n, remote.kv_bytes, dtype=np.int64)))
    return concat(parts), StagedPlan(staging, staging_region_id, pairs, sl, j0, n)


def fused_to_tokens(blocks: torch.Tensor, block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, heads, 2 * block_size * head_size]`` fused blocks in the "vec" order -> K and V as
    ``[heads, n * block_size, head_size]`` token-major (views where the order allows)."""
    n, h = blocks.shape[:2]
    kv = blocks.view(n, h, 2, block_size * head_size)
    k = kv[:, :, 0].view(n, h, head_size, block_size).transpose(2, 3)  # K is stored transposed
    v = kv[:, :, 1].view(n, h, block_size, head_size)
    return (k.permute(1, 0, 2, 3).reshape(h, n * block_size, head_size),
            v.permute(1, 0, 2, 3).reshape(h, n * block_size, head_size))


def tokens_to_fused(k: torch.Tensor, v: torch.Tensor, block_size: int) -> torch.Tensor:
    """K and V ``[heads, m * block_size, head_size]`` -> ``[m, heads, 2 * block_size * head_size]``
    fused blocks in the "vec" order (the inverse of :func:`fused_to_tokens`)."""
    h, t, d = k.shape
    m = t // block_size
    kb = k.view(h, m, block_size, d).permute(1, 0, 3, 2).reshape(m, h, block_size * d)  # transposed
    vb = v.view(h, m, block_size, d).permute(1, 0, 2, 3).reshape(m, h, block_size * d)
    return torch.stack([kb, vb], dim=2).reshape(m, h, 2 * block_size * d)


def _finish_fused(plan: StagedPlan, remote: SideLayout, cache: KVCache, local_blocks: np.ndarray,
                  skip_tokens: int, num_tokens: int) -> None:
    """Staged fused blocks ("vec" order) re-cut to the local block size, same order."""
    spec = cache.spec
    R, L, D = remote.block_size, spec.block_size, spec.head_size
    first_local = skip_tokens // L
    m = math.ceil((num_tokens - skip_tokens) / L)
    ids = torch.as_tensor(local_blocks[first_local : first_local + m], dtype=torch.int64)
    start = skip_tokens - plan.first_remote_block * R  # skip_tokens is aligned to both block sizes
    heads = plan.slice.remote_heads
    for i, (layer, _) in enumerate(plan.pairs):
        staged = plan.staging[i].view(spec.torch_dtype).view(plan.n_remote_blocks, remote.num_heads // 2, -1)
        k, v = fused_to_tokens(staged[:, heads.start : heads.stop], R, D)
        pad = m * L - (k.shape[1] - start)
        k, v = (torch.nn.functional.pad(x[:, start:], (0, 0, 0, pad)) if pad > 0 else x[:, start : start + m * L]
                for x in (k, v))
        blocks = tokens_to_fused(k, v, L)  # [m, len(heads), 2 * L * D]
        fused = cache.tensors[layer - spec.first_layer].view(cache.num_blocks, spec.num_kv_heads, -1)
        if len(heads) == spec.num_kv_heads:
            fused.index_copy_(0, ids, blocks)
        else:
            cur = fused.index_select(0, ids)
            cur[:, plan.slice.local_heads.start : plan.slice.local_heads.stop] = blocks
            fused.index_copy_(0, ids, cur)


def finish_staged(plan: StagedPlan, remote: SideLayout, cache: KVCache, local_blocks: np.ndarray,
                  skip_tokens: int, num_tokens: int) -> None:
    """Rearrange staged remote blocks into the local cache's blocks and head slice."""
    if remote.head_factor == 2:
        _finish_fused(plan, remote, cache, local_blocks, skip_tokens, num_tokens)
        return
    spec = cache.spec
    R, L = remote.block_size, spec.block_size
    shape_r = ((R, remote.num_heads, -1) if remote.layout == "NHD" else (remote.num_heads, R, -1))
    tokens = num_tokens - plan.first_remote_block * R  # positions from the first staged block
    first_local = skip_tokens // L
    m = math.ceil((num_tokens - skip_tokens) / L)
    ids = torch.as_tensor(local_blocks[first_local : first_local + m], dtype=torch.int64)
    head_dim = 2 if spec.layout == "NHD" else 1
    full_heads = len(plan.slice.local_heads) == spec.num_kv_heads
    for i, (layer, kv) in enumerate(plan.pairs):
        staged = plan.staging[i].view(spec.torch_dtype).view(plan.n_remote_blocks, *shape_r)
        blocks = to_local(staged, remote_layout=remote.layout, local_layout=spec.layout, remote_block_size=R,
                          local_block_size=L, num_tokens=tokens)
        blocks = blocks.narrow(head_dim, plan.slice.remote_heads.start, len(plan.slice.remote_heads))
        k, v = cache.layer_kv(layer)
        view = k if kv == 0 else v
        assert view is not None
        if full_heads:
            view.index_copy_(0, ids, blocks.contiguous())
        else:
            cur = view.index_select(0, ids)
            place_heads(cur, blocks.contiguous(), layout=spec.layout, local_heads=plan.slice.local_heads)
            view.index_copy_(0, ids, cur)
