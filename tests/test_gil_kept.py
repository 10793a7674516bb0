"""What the engine's thread runs for a small cma load keeps the GIL, from planning to the recheck.

A busy Python thread of the engine that is handed the GIL keeps it a switch interval (5 ms): ten
times a 1-block load. numpy releases it in some calls whatever their size (``searchsorted``,
``sort``, ``add.reduceat``, ``arange`` of three or more, the copy of a broadcast view) and in
element-wise loops over more than
500 elements; the engine's path avoids the first and stays under the second (``MAX_PIECES``).
These tests count, with forced switches made 60 s apart, how often another thread got the GIL
while each step ran, on every cache layout the planner knows. A release of a few nanoseconds is
seen only now and then (the waiting thread must wake in time), so each step runs hundreds of
times (with a counting ``PyEval_SaveThread`` preloaded, every step here counted none). The
end-to-end check, through real agents: ``test_agent.py::test_start_load_and_the_polls_that_see_it_finish_keep_the_gil``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from kvxfer.connectors.cma.engine_reads import GENERIC_MAX_PIECES, CmaEngineReads, block_runs, copy_views, peer_shape
from kvxfer.connectors.cma.peer import pieces

from kvxfer.agent.engine_loads import MAX_PIECES
from kvxfer.cache import KVCache, KVCacheSpec, allocate_kv_cache
from kvxfer.dataplane import BlockPieces, Descriptors, address_view, join_adjacent, run_sums
from kvxfer.topology import SourceSlice
from kvxfer.transfer.hold_board import SMALL_CHECK, HoldBoard, blocks_held, check_blocks
from kvxfer.transfer.planner import DirectPlan, SideLayout


@contextmanager
def gil_turns() -> Iterator[list[int]]:
    """A thread that runs only when the GIL is free (forced switches made 60 s apart), started and
    running: its count of turns, ``[n]``, grows each time another thread lets the GIL go."""
    ticks, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0)  # gives the GIL back at once

    old = sys.getswitchinterval()
    t = threading.Thread(target=count, daemon=True)
    sys.setswitchinterval(60.0)
    try:
        t.start()
        deadline = time.monotonic() + 10
        while ticks[0] < 3:
            assert time.monotonic() < deadline, "the counting thread did not run"
            time.sleep(0.001)
        yield ticks
    finally:
        sys.setswitchinterval(old)
        stop.set()
        t.join(timeout=5)


def releases(fn: Callable[[], object], calls: int = 300) -> int:
    """How many times another Python thread ran while ``fn`` was called ``calls`` times."""
    with gil_turns() as ticks:
        before = ticks[0]
        for _ in range(calls):
            fn()
        return ticks[0] - before


def test_the_count_sees_a_call_that_releases_the_gil() -> None:
    assert releases(lambda: time.sleep(0), 50) > 0


def cache(layout: str, block_size: int, heads: int = 8, layers: int = 4, **kw: object) -> KVCache:
    spec = KVCacheSpec(num_layers=layers, num_kv_heads=heads, head_size=16, block_size=block_size, layout=layout,
                       **kw)  # type: ignore[arg-type]
    return allocate_kv_cache(spec, 64, huge_pages=False)


def side(layout: str, block_size: int, heads: int = 8, layers: int = 4, **kw: object) -> SideLayout:
    return SideLayout.from_cache(cache(layout, block_size, heads, layers, **kw))


def views(c: KVCache) -> dict[int, memoryview]:
    return {r.region_id: address_view(r.address, r.length) for r in c.regions}


def strides(c: KVCache) -> dict[int, int]:
    return {r.region_id: r.block_stride for r in c.regions}


def heads(remote: range, local: range) -> SourceSlice:
    return SourceSlice(remote_tp_rank=0, remote_pp_rank=0, remote_rank=0, layers=range(4), remote_heads=remote,
                       local_heads=local)


ALL, HALF = heads(range(8), range(8)), heads(range(4, 8), range(4))
SHAPES = [  # (remote, local, slice): every branch of DirectPlan.build, coalescing plans among them
    ("NHD", 16, {}, "NHD", 16, {}, ALL),
    ("NHD", 16, {}, "NHD", 32, {}, ALL),
    ("NHD", 16, {}, "NHD", 16, {}, HALF),
    ("HND", 16, {}, "HND", 16, {}, ALL),
    ("HND", 16, {"kv_split": False}, "HND", 16, {"kv_split": False}, ALL),
    ("HND", 16, {}, "HND", 32, {}, ALL),
    ("HND", 16, {"kv_fused": True}, "HND", 16, {"kv_fused": True}, HALF),
    ("NHD", 16, {"cross_layer": True}, "NHD", 16, {"cross_layer": True}, ALL),
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}{s[1]}-{s[3]}{s[4]}-{i}" for i, s in enumerate(SHAPES)])
@pytest.mark.parametrize("tokens", [(0, 16), (0, 40), (32, 64)], ids=["1block", "partial", "skip"])
def test_planning_a_small_load_keeps_the_gil(shape: tuple, tokens: tuple[int, int]) -> None:
    r_layout, r_bs, r_kw, l_layout, l_bs, l_kw, sl = shape
    if sl is HALF:
        remote, local = side(r_layout, r_bs, **r_kw), side(l_layout, l_bs, heads=4, **l_kw)
    else:
        remote, local = side(r_layout, r_bs, **r_kw), side(l_layout, l_bs, **l_kw)
    skip, num = tokens
    if skip % max(r_bs, l_bs) or (r_kw.get("kv_fused") and r_bs != l_bs):
        pytest.skip("not a load the planner takes")
    plan = DirectPlan.build(remote, local, sl, skip, num)
    assert 0 < len(plan.length) <= MAX_PIECES
    rb = np.arange(-(-num // r_bs), dtype=np.int64) * 3 + 1
    lb = np.arange(-(-num // l_bs), dtype=np.int64) * 5 + 2
    assert releases(lambda: DirectPlan.build(remote, local, sl, skip, num)) == 0
    assert releases(lambda: plan.descriptors(rb, lb)) == 0
    ends = np.cumsum(plan.length)  # every piece adjacent to the next: all join
    assert releases(lambda: join_adjacent(ends, ends, plan.length)) == 0
    ids, eight = np.array(range(8), dtype=np.int64), np.full(8, 1 << 30, dtype=np.int64)
    regions = plan.remote_region % 8
    assert releases(lambda: pieces({}, ids, eight, eight, eight, regions)) == 0  # a region pattern not seen before
    assert releases(plan.block_pieces) == 0  # the engine's loads make them once per shape


SHAPED = [s for s in SHAPES if not s[2].get("kv_fused")]


@pytest.mark.parametrize("shape", SHAPED, ids=[f"{s[0]}{s[1]}-{s[3]}{s[4]}-{i}" for i, s in enumerate(SHAPED)])
@pytest.mark.parametrize("tokens", [(0, 16), (0, 40), (32, 64)], ids=["1block", "partial", "skip"])
def test_a_shape_read_through_its_block_pieces_lands_as_the_plan_says_and_keeps_the_gil(
        shape: tuple, tokens: tuple[int, int]) -> None:
    """What the cma engine's read_blocks does per load (bounds, board check, copy piece by piece)
    moves the same bytes as the plan's descriptors, refuses block ids past a region, and keeps
    the GIL."""
    r_layout, r_bs, r_kw, l_layout, l_bs, l_kw, sl = shape
    heads = 4 if sl is HALF else 8
    rc, lc, ref = cache(r_layout, r_bs, **r_kw), cache(l_layout, l_bs, heads=heads, **l_kw), \
        cache(l_layout, l_bs, heads=heads, **l_kw)
    skip, num = tokens
    if skip % max(r_bs, l_bs):
        pytest.skip("not a load the planner takes")
    for i in range(len(rc.regions)):
        src = np.frombuffer(address_view(rc.regions[i].address, rc.regions[i].length), dtype=np.uint8)
        src[:] = np.random.default_rng(i).integers(0, 256, len(src), dtype=np.uint8)
    plan = DirectPlan.build(SideLayout.from_cache(rc), SideLayout.from_cache(lc), sl, skip, num)
    bp = BlockPieces(tuple(plan.block_pieces()), int(plan.length.sum()))
    shaped = peer_shape(bp, views(lc), views(rc), strides(rc))
    assert shaped is not None
    nr, nl = -(-num // r_bs), -(-num // l_bs)
    rb, lb = [(7 * j + 3) % 64 for j in range(nr)], [(11 * j + 5) % 64 for j in range(nl)]
    assert shaped.in_bounds(rb, lb)
    assert not shaped.in_bounds([64] * nr, lb) and not shaped.in_bounds(rb, [-1] * nl)
    assert not shaped.in_bounds(rb[:-1], lb), "too few block ids for the shape"
    copy_views(plan.descriptors(np.array(rb, dtype=np.int64), np.array(lb, dtype=np.int64)), views(ref), views(rc))
    shaped.copy(rb, lb)
    for a, b in zip(lc.regions, ref.regions, strict=True):
        assert bytes(address_view(a.address, a.length)) == bytes(address_view(b.address, b.length))
    board = HoldBoard(slots=64)
    board.publish("r", np.array(rb, dtype=np.int64))

    def read_at(address: int, nbytes: int) -> np.ndarray:
        return np.frombuffer(address_view(address, nbytes), dtype=np.uint8)

    blocks = {rb[u] for u, _ in shaped.remote_limits}
    assert check_blocks(read_at, (board.address, board.rows), "r", blocks) is not None
    assert releases(lambda: (shaped.in_bounds(rb, lb), shaped.copy(rb, lb),
                             check_blocks(read_at, (board.address, board.rows), "r", blocks)), 100) == 0
    board.close()


PER_BLOCK = [s for s in SHAPED if s[1] == s[4]]


@pytest.mark.parametrize("shape", PER_BLOCK, ids=[f"{s[0]}{s[1]}-{i}" for i, s in enumerate(PER_BLOCK)])
@pytest.mark.parametrize("tokens", [16, 9], ids=["whole", "partial"])
def test_a_per_block_shape_over_runs_of_block_ids_lands_as_its_descriptors_and_keeps_the_gil(
        shape: tuple, tokens: int) -> None:
    """A per-block shape (one block's pieces, read for every block of a load; a piece that fills
    its block copied once per run of consecutive ids) moves what its descriptors say, for ids in
    runs and not, and keeps the GIL."""
    r_layout, r_bs, r_kw, l_layout, l_bs, l_kw, sl = shape
    heads = 4 if sl is HALF else 8
    rc, lc, ref = cache(r_layout, r_bs, **r_kw), cache(l_layout, l_bs, heads=heads, **l_kw), \
        cache(l_layout, l_bs, heads=heads, **l_kw)
    for i in range(len(rc.regions)):
        src = np.frombuffer(address_view(rc.regions[i].address, rc.regions[i].length), dtype=np.uint8)
        src[:] = np.random.default_rng(i).integers(0, 256, len(src), dtype=np.uint8)
    plan = DirectPlan.build(SideLayout.from_cache(rc), SideLayout.from_cache(lc), sl, 0, tokens)
    bp = BlockPieces(tuple(plan.block_pieces()), int(plan.length.sum()), per_block=True)
    shaped = peer_shape(bp, views(lc), views(rc), strides(rc))
    assert shaped is not None and shaped.per_block
    rb, lb = [3, 4, 5, 9, 10, 20, 30, 31], [7, 8, 9, 10, 40, 41, 50, 51]  # runs of 3, 1, 1, 1, 2 on both sides
    assert block_runs(rb, lb) == [(0, 3), (3, 1), (4, 1), (5, 1), (6, 2)]
    assert shaped.in_bounds(rb, lb) and not shaped.in_bounds(rb, lb[:-1]) and not shaped.in_bounds([], [])
    assert not shaped.in_bounds([*rb[:-1], 64], lb) and not shaped.in_bounds(rb, [-1, *lb[1:]])
    assert set(shaped.held_blocks(rb)) == set(rb)
    d = bp.descriptors(rb, lb)
    assert int(d.length.sum()) == bp.bytes_for(len(rb)) == bp.nbytes * len(rb)
    copy_views(d, views(ref), views(rc))
    shaped.copy(rb, lb)
    for a, b in zip(lc.regions, ref.regions, strict=True):
        assert bytes(address_view(a.address, a.length)) == bytes(address_view(b.address, b.length))
    assert releases(lambda: (shaped.in_bounds(rb, lb), shaped.copy(rb, lb)), 100) == 0
    for r in lc.regions:  # the released copy (a large load's) moves the same bytes, into a cleared cache
        np.frombuffer(address_view(r.address, r.length), dtype=np.uint8)[:] = 0
    shaped.copy_released(rb, lb)
    for a, b in zip(lc.regions, ref.regions, strict=True):
        assert bytes(address_view(a.address, a.length)) == bytes(address_view(b.address, b.length))


def test_a_per_block_shape_takes_block_ids_as_an_array_and_its_generic_read_stays_small() -> None:
    """Block ids as a numpy array are bounds-checked as a list is; a per-block shape left to the
    generic read (a region not mapped) over more than GENERIC_MAX_PIECES pieces is refused (the
    agent's), so that read's numpy work never lets the GIL go."""
    rc, lc = cache("NHD", 16), cache("NHD", 16)
    plan = DirectPlan.build(SideLayout.from_cache(rc), SideLayout.from_cache(lc), ALL, 0, 16)
    bp = BlockPieces(tuple(plan.block_pieces()), int(plan.length.sum()), per_block=True)
    shaped = peer_shape(bp, views(lc), views(rc), strides(rc))
    assert shaped is not None
    assert shaped.in_bounds(np.array([1, 2]), np.array([3, 4])) and not shaped.in_bounds(np.array([1, 64]), [3, 4])
    reads = CmaEngineReads(lc.regions, map_memory=False)
    asked: list[int] = []  # the pieces the generic read was handed (its own read, recorded)
    reads.read = lambda rid, rs: bool(asked.append(sum(len(d) for _, d in rs)))  # type: ignore[method-assign]
    fits = GENERIC_MAX_PIECES // len(bp.pieces)
    assert not reads._read_generic("r", [("p", bp, list(range(fits)), list(range(fits)))])
    assert len(asked) == 1, "under the cap: read through the generic read"
    assert not reads._read_generic("r", [("p", bp, list(range(fits + 1)), list(range(fits + 1)))])
    assert len(asked) == 1, "over the cap: refused before any numpy work"
    reads.close()


def test_a_large_loads_copy_lets_the_gil_go_and_a_short_one_never_does() -> None:
    """``copy_released`` (a large load's) is one system call per 1024 pieces with the GIL released:
    another thread runs meanwhile; ``copy`` of the same shape never lets it run."""
    rc, lc = cache("NHD", 16, layers=32), cache("NHD", 16, layers=32)
    plan = DirectPlan.build(SideLayout.from_cache(rc), SideLayout.from_cache(lc), ALL, 0, 16)
    bp = BlockPieces(tuple(plan.block_pieces()), int(plan.length.sum()), per_block=True)
    shaped = peer_shape(bp, views(lc), views(rc), strides(rc))
    assert shaped is not None
    blocks = list(range(40))
    assert releases(lambda: shaped.copy_released(blocks, blocks), 20) > 0
    assert releases(lambda: shaped.copy(blocks, blocks), 20) == 0


def test_a_shape_with_a_region_not_mapped_or_a_piece_across_blocks_is_left_to_the_generic_read() -> None:
    rc, lc = cache("NHD", 16), cache("NHD", 16)
    plan = DirectPlan.build(SideLayout.from_cache(rc), SideLayout.from_cache(lc), ALL, 0, 16)
    bp = BlockPieces(tuple(plan.block_pieces()), int(plan.length.sum()))
    remote = views(rc)
    assert peer_shape(bp, views(lc), remote, strides(rc)) is not None
    other = {**strides(rc), rc.regions[1].region_id: rc.regions[1].block_stride * 2}
    assert peer_shape(bp, views(lc), remote, other) is None, "the board's block ids would index other blocks"
    remote.pop(rc.regions[0].region_id)
    assert peer_shape(bp, views(lc), remote, strides(rc)) is None
    across = BlockPieces(tuple((rr, ru, rs, ri + rs // 2, lr, lu, ls, li, n) for rr, ru, rs, ri, lr, lu, ls, li, n
                               in bp.pieces), bp.nbytes)  # each piece's second half lies in the next block
    assert peer_shape(across, views(lc), views(rc), strides(rc)) is None


def test_the_board_check_keeps_the_gil_and_answers_as_searchsorted() -> None:
    rng = np.random.default_rng(3)
    for _ in range(300):
        held = np.unique(rng.integers(0, 40, int(rng.integers(1, 20))))
        first = rng.integers(0, 40, int(rng.integers(1, 64)))
        last = first + rng.integers(0, 3, len(first))
        inside = held.searchsorted(last, side="right") - held.searchsorted(first, side="left")
        assert blocks_held(first, last, held) == bool((inside == last - first + 1).all())
    first = np.repeat(np.arange(8, dtype=np.int64), SMALL_CHECK // 8)
    held = np.arange(8, dtype=np.int64)
    assert blocks_held(first, first, held) and not blocks_held(first, first + 8, held)
    assert releases(lambda: blocks_held(first, first, held)) == 0
    long_hold = np.arange(5000, dtype=np.int64)  # a small read of a long prompt's hold
    a, b = first + 4000, first + 4001
    assert blocks_held(a, b, long_hold) and not blocks_held(first + 4999, first + 5000, long_hold)
    assert releases(lambda: blocks_held(a, b, long_hold)) == 0


def test_run_sums_are_reduceat() -> None:
    rng = np.random.default_rng(4)
    for n in (1, 2, 7, 64, 1000):
        values = rng.integers(1, 1 << 20, n)
        for _ in range(20):
            starts = np.flatnonzero(np.concatenate(([True], rng.random(n - 1) < 0.3)))
            assert np.array_equal(run_sums(values, starts), np.add.reduceat(values, starts))


def test_the_engines_copy_keeps_the_gil_and_moves_every_piece() -> None:
    """cma's engine copy (slice assignments between region views): each piece lands where its
    descriptor says, and no other thread runs meanwhile."""
    src = [np.random.default_rng(i).integers(0, 256, 1 << 20, dtype=np.uint8) for i in range(4)]
    dst = [np.zeros(1 << 20, dtype=np.uint8) for _ in range(4)]
    remote = {10 + i: memoryview(a) for i, a in enumerate(src)}
    local = {20 + i: memoryview(a) for i, a in enumerate(dst)}
    n = 64
    d = Descriptors(np.array([10 + i % 4 for i in range(n)], dtype=np.int64),
                    np.array([(i * 7919 % 31) * 32768 for i in range(n)], dtype=np.int64),
                    np.array([20 + (i * 3) % 4 for i in range(n)], dtype=np.int64),
                    np.array([i // 4 * 32768 for i in range(n)], dtype=np.int64), np.full(n, 32768, dtype=np.int64))
    assert releases(lambda: copy_views(d, local, remote), 100) == 0
    for rr, ro, lr, lo, ln in zip(*(a.tolist() for a in (d.remote_region, d.remote_offset, d.local_region,
                                                          d.local_offset, d.length)), strict=True):
        assert np.array_equal(dst[lr - 20][lo : lo + ln], src[rr - 10][ro : ro + ln])
