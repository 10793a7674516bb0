"""Request-level block management: admission, prefix hits, and received-block lifecycle.

A request's blocks come from one of two calls. ``allocate`` is for a prompt computed
locally. ``reserve`` is for a prompt whose KV arrives from a prefill instance: its new
blocks are not valid until the transfer completes, so they are never hashed into the
prefix cache before ``commit``; a failed transfer calls ``discard``, which returns the
invalid block ids and recycles them ahead of any cached block. A reservation that is
neither committed nor discarded before its deadline is discarded by ``expire``.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvxfer.cache.block_pool import BlockPool, KVCacheBlock
from kvxfer.cache.prefix_hash import prefix_hashes
from kvxfer.config import CacheConfig, HashAlgo

logger = logging.getLogger(__name__)


class Admission(enum.Enum):
    """Whether a request fits: now, once others finish, or never at this cache size."""

    OK = "ok"
    LATER = "later"
    NEVER = "never"


class BlockState(enum.Enum):
    ALLOCATED = "allocated"  # computed locally; valid once the engine has written it
    PENDING = "pending"  # reserved for an incoming transfer; not valid yet
    COMMITTED = "committed"  # valid, full blocks published in the prefix cache


@dataclass
class Allocation:
    """The blocks a request holds; ``num_cached_tokens`` leading tokens were prefix hits."""

    request_id: str
    blocks: list[KVCacheBlock]
    token_ids: list[int]
    num_cached_blocks: int
    num_cached_tokens: int
    state: BlockState
    deadline: float | None = None
    hashes: list[bytes] = field(default_factory=list)  # of every full block, computed once
    num_published: int = 0  # leading blocks already in the prefix cache

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def new_block_ids(self) -> list[int]:
        """Blocks that must be computed or received (everything after the prefix hit)."""
        return [b.block_id for b in self.blocks[self.num_cached_blocks :]]


class BlockManager:
    """Owns a BlockPool and maps request ids to the blocks they hold."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        hash_algo: HashAlgo = "xxh3_128",
        hash_seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size: expected a power of two >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark: expected 0 <= watermark < 1, got {watermark}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.watermark_blocks = int(watermark * num_blocks)
        self.hash_algo: HashAlgo = hash_algo
        self.hash_seed = hash_seed
        self.clock = clock
        self.requests: dict[str, Allocation] = {}

    @classmethod
    def from_config(cls, cache: CacheConfig, clock: Callable[[], float] = time.monotonic) -> BlockManager:
        return cls(
            cache.num_blocks,
            cache.block_size,
            enable_prefix_caching=cache.enable_prefix_caching,
            watermark=cache.watermark,
            hash_algo=cache.hash_algo,
            hash_seed=cache.hash_seed,
            clock=clock,
        )

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        return prefix_hashes(token_ids, self.block_size, self.hash_algo, self.hash_seed)

    def prefix_hits(
        self, token_ids: Sequence[int], max_cached_tokens: int | None = None
    ) -> list[KVCacheBlock]:
        """Leading full blocks of ``token_ids`` already in the prefix cache."""
        if not self.pool.enable_caching:
            return []
        return self._hits(self.hashes(token_ids), len(token_ids), max_cached_tokens)

    def _hits(
        self, hashes: list[bytes], num_tokens: int, max_cached_tokens: int | None
    ) -> list[KVCacheBlock]:
        limit = num_tokens if max_cached_tokens is None else max(0, min(num_tokens, max_cached_tokens))
        hits: list[KVCacheBlock] = []
        for h in hashes[: limit // self.block_size]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def admit(self, token_ids: Sequence[int], max_cached_tokens: int | None = None) -> Admission:
        """OK if the request's blocks fit above the watermark now; LATER if they could once
        others finish; NEVER if they exceed the cache less the watermark."""
        needed = self.blocks_needed(len(token_ids))
        if needed > self.num_blocks - self.watermark_blocks:
            return Admission.NEVER
        hits = self.prefix_hits(token_ids, max_cached_tokens)
        from_free = needed - len(hits) + sum(1 for b in hits if b.ref_cnt == 0)
        if self.num_free_blocks - from_free >= self.watermark_blocks:
            return Admission.OK
        return Admission.LATER

    def get(self, request_id: str) -> Allocation:
        try:
            return self.requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no blocks") from None

    # ------------------------------------------------------------------ lifecycle
    def _take(self, request_id: str, token_ids: Sequence[int], state: BlockState,
              deadline: float | None, max_cached_tokens: int | None) -> Allocation:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if len(token_ids) == 0:
            raise ValueError(f"request {request_id!r}: no tokens")
        tokens = np.asarray(token_ids, dtype=np.int64).tolist()
        needed = self.blocks_needed(len(tokens))
        hashes = self.hashes(tokens) if self.pool.enable_caching else []
        hits = self._hits(hashes, len(tokens), max_cached_tokens)
        from_free = needed - len(hits) + sum(1 for b in hits if b.ref_cnt == 0)
        if from_free > self.num_free_blocks:
            raise ValueError(
                f"request {request_id!r}: needs {from_free} free blocks, {self.num_free_blocks} free"
            )
        self.pool.touch(hits)  # before allocating, so a hit cannot be evicted for ourselves
        new = self.pool.allocate(needed - len(hits))
        alloc = Allocation(request_id, hits + new, tokens, len(hits), len(hits) * self.block_size,
                           state, deadline, hashes=hashes, num_published=len(hits))
        self.requests[request_id] = alloc
        return alloc

    def allocate(self, request_id: str, token_ids: Sequence[int],
                 max_cached_tokens: int | None = None) -> Allocation:
        """Blocks for a prompt computed locally; prefix hits are shared, not recomputed."""
        return self._take(request_id, token_ids, BlockState.ALLOCATED, None, max_cached_tokens)

    def reserve(self, request_id: str, token_ids: Sequence[int], timeout_s: float,
                max_cached_tokens: int | None = None) -> Allocation:
        """Blocks for a prompt whose KV will be received; only ``new_block_ids`` move."""
        if timeout_s <= 0:
            raise ValueError(f"request {request_id!r}: timeout_s must be > 0, got {timeout_s}")
        deadline = self.clock() + timeout_s
        return self._take(request_id, token_ids, BlockState.PENDING, deadline, max_cached_tokens)

    def commit(self, request_id: str) -> list[int]:
        """The request's blocks are valid: publish its full blocks in the prefix cache.

        Returns the ids of blocks newly cached.
        """
        alloc = self.get(request_id)
        alloc.state = BlockState.COMMITTED
        alloc.deadline = None
        return self._publish(alloc)

    def _publish(self, alloc: Allocation) -> list[int]:
        """Put the request's hashed, not yet published full blocks in the prefix cache."""
        start, stop = alloc.num_published, len(alloc.hashes)
        cached = [b.block_id for b, h in zip(alloc.blocks[start:stop], alloc.hashes[start:stop], strict=True)
                  if self.pool.cache_block(b, h)]
        alloc.num_published = stop
        return cached

    def _extend_hashes(self, alloc: Allocation) -> None:
        if not self.pool.enable_caching:
            return
        bs = self.block_size
        full, done = len(alloc.token_ids) // bs, len(alloc.hashes)
        if full > done:
            parent = alloc.hashes[-1] if alloc.hashes else None
            alloc.hashes.extend(prefix_hashes(alloc.token_ids[done * bs : full * bs], bs,
                                              self.hash_algo, self.hash_seed, parent=parent))

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> list[int]:
        """Grow a request by generated tokens; returns the ids of blocks added.

        Raises (changing nothing) when the pool cannot supply the blocks.
        """
        alloc = self.get(request_id)
        if alloc.state is BlockState.PENDING:
            raise ValueError(f"request {request_id!r}: cannot append to a pending reservation")
        total = len(alloc.token_ids) + len(token_ids)
        extra = self.blocks_needed(total) - len(alloc.blocks)
        if extra > self.num_free_blocks:
            raise ValueError(
                f"request {request_id!r}: needs {extra} more blocks, {self.num_free_blocks} free"
            )
        new = self.pool.allocate(max(0, extra))
        alloc.blocks.extend(new)
        alloc.token_ids.extend(np.asarray(token_ids, dtype=np.int64).tolist())
        self._extend_hashes(alloc)
        if alloc.state is BlockState.COMMITTED:
            self._publish(alloc)
        return [b.block_id for b in new]

    def discard(self, request_id: str) -> list[int]:
        """A transfer failed: release the reservation; returns the invalid (never valid) ids."""
        alloc = self.get(request_id)
        if alloc.state is not BlockState.PENDING:
            raise ValueError(f"request {request_id!r}: only a pending reservation can be discarded")
        invalid = alloc.new_block_ids
        del self.requests[request_id]
        self.pool.free(alloc.blocks[::-1])
        logger.debug("request %s: discarded, %d invalid blocks recycled", request_id, len(invalid))
        return invalid

    def free(self, request_id: str) -> None:
        """The request is done with its blocks; cached ones stay findable until evicted."""
        alloc = self.get(request_id)
        if alloc.state is BlockState.PENDING:
            self.discard(request_id)
            return
        del self.requests[request_id]
        self.pool.free(alloc.blocks[::-1])

    def expire(self, now: float | None = None) -> dict[str, list[int]]:
        """Discard reservations past their deadline; returns request id -> invalid block ids."""
        t = self.clock() if now is None else now
        late = [r for r, a in self.requests.items()
                if a.state is BlockState.PENDING and a.deadline is not None and a.deadline <= t]
        out = {}
        for rid in late:
            logger.warning("request %s: reservation expired before its transfer completed", rid)
            out[rid] = self.discard(rid)
        return out
