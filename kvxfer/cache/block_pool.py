"""The block pool: refcounted blocks, an O(1) free queue, and the prefix-cache map.

Free blocks wait in a doubly linked queue. A block that carries a prefix hash stays
findable by that hash while it waits (a later request with the same prefix touches it
back into use); it is evicted only when it reaches the head of the queue and a new
block is needed. Freed cached blocks go to the tail, so eviction is least recently
used first; freed blocks without a hash go to the head, so they are reused before any
cached block is evicted. Touching a waiting block unlinks it from the middle in O(1).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

logger = logging.getLogger(__name__)


class KVCacheBlock:
    """One block's bookkeeping; ``prev_free``/``next_free`` link it in the free queue."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels; every operation is O(1)."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    @staticmethod
    def is_linked(block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def _link_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        nxt = prev.next_free
        assert nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free += 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail: evicted last."""
        assert self._tail.prev_free is not None
        self._link_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head: reused first."""
        self._link_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise ValueError("no free blocks")
        self.remove(first)
        return first


class BlockPool:
    """All blocks of one cache: allocation, refcounts, and the hash -> block prefix map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: expected >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, evictable cached blocks included."""
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def _checked(self, block_ids: Iterable[int]) -> list[KVCacheBlock]:
        out = []
        for i in block_ids:
            if not isinstance(i, int) or not 0 <= i < self.num_blocks:
                raise ValueError(f"block id {i!r} out of range [0, {self.num_blocks})")
            out.append(self.blocks[i])
        return out

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """``n`` blocks with refcount 1, evicting cached free blocks from the queue head."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks: only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit), unlinking free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference from each; blocks reaching zero join the free queue.

        Pass blocks in the order they should be evicted among themselves (callers pass a
        request's blocks tail first, so a shared prefix outlives its suffix).
        """
        counts: dict[int, int] = {}
        for b in blocks:
            counts[b.block_id] = counts.get(b.block_id, 0) + 1
            if counts[b.block_id] > b.ref_cnt:
                raise ValueError(f"block {b.block_id} freed more times than referenced ({b.ref_cnt})")
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    self.free_queue.appendleft(b)
                else:
                    self.free_queue.append(b)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Publish a full, valid block under its prefix hash; False if the hash is taken."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True
