"""The local KV cache: its spec, its tensors, its block manager, and host staging."""

from kvxfer.cache.block_manager import Admission, Allocation, BlockManager, BlockState
from kvxfer.cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvxfer.cache.prefix_hash import block_hash, prefix_hashes
from kvxfer.cache.quant import dequantize_uint8, quantize_uint8
from kvxfer.cache.spec import KVCacheSpec, spec_from_config
from kvxfer.cache.staging import gather_to_host, host_buffers, scatter_from_host
from kvxfer.cache.tensors import KVCache, MemoryRegion, allocate_kv_cache, transparent_huge_pages

__all__ = [
    "Admission", "Allocation", "BlockManager", "BlockPool", "BlockState", "FreeBlockQueue",
    "KVCache", "KVCacheBlock", "KVCacheSpec", "MemoryRegion", "allocate_kv_cache", "block_hash",
    "dequantize_uint8", "gather_to_host", "host_buffers", "prefix_hashes", "quantize_uint8",
    "scatter_from_host", "spec_from_config", "transparent_huge_pages",
]
