"""Topology against an independent brute-force oracle that enumerates every (layer, head)
each rank owns, for every layout pair in tp {1,2,4,8} x pp {1,2,4} x kv heads {1,2,4,8},
MLA on and off, even and uneven layer partitions; plus hand-written tables."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from kvxfer.config import InstanceConfig, ModelConfig, ParallelConfig
from kvxfer.topology import (
    ParallelLayout,
    block_size_ratio,
    layer_ranges,
    pp_ratio,
    readers_of,
    remote_sources,
    tp_ratio,
)

NUM_LAYERS = 7  # not a multiple of 2 or 4, so the even split's remainder rule is exercised
PARTITIONS = {1: [None], 2: [None, (5, 2), (1, 6)], 4: [None, (1, 2, 3, 1), (3, 2, 1, 1)]}


# ------------------------------------------------------------------ the oracle (written from the rules)

def oracle_layers(pp: int, stage: int, partition: tuple[int, ...] | None) -> set[int]:
    sizes = list(partition) if partition else [NUM_LAYERS // pp + (1 if s < NUM_LAYERS % pp else 0)
                                                for s in range(pp)]
    start = sum(sizes[:stage])
    return set(range(start, start + sizes[stage]))


def oracle_heads(tp: int, rank: int, heads: int, mla: bool) -> list[int]:
    if mla:
        return [0]
    if tp <= heads:
        per = heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // heads)]


def oracle_cells(lay: ParallelLayout, tp_rank: int, pp_rank: int) -> set[tuple[int, int]]:
    layers = oracle_layers(lay.pp_size, pp_rank, lay.layer_partition)
    heads = oracle_heads(lay.tp_size, tp_rank, lay.num_kv_heads, lay.mla)
    return {(layer, h) for layer in layers for h in heads}


def layouts() -> list[ParallelLayout]:
    out = []
    for tp, pp, heads, mla in itertools.product([1, 2, 4, 8], [1, 2, 4], [1, 2, 4, 8], [False, True]):
        if mla and heads != 1:
            continue
        for part in PARTITIONS[pp]:
            out.append(ParallelLayout(tp_size=tp, pp_size=pp, num_layers=NUM_LAYERS, num_kv_heads=heads,
                                      mla=mla, layer_partition=part))
    return out


LAYOUTS = layouts()
GROUPS: dict[tuple[int, bool], list[ParallelLayout]] = {}
for _lay in LAYOUTS:
    GROUPS.setdefault((_lay.num_kv_heads, _lay.mla), []).append(_lay)
PAIRS = [(a, b) for group in GROUPS.values() for a in group for b in group]


def check_pair(local: ParallelLayout, remote: ParallelLayout) -> None:
    reads: Counter[int] = Counter()  # remote rank -> local ranks reading it
    content_reads: Counter[tuple[int, int, int]] = Counter()  # (remote rank, layer, head) -> reads
    for lp, lt in itertools.product(range(local.pp_size), range(local.tp_size)):
        mine = oracle_cells(local, lt, lp)
        my_heads = oracle_heads(local.tp_size, lt, local.num_kv_heads, local.mla)
        got: Counter[tuple[int, int]] = Counter()
        sources = set()
        for s in remote_sources(local, lt, lp, remote):
            assert s.remote_rank == s.remote_pp_rank * remote.tp_size + s.remote_tp_rank
            assert len(s.remote_heads) == len(s.local_heads) > 0 and len(s.layers) > 0
            r_heads = oracle_heads(remote.tp_size, s.remote_tp_rank, remote.num_kv_heads, remote.mla)
            theirs = oracle_cells(remote, s.remote_tp_rank, s.remote_pp_rank)
            for layer in s.layers:
                for rh, lh in zip(s.remote_heads, s.local_heads, strict=True):
                    head = my_heads[lh]
                    assert r_heads[rh] == head, (local, remote, s)  # same global head both sides
                    assert (layer, head) in theirs  # read from a rank that owns it
                    got[(layer, head)] += 1
                    content_reads[(s.remote_rank, layer, head)] += 1
            sources.add(s.remote_rank)
        assert set(got) == mine and all(c == 1 for c in got.values()), (local, lt, lp, remote)
        for r in sources:
            reads[r] += 1
    # readers_of agrees with who actually reads, and with ownership where nothing is replicated
    for rp, rt in itertools.product(range(remote.pp_size), range(remote.tp_size)):
        r = rp * remote.tp_size + rt
        n = readers_of(remote, rt, rp, local)
        assert n == reads[r], (remote, rt, rp, local)
        if remote.tp_size <= remote.num_kv_heads and not remote.mla:
            theirs = oracle_cells(remote, rt, rp)
            owners = sum(1 for lp, lt in itertools.product(range(local.pp_size), range(local.tp_size))
                         if oracle_cells(local, lt, lp) & theirs)
            assert n == owners
    # replicas of the same content share the load: reader counts differ by at most one
    by_content: dict[tuple[int, int, int], list[int]] = {}
    for rp, rt in itertools.product(range(remote.pp_size), range(remote.tp_size)):
        r = rp * remote.tp_size + rt
        for layer, head in oracle_cells(remote, rt, rp):
            by_content.setdefault((rp, layer, head), []).append(content_reads[(r, layer, head)])
    for counts in by_content.values():
        assert max(counts) - min(counts) <= 1, (local, remote, counts)


@pytest.mark.parametrize("chunk", range(8))
def test_against_brute_force_oracle(chunk: int) -> None:
    pairs = PAIRS[chunk::8]
    assert pairs
    for local, remote in pairs:
        check_pair(local, remote)


def test_oracle_space_is_the_one_asked_for() -> None:
    assert {lay.tp_size for lay in LAYOUTS} == {1, 2, 4, 8}
    assert {lay.pp_size for lay in LAYOUTS} == {1, 2, 4}
    assert {lay.num_kv_heads for lay in LAYOUTS} == {1, 2, 4, 8}
    assert any(lay.mla for lay in LAYOUTS) and any(lay.layer_partition for lay in LAYOUTS)
    assert len(PAIRS) > 1000


# ------------------------------------------------------------------ hand-written tables

def lay(tp: int, pp: int = 1, heads: int = 8, mla: bool = False, part: tuple[int, ...] | None = None,
        layers: int = 4) -> ParallelLayout:
    return ParallelLayout(tp_size=tp, pp_size=pp, num_layers=layers, num_kv_heads=heads, mla=mla,
                          layer_partition=part)


def table(local: ParallelLayout, tp_rank: int, pp_rank: int, remote: ParallelLayout) -> list[tuple]:
    return [(s.remote_rank, (s.layers.start, s.layers.stop), (s.remote_heads.start, s.remote_heads.stop),
             (s.local_heads.start, s.local_heads.stop))
            for s in remote_sources(local, tp_rank, pp_rank, remote)]


def test_prefill_tp4_to_decode_tp2() -> None:
    d, p = lay(2), lay(4)
    assert table(d, 0, 0, p) == [(0, (0, 4), (0, 2), (0, 2)), (1, (0, 4), (0, 2), (2, 4))]
    assert table(d, 1, 0, p) == [(2, (0, 4), (0, 2), (0, 2)), (3, (0, 4), (0, 2), (2, 4))]
    assert [readers_of(p, r, 0, d) for r in range(4)] == [1, 1, 1, 1]
    assert tp_ratio(d, p) == -2 and tp_ratio(p, d) == 2


def test_decode_tp8_from_prefill_tp2() -> None:
    d, p = lay(8), lay(2)
    assert [table(d, r, 0, p) for r in (0, 3, 4, 7)] == [
        [(0, (0, 4), (0, 1), (0, 1))], [(0, (0, 4), (3, 4), (0, 1))],
        [(1, (0, 4), (0, 1), (0, 1))], [(1, (0, 4), (3, 4), (0, 1))],
    ]
    assert [readers_of(p, r, 0, d) for r in range(2)] == [4, 4]


def test_replicated_remote_heads_are_spread_and_unread_replicas_wait_for_nobody() -> None:
    d, p = lay(1, heads=2), lay(4, heads=2)  # prefill replicates each head on 2 ranks
    assert table(d, 0, 0, p) == [(0, (0, 4), (0, 1), (0, 1)), (2, (0, 4), (0, 1), (1, 2))]
    assert [readers_of(p, r, 0, d) for r in range(4)] == [1, 0, 1, 0]  # 0: free at once
    d2 = lay(4, heads=2)
    assert [table(d2, r, 0, p)[0][0] for r in range(4)] == [0, 1, 2, 3]
    d4 = lay(8, heads=2)  # 4 readers per head over 2 replicas: 2 each
    assert [readers_of(p, r, 0, d4) for r in range(4)] == [2, 2, 2, 2]


def test_mla_every_rank_holds_the_latent() -> None:
    p, d = lay(2, heads=1, mla=True), lay(4, heads=1, mla=True)
    assert [table(d, r, 0, p)[0][0] for r in range(4)] == [0, 1, 0, 1]
    assert [readers_of(p, r, 0, d) for r in range(2)] == [2, 2]
    assert [readers_of(d, r, 0, p) for r in range(4)] == [1, 1, 0, 0]


def test_pipeline_stages_both_ways_and_uneven() -> None:
    d, p = lay(1, pp=1), lay(1, pp=2)
    assert table(d, 0, 0, p) == [(0, (0, 2), (0, 8), (0, 8)), (1, (2, 4), (0, 8), (0, 8))]
    assert table(p, 0, 1, d) == [(0, (2, 4), (0, 8), (0, 8))]
    assert readers_of(d, 0, 0, p) == 2 and pp_ratio(d, p) == -2
    # 3 prefill stages feed 2 decode stages: layers intersect, sizes need not divide
    p3, d2 = lay(1, pp=3, layers=6), lay(1, pp=2, part=(4, 2), layers=6)
    assert table(d2, 0, 0, p3) == [(0, (0, 2), (0, 8), (0, 8)), (1, (2, 4), (0, 8), (0, 8))]
    assert table(d2, 0, 1, p3) == [(2, (4, 6), (0, 8), (0, 8))]
    assert layer_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]


def test_ratio_helpers_sign_convention() -> None:
    assert block_size_ratio(64, 16) == 4 and block_size_ratio(16, 64) == -4 and block_size_ratio(16, 16) == 1
    with pytest.raises(ValueError, match="local 16 and remote 24 do not divide"):
        block_size_ratio(16, 24)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(tp_size=3, num_kv_heads=8), "tp_size=3 must divide or be a multiple of num_kv_heads=8"),
        (dict(tp_size=0), "tp_size: expected an int >= 1, got 0"),
        (dict(pp_size=2, layer_partition=(1, 2)), r"sums to 3, expected num_layers=4"),
        (dict(pp_size=2, layer_partition=(4,)), "expected 2 entries"),
        (dict(mla=True, num_kv_heads=2), "expected 1 with mla"),
    ],
)
def test_bad_layouts_are_refused(kw: dict, match: str) -> None:
    base = dict(tp_size=1, pp_size=1, num_layers=4, num_kv_heads=8)
    base.update(kw)
    with pytest.raises(ValueError, match=match):
        ParallelLayout(**base)


def test_incompatible_pairs_name_both_sides() -> None:
    with pytest.raises(ValueError, match="local tp_size=2 and remote tp_size=3 do not divide"):
        remote_sources(lay(2, heads=6), 0, 0, lay(3, heads=6))
    with pytest.raises(ValueError, match="local num_layers=4, remote num_layers=8"):
        remote_sources(lay(1), 0, 0, lay(1, layers=8))
    with pytest.raises(ValueError, match="local num_kv_heads=8, remote num_kv_heads=4"):
        readers_of(lay(1, heads=4), 0, 0, lay(1))
    with pytest.raises(ValueError, match="tp_rank: expected 0 <= tp_rank < 2, got 2"):
        remote_sources(lay(2), 2, 0, lay(2))


def test_from_config() -> None:
    cfg = InstanceConfig(role="decode", engine_id="d",
                         model=ModelConfig(num_layers=6, num_kv_heads=2, num_heads=4),
                         parallel=ParallelConfig(tp=4, pp=2, layer_partition=[4, 2]))
    assert ParallelLayout.from_config(cfg) == lay(4, pp=2, heads=2, part=(4, 2), layers=6)
