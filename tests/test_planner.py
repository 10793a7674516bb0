"""Descriptor planning: how many pieces a request becomes (per-piece cost dominates small pieces)."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.cache import KVCacheSpec, allocate_kv_cache
from kvxfer.topology import SourceSlice
from kvxfer.transfer.planner import SideLayout, plan_direct


def side(**kw: object) -> SideLayout:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_size=8, block_size=16, layout="HND",
                       **kw)  # type: ignore[arg-type]
    return SideLayout.from_cache(allocate_kv_cache(spec, 32, huge_pages=False))


ALL_HEADS = SourceSlice(remote_tp_rank=0, remote_pp_rank=0, remote_rank=0, layers=range(2), remote_heads=range(4),
                        local_heads=range(4))


@pytest.mark.parametrize("fused", [False, True])
def test_hnd_with_every_head_moves_whole_blocks(fused: bool) -> None:
    s = side(kv_fused=fused)
    sl = ALL_HEADS
    remote = np.array([3, 9, 4, 20])  # no two neighbours, so nothing coalesces across blocks
    local = np.array([7, 1, 12, 30])
    d = plan_direct(s, s, sl, remote, local, 0, 64)  # four full blocks
    parts = 1 if fused else 2  # K|V in one tensor, or K and V apart
    assert len(d) == 2 * parts * 4, "one piece per (layer, K/V, block)"
    assert (d.length == s.kv_bytes).all()
    assert np.array_equal(np.sort(d.remote_offset % s.regions[0][0]), np.zeros(len(d)))


def test_a_partial_last_block_moves_each_heads_valid_rows_unless_fused() -> None:
    sl = ALL_HEADS
    blocks = np.array([3, 9])
    plain = plan_direct(side(), side(), sl, blocks, blocks + 10, 0, 20)  # 16 + 4 tokens
    assert sorted(set(plain.length.tolist())) == [4 * 8 * 4, side().kv_bytes]  # 4 rows of 8 fp32 per head
    fused = plan_direct(side(kv_fused=True), side(kv_fused=True), sl, blocks, blocks + 10, 0, 20)
    assert (fused.length == side(kv_fused=True).kv_bytes).all(), "a fused block's rows are tiled: it moves whole"
