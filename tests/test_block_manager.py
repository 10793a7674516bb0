"""Block pool and block manager: unit tests, and a hypothesis state machine that checks
the pool's invariants after every step of random allocate/reserve/commit/discard/free."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvxfer.cache.block_manager import Admission, BlockManager, BlockState
from kvxfer.cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvxfer.cache.prefix_hash import prefix_hashes
from kvxfer.config import CacheConfig

BS = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# ------------------------------------------------------------------ free queue

def test_free_queue_removes_from_the_middle_and_keeps_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    q.appendleft(blocks[2])
    q.remove(blocks[4])
    q.append(blocks[4])
    assert [b.block_id for b in q] == [2, 0, 1, 3, 4]
    assert q.popleft().block_id == 2
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[2])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[0])
    for _ in range(4):
        q.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()


# ------------------------------------------------------------------ pool

def test_pool_refcounts_and_double_free_changes_nothing() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert [b.ref_cnt for b in a] == [1, 1] and pool.num_free_blocks == 2
    pool.touch(a[:1])
    assert a[0].ref_cnt == 2
    pool.free(a)
    assert a[0].ref_cnt == 1 and a[1].ref_cnt == 0 and pool.num_free_blocks == 3
    with pytest.raises(ValueError, match="freed more times"):
        pool.free([a[0], a[0]])
    assert a[0].ref_cnt == 1 and pool.num_free_blocks == 3
    with pytest.raises(ValueError, match="only 3 free"):
        pool.allocate(4)
    assert pool.num_free_blocks == 3


def test_pool_evicts_lru_and_prefers_uncached_blocks() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks[:3]):
        assert pool.cache_block(b, bytes([i]) * 16)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[3]])  # uncached: reused first
    pool.free([blocks[2]])
    got = pool.allocate(1)
    assert got[0].block_id == 3 and pool.num_evictions == 0
    got = pool.allocate(2)
    assert [b.block_id for b in got] == [1, 0]  # least recently freed first
    assert pool.get_cached_block(bytes([1]) * 16) is None
    assert pool.get_cached_block(bytes([2]) * 16) is blocks[2]


# ------------------------------------------------------------------ manager

def test_prefix_hit_shares_blocks_and_partial_tail_is_not_hashed() -> None:
    bm = BlockManager(16, BS, watermark=0.0)
    a = bm.allocate("a", tokens(10))
    assert len(a.blocks) == 3 and a.num_cached_tokens == 0
    assert bm.commit("a") == a.block_ids[:2]
    b = bm.allocate("b", tokens(9))
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert b.new_block_ids == b.block_ids[2:] and b.block_ids[2] != a.block_ids[2]
    assert bm.pool.blocks[a.block_ids[0]].ref_cnt == 2
    c = bm.allocate("c", tokens(9), max_cached_tokens=7)
    assert c.num_cached_tokens == 4


def test_reserve_commit_discard_and_expiry() -> None:
    now = [100.0]
    bm = BlockManager(8, BS, watermark=0.0, clock=lambda: now[0])
    r = bm.reserve("r", tokens(8), timeout_s=5)
    assert r.state is BlockState.PENDING and bm.num_free_blocks == 6
    # not valid yet: a request with the same prompt gets no prefix hit
    assert bm.prefix_hits(tokens(8)) == []
    invalid = bm.discard("r")
    assert invalid == r.block_ids and bm.num_free_blocks == 8 and "r" not in bm.requests
    with pytest.raises(KeyError, match="holds no blocks"):
        bm.discard("r")
    s = bm.reserve("s", tokens(8), timeout_s=5)
    bm.reserve("t", tokens(4, 50), timeout_s=10)
    now[0] = 106.0
    assert bm.expire() == {"s": s.block_ids}
    assert set(bm.requests) == {"t"}
    bm.commit("t")
    now[0] = 1000.0
    assert bm.expire() == {}
    assert len(bm.prefix_hits(tokens(4, 50))) == 1
    with pytest.raises(ValueError, match="only a pending reservation"):
        bm.discard("t")


def test_expire_returns_the_invalid_ids() -> None:
    now = [0.0]
    bm = BlockManager(8, BS, watermark=0.0, clock=lambda: now[0])
    s = bm.reserve("s", tokens(8), timeout_s=1)
    now[0] = 1.0
    assert bm.expire() == {"s": s.block_ids}
    assert bm.num_free_blocks == 8


def test_partial_prefix_hit_on_reserve_moves_only_the_suffix() -> None:
    bm = BlockManager(16, BS, watermark=0.0)
    bm.allocate("local", tokens(8))
    bm.commit("local")
    r = bm.reserve("remote", tokens(14), timeout_s=1)
    assert r.num_cached_tokens == 8 and len(r.new_block_ids) == 2
    assert bm.discard("remote") == r.new_block_ids
    # the shared prefix survives the failed transfer
    assert len(bm.prefix_hits(tokens(8))) == 2


def test_admission_watermark() -> None:
    bm = BlockManager(100, BS, watermark=0.1)  # 10 blocks held back
    assert bm.admit(tokens(91 * BS)) is Admission.NEVER
    assert bm.admit(tokens(90 * BS)) is Admission.OK
    bm.allocate("x", tokens(50 * BS))
    assert bm.admit(tokens(41 * BS)) is Admission.LATER
    assert bm.admit(tokens(40 * BS)) is Admission.OK


def test_bad_calls_change_nothing() -> None:
    bm = BlockManager(4, BS, watermark=0.0)
    bm.allocate("a", tokens(8))
    free_before = bm.num_free_blocks
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate("a", tokens(4))
    with pytest.raises(ValueError, match="needs 3 free blocks, 2 free"):
        bm.allocate("b", tokens(12, 100))
    with pytest.raises(ValueError, match="no tokens"):
        bm.allocate("c", [])
    with pytest.raises(ValueError, match="needs 3 more blocks"):
        bm.append_tokens("a", tokens(12))
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        bm.reserve("d", tokens(4), timeout_s=0)
    assert bm.num_free_blocks == free_before and set(bm.requests) == {"a"}
    with pytest.raises(ValueError, match="power of two"):
        BlockManager(4, 3)


def test_append_tokens_hashes_blocks_as_they_fill() -> None:
    bm = BlockManager(8, BS, watermark=0.0)
    bm.allocate("a", tokens(3))
    bm.commit("a")
    assert bm.append_tokens("a", [3]) == []
    assert len(bm.prefix_hits(tokens(4))) == 1
    new = bm.append_tokens("a", tokens(5, 4))
    assert len(new) == 2 and len(bm.prefix_hits(tokens(8))) == 2


def test_hash_seed_separates_instances() -> None:
    a = prefix_hashes(tokens(8), BS, "xxh3_128", seed=1)
    assert a == prefix_hashes(tokens(8), BS, "xxh3_128", seed=1)
    assert a != prefix_hashes(tokens(8), BS, "xxh3_128", seed=2)
    assert prefix_hashes(tokens(8), BS, "sha256", 0) != prefix_hashes(tokens(8), BS, "sha256", 1)
    bm = BlockManager.from_config(CacheConfig(block_size=4, num_blocks=8, hash_algo="sha256", hash_seed=7))
    assert bm.hashes(tokens(8)) == prefix_hashes(tokens(8), 4, "sha256", 7)


# ------------------------------------------------------------------ state machine

VOCAB_PREFIXES = [tokens(12, 0), tokens(12, 1000), [7] * 12]


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives the manager at random and checks the pool's invariants after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.num_blocks = 12
        self.bm = BlockManager(self.num_blocks, BS, watermark=0.0)
        self.block_tokens: dict[int, list[int]] = {}  # block id -> prefix it was hashed over
        self.lru: list[int] = []  # cached free blocks, least recently freed first
        self.counter = 0

    # -- helpers mirroring the pool's free order into the model
    def _release(self, block_ids: list[int]) -> None:
        for bid in reversed(block_ids):  # the manager frees tail first
            b = self.bm.pool.blocks[bid]
            if b.ref_cnt == 0 and b.block_hash is not None:
                self.lru.append(bid)

    def _take(self, kind: str, prefix: int, length: int, suffix_seed: int) -> None:
        toks = (VOCAB_PREFIXES[prefix] + tokens(24, 5000 + suffix_seed * 31))[:length]
        rid = f"r{self.counter}"
        self.counter += 1
        hits_before = [b.block_id for b in self.bm.prefix_hits(toks)]
        cached_before = {b.block_id for b in self.bm.pool.blocks if b.block_hash is not None}
        free_uncached = sum(1 for b in self.bm.pool.free_queue if b.block_hash is None)
        free_before = self.bm.num_free_blocks
        try:
            alloc = (self.bm.allocate(rid, toks) if kind == "allocate"
                     else self.bm.reserve(rid, toks, timeout_s=10.0))
        except ValueError:
            assert self.bm.num_free_blocks == free_before and rid not in self.bm.requests
            return
        assert alloc.block_ids[: alloc.num_cached_blocks] == hits_before
        for bid in hits_before:
            if bid in self.lru:
                self.lru.remove(bid)
        self._check_evictions(alloc.new_block_ids, cached_before, free_uncached)

    def _check_evictions(self, new: list[int], cached_before: set[int], free_uncached: int) -> None:
        """Uncached free blocks go first; cached ones are evicted least recently freed first."""
        evicted = [bid for bid in new if bid in cached_before]
        if evicted:
            assert len(new) - len(evicted) == free_uncached
        assert evicted == self.lru[: len(evicted)]
        del self.lru[: len(evicted)]
        for bid in evicted:
            self.block_tokens.pop(bid, None)

    @rule(prefix=st.integers(0, 2), length=st.integers(1, 24), seed=st.integers(0, 3))
    def allocate(self, prefix: int, length: int, seed: int) -> None:
        self._take("allocate", prefix, length, seed)

    @rule(prefix=st.integers(0, 2), length=st.integers(1, 24), seed=st.integers(0, 3))
    def reserve(self, prefix: int, length: int, seed: int) -> None:
        self._take("reserve", prefix, length, seed)

    def _pick(self, data: st.DataObject, states: set[BlockState]) -> str | None:
        rids = sorted(r for r, a in self.bm.requests.items() if a.state in states)
        return data.draw(st.sampled_from(rids)) if rids else None

    @precondition(lambda self: self.bm.requests)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        rid = self._pick(data, {BlockState.PENDING, BlockState.ALLOCATED})
        if rid is None:
            return
        alloc = self.bm.requests[rid]
        newly = self.bm.commit(rid)
        for i, bid in enumerate(alloc.block_ids):
            if bid in newly:
                self.block_tokens[bid] = alloc.token_ids[: (i + 1) * BS]

    @precondition(lambda self: self.bm.requests)
    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        rid = self._pick(data, {BlockState.PENDING})
        if rid is None:
            return
        alloc = self.bm.requests[rid]
        ids = alloc.block_ids
        invalid = self.bm.discard(rid)
        assert invalid == alloc.new_block_ids
        for bid in invalid:  # never valid, so never cached
            assert self.bm.pool.blocks[bid].block_hash is None
        self._release(ids)

    @precondition(lambda self: self.bm.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = self._pick(data, {BlockState.ALLOCATED, BlockState.COMMITTED})
        if rid is None:
            return
        ids = self.bm.requests[rid].block_ids
        self.bm.free(rid)
        self._release(ids)

    @precondition(lambda self: self.bm.requests)
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data: st.DataObject, n: int) -> None:
        rid = self._pick(data, {BlockState.COMMITTED})
        if rid is None:
            return
        alloc = self.bm.requests[rid]
        cached_before = {b.block_id for b in self.bm.pool.blocks if b.block_hash is not None}
        full_before = len(alloc.token_ids) // BS
        free_uncached = sum(1 for b in self.bm.pool.free_queue if b.block_hash is None)
        try:
            new = self.bm.append_tokens(rid, tokens(n, 9000 + len(alloc.token_ids)))
        except ValueError:
            return
        self._check_evictions(new, cached_before, free_uncached)
        for i in range(full_before, len(alloc.token_ids) // BS):
            b = alloc.blocks[i]
            if b.block_hash is not None and self.bm.pool.cached.get(b.block_hash) is b:
                self.block_tokens[b.block_id] = alloc.token_ids[: (i + 1) * BS]

    # -- invariants
    @invariant()
    def counts_add_up(self) -> None:
        pool = self.bm.pool
        free_ids = [b.block_id for b in pool.free_queue]
        used_ids = [b.block_id for b in pool.blocks if b.ref_cnt > 0]
        assert len(free_ids) + len(used_ids) == self.num_blocks
        assert not set(free_ids) & set(used_ids)
        assert len(set(free_ids)) == len(free_ids) == pool.num_free_blocks

    @invariant()
    def refcounts_match_holders(self) -> None:
        holders: dict[int, int] = {}
        for alloc in self.bm.requests.values():
            for bid in alloc.block_ids:
                holders[bid] = holders.get(bid, 0) + 1
        for b in self.bm.pool.blocks:
            assert b.ref_cnt >= 0
            assert b.ref_cnt == holders.get(b.block_id, 0)

    @invariant()
    def cached_hashes_match_tokens(self) -> None:
        for h, block in self.bm.pool.cached.items():
            assert block.block_hash == h
            toks = self.block_tokens[block.block_id]
            assert prefix_hashes(toks, BS)[-1] == h

    @invariant()
    def eviction_order_is_lru(self) -> None:
        queued = [b.block_id for b in self.bm.pool.free_queue if b.block_hash is not None]
        assert queued == self.lru


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
