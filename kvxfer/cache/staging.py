"""Host staging: copy chosen blocks between a cache and packed host buffers.

A data plane that cannot reach device memory moves blocks through host buffers.
Each copy is one batched gather or scatter per tensor (per layer, or one for a
cross-layer cache; ``index_select`` / numpy row assignment / ``index_copy_``, see
``blockcopy``), never a Python loop per block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvxfer.cache.blockcopy import gather_rows, scatter_rows
from kvxfer.cache.tensors import KVCache

logger = logging.getLogger(__name__)


def _index(cache: KVCache, block_ids: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
    idx = torch.as_tensor(block_ids, dtype=torch.int64)
    if idx.ndim != 1:
        raise ValueError(f"block_ids: expected a 1-d sequence, got shape {tuple(idx.shape)}")
    if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= cache.num_blocks):
        raise ValueError(f"block_ids: expected ids in [0, {cache.num_blocks}), got {idx.tolist()}")
    return idx


def _check_buffers(cache: KVCache, bufs: list[torch.Tensor], n: int, what: str) -> None:
    """Refuse (before any copy) buffers that cannot hold ``n`` blocks of every tensor."""
    if len(bufs) != len(cache.tensors):
        raise ValueError(f"{what}: expected {len(cache.tensors)} buffers, got {len(bufs)}")
    for t, buf in zip(cache.tensors, bufs, strict=True):
        if buf.shape[0] < n or buf.shape[1:] != t.shape[1:] or buf.dtype != t.dtype:
            raise ValueError(f"{what} buffer {tuple(buf.shape)} {buf.dtype} does not fit {n} "
                             f"blocks of {tuple(t.shape[1:])} {t.dtype}")


def host_buffers(cache: KVCache, num_blocks: int) -> list[torch.Tensor]:
    """Packed host buffers for ``num_blocks`` blocks of every tensor (pinned for CUDA)."""
    pin = cache.device.type == "cuda"
    return [torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in cache.tensors]


def gather_to_host(cache: KVCache, block_ids: Sequence[int] | torch.Tensor,
                   out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Blocks ``block_ids`` of every tensor, packed in that order into host buffers."""
    idx = _index(cache, block_ids)
    if out is None:
        out = host_buffers(cache, len(idx))
    _check_buffers(cache, out, len(idx), "out")
    for t, buf in zip(cache.tensors, out, strict=True):
        gather_rows(t, idx, out=buf)
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)
    return out


def scatter_from_host(cache: KVCache, block_ids: Sequence[int] | torch.Tensor,
                      src: list[torch.Tensor]) -> None:
    """Write packed host buffers into blocks ``block_ids`` of every tensor."""
    idx = _index(cache, block_ids)
    _check_buffers(cache, src, len(idx), "src")
    for t, buf in zip(cache.tensors, src, strict=True):
        scatter_rows(t, idx, buf)
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)


def mirror_of(cache: KVCache, huge_pages: bool = True, pin: bool = True) -> KVCache:
    """A host cache of the same spec and size: the registered stand-in for a device cache.
    ``pin=False``: the caller pins it (``pin_for``) once its memory stays where it is."""
    from kvxfer.cache.tensors import allocate_kv_cache

    mirror = allocate_kv_cache(cache.spec, cache.num_blocks, device="cpu", huge_pages=huge_pages)
    if pin:
        pin_for(cache, mirror)
    return mirror


def pin_for(cache: KVCache, mirror: KVCache) -> None:
    """Pin ``mirror``'s host memory when ``cache`` is on a GPU, so device copies run at full speed."""
    if cache.device.type == "cuda":
        for t in mirror.tensors:
            torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)


def copy_blocks(src: KVCache, dst: KVCache, block_ids: Sequence[int] | np.ndarray | torch.Tensor,
                layer: int | None = None) -> None:
    """Blocks ``block_ids`` of every tensor from ``src`` to the same ids of ``dst`` (any devices):
    one batched gather and one batched scatter per tensor. ``layer`` (a global layer id): only
    that layer's tensors, as a push stages each layer once it is written (a cross-layer cache
    keeps every layer in one tensor, so it copies them all)."""
    if src.spec != dst.spec or src.num_blocks != dst.num_blocks:
        raise ValueError("copy_blocks: the two caches differ in spec or size")
    idx = _index(src, block_ids)
    if len(idx) == 0:
        return
    pairs = list(zip(src.tensors, dst.tensors, strict=True))
    if layer is not None and not src.spec.cross_layer:
        layers = src.spec.layers
        if layer not in layers:
            raise ValueError(f"copy_blocks: layer {layer} is not in this cache (layers {layers.start}.."
                             f"{layers.stop - 1})")
        per = len(pairs) // len(layers)
        i = layer - layers.start
        pairs = pairs[i * per : (i + 1) * per]
    for s, d in pairs:
        scatter_rows(d, idx, gather_rows(s, idx))
    for c in (src, dst):
        if c.device.type == "cuda":
            torch.cuda.synchronize(c.device)
