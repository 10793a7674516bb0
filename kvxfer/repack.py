"""Receive-side repacking: put remote KV bytes into the local block format.

A block holds ``block_size`` tokens of one layer's K (or V) for a rank's heads:
NHD is ``[block_size, heads, head_size]``, HND is ``[heads, block_size, head_size]``.
Everything here is vectorised torch over whole block lists; no Python loop per block.

Byte arrangement the transfer core produces for :func:`repack_inplace`
---------------------------------------------------------------------
The listed local blocks, taken in order, are one byte sequence (each contributes its
``block_stride`` bytes). The data plane writes the remote blocks of the request, in token
order, back to back into that sequence: byte k of it is byte k of the concatenated remote
blocks. So with a remote block size ``R`` and local size ``L`` (same layout or not):

- ``R <= L``: remote block j lands in local block ``j // (L/R)`` at byte offset
  ``(j % (L/R)) * remote_block_bytes``;
- ``R > L``: remote block j is cut into ``R/L`` chunks of ``local_block_bytes``;
  chunk c lands at the start of local block ``j*(R/L) + c``.

A token-major (NHD) remote block can be cut on any token boundary, so only the chunks
that hold the request's first ``num_tokens`` tokens need to arrive and the list needs
only ``ceil(num_tokens / L)`` blocks. A head-major (HND) remote block mixes all its
tokens in every chunk, so it must arrive whole: the list must hold
``ceil(num_tokens / R) * R`` tokens, and blocks past ``ceil(num_tokens / L)`` are spare
(zeroed by the repack; the caller frees them).

NHD to NHD needs no data movement at any block-size ratio (the byte order is already the
token order); only the positions past ``num_tokens`` are zeroed.

Head-slice placement for heterogeneous TP
-----------------------------------------
When a local block gathers heads from several remote ranks (or reads a subset of a
remote rank's heads), heads ``[h0, h1)`` of a block occupy, in HND, one contiguous byte
range, and in NHD one range per token, strided by ``heads * head_size * itemsize``.
:func:`head_slice_ranges` gives those byte ranges (so the transfer core can plan
descriptors straight into place) and :func:`place_heads` copies a staged contribution
into its head slice when the layouts or block sizes also differ.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import torch

from kvxfer.cache.blockcopy import gather_rows, scatter_rows

logger = logging.getLogger(__name__)

LAYOUTS = ("NHD", "HND")
# Measured NHD->HND on the 512 MiB Llama-like cache (2 cores, 32 MiB L3): 128 KiB chunks
# 1.9 GB/s, 512 KiB 4.3, 1 MiB 6.4, 2 MiB 7.5, 4 MiB 8.2, 8 MiB 6.5 (benchmarks/repack.py
# --chunk-bytes). Small chunks pay per-call overhead; large ones fall out of L3.
DEFAULT_CHUNK_BYTES = 4 << 20


def _check_layout(name: str, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{name}: expected 'NHD' or 'HND', got {layout!r}")


def _check_block_sizes(remote_block_size: int, local_block_size: int) -> None:
    for name, v in (("remote_block_size", remote_block_size), ("local_block_size", local_block_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    big, small = max(remote_block_size, local_block_size), min(remote_block_size, local_block_size)
    if big % small:
        raise ValueError(
            f"block sizes do not divide one another: remote {remote_block_size}, local {local_block_size}"
        )


def block_shape(layout: str, block_size: int, num_heads: int, head_size: int) -> tuple[int, int, int]:
    _check_layout("layout", layout)
    return (block_size, num_heads, head_size) if layout == "NHD" else (num_heads, block_size, head_size)


def _heads_dim(layout: str, shape: Sequence[int]) -> tuple[int, int, int]:
    """(tokens, heads, head_size) of a block shape in ``layout``."""
    if layout == "NHD":
        return shape[0], shape[1], shape[2]
    return shape[1], shape[0], shape[2]


def _as_tokens(blocks: torch.Tensor, layout: str) -> torch.Tensor:
    """``[n, *block]`` -> ``[n * block_size, heads, head_size]`` in token order."""
    if layout == "HND":
        blocks = blocks.transpose(1, 2)
    n, bs, h, d = blocks.shape
    return blocks.reshape(n * bs, h, d)


def _from_tokens(tokens: torch.Tensor, num_blocks: int, block_size: int, layout: str,
                 num_tokens: int) -> torch.Tensor:
    """Token-ordered ``[>=num_tokens, heads, head_size]`` -> ``[num_blocks, *block]``, zero past the end."""
    _, h, d = tokens.shape
    out = torch.zeros((num_blocks, block_size, h, d), dtype=tokens.dtype, device=tokens.device)
    out.view(num_blocks * block_size, h, d)[:num_tokens] = tokens[:num_tokens]
    return out.transpose(1, 2) if layout == "HND" else out


def to_local(remote_blocks: torch.Tensor, *, remote_layout: str, local_layout: str,
             remote_block_size: int, local_block_size: int, num_tokens: int | None = None) -> torch.Tensor:
    """One request's remote blocks (token order) as local blocks holding the same tokens.

    Returns ``[ceil(T / local_block_size), *local_block_shape]`` where T is ``num_tokens``
    (default: every position of the remote blocks); positions past T are zero.
    """
    _check_layout("remote_layout", remote_layout)
    _check_layout("local_layout", local_layout)
    _check_block_sizes(remote_block_size, local_block_size)
    if remote_blocks.ndim != 4:
        raise ValueError(
            f"remote_blocks: expected [n, *block_shape] (4-d), got shape {tuple(remote_blocks.shape)}"
        )
    bs, _, _ = _heads_dim(remote_layout, remote_blocks.shape[1:])
    if bs != remote_block_size:
        raise ValueError(
            f"remote_blocks: shape {tuple(remote_blocks.shape)} in {remote_layout} holds {bs} tokens "
            f"per block, expected remote_block_size={remote_block_size}"
        )
    total = remote_blocks.shape[0] * remote_block_size
    t = total if num_tokens is None else num_tokens
    if not 0 <= t <= total:
        raise ValueError(f"num_tokens: expected 0 <= num_tokens <= {total}, got {num_tokens}")
    m = math.ceil(t / local_block_size)
    return _from_tokens(_as_tokens(remote_blocks, remote_layout), m, local_block_size, local_layout, t)


def _block_index(block_ids: Sequence[int] | np.ndarray | torch.Tensor, num_blocks: int) -> torch.Tensor:
    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64) if not isinstance(block_ids, torch.Tensor)
                          else block_ids, dtype=torch.int64)
    if ids.ndim != 1 or len(ids) == 0:
        raise ValueError(f"block_ids: expected a non-empty 1-d list, got shape {tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
        raise ValueError(f"block_ids: expected ids in [0, {num_blocks}), got min {int(ids.min())} "
                         f"max {int(ids.max())}")
    if len(torch.unique(ids)) != len(ids):
        raise ValueError("block_ids: ids repeat; each local block can hold one piece")
    return ids


def blocks_to_receive(num_tokens: int, *, remote_layout: str, remote_block_size: int,
                      local_block_size: int) -> int:
    """How many local blocks must be listed for :func:`repack_inplace` (see the module doc)."""
    _check_layout("remote_layout", remote_layout)
    _check_block_sizes(remote_block_size, local_block_size)
    if num_tokens < 1:
        raise ValueError(f"num_tokens: expected >= 1, got {num_tokens}")
    if remote_layout == "HND":
        num_tokens = math.ceil(num_tokens / remote_block_size) * remote_block_size
    return math.ceil(num_tokens / local_block_size)


def repack_inplace(cache: torch.Tensor, block_ids: Sequence[int] | np.ndarray | torch.Tensor, *,
                   remote_layout: str, local_layout: str, remote_block_size: int, local_block_size: int,
                   num_tokens: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rewrite the listed blocks of ``cache`` from raw remote bytes into the local format.

    ``cache`` is ``[num_blocks, *local_block_shape]``; the listed blocks hold the request's
    remote bytes as the module doc arranges them. Returns how many of the listed blocks
    hold tokens (``ceil(num_tokens / local_block_size)``); any after those are zeroed.
    """
    _check_layout("remote_layout", remote_layout)
    _check_layout("local_layout", local_layout)
    _check_block_sizes(remote_block_size, local_block_size)
    if cache.ndim != 4:
        raise ValueError(f"cache: expected [num_blocks, *block_shape] (4-d), got shape {tuple(cache.shape)}")
    bs, _, _ = _heads_dim(local_layout, cache.shape[1:])
    if bs != local_block_size:
        raise ValueError(f"cache: shape {tuple(cache.shape)} in {local_layout} holds {bs} tokens per block, "
                         f"expected local_block_size={local_block_size}")
    if not cache.is_contiguous():
        raise ValueError("cache: expected a contiguous tensor (the data plane writes raw bytes into it)")
    ids = _block_index(block_ids, cache.shape[0])
    need = blocks_to_receive(max(num_tokens, 1), remote_layout=remote_layout,
                             remote_block_size=remote_block_size, local_block_size=local_block_size)
    if num_tokens < 1 or len(ids) < need:
        raise ValueError(f"block_ids: {num_tokens} tokens from {remote_layout} blocks of {remote_block_size} "
                         f"need {need} local blocks of {local_block_size}, got {len(ids)}")
    used = math.ceil(num_tokens / local_block_size)
    dev_ids = ids.to(cache.device)

    if remote_layout == local_layout == "NHD" or (
        remote_layout == local_layout and remote_block_size == local_block_size
    ):
        # bytes are already in place: zero what lies past the last token
        tail = used * local_block_size - num_tokens
        last = cache[dev_ids[used - 1]]
        if tail:
            (last[-tail:] if local_layout == "NHD" else last[:, -tail:]).zero_()
        if len(ids) > used:
            cache.index_fill_(0, dev_ids[used:], 0)
        return used

    _transform_in_chunks(cache, dev_ids, remote_layout, local_layout, remote_block_size, local_block_size,
                         num_tokens, chunk_bytes)
    return used


def _transform_in_chunks(cache: torch.Tensor, ids: torch.Tensor, remote_layout: str, local_layout: str,
                         rbs: int, lbs: int, num_tokens: int, chunk_bytes: int) -> None:
    """Gather a chunk of the listed blocks, rearrange it, scatter it back; chunk by chunk.

    A chunk is a whole number of remote and local blocks sized to stay in cache, so each
    byte crosses memory once each way: the rate approaches memcpy's instead of paying one
    memory pass per step. The loop is per chunk (a few MiB), never per block.
    """
    _, h, d = _heads_dim(local_layout, cache.shape[1:])
    unit = max(rbs, lbs)
    token_bytes = h * d * cache.element_size()
    chunk_tokens = max(unit, (chunk_bytes // token_bytes) // unit * unit)
    c = chunk_tokens // lbs  # local blocks per chunk; every chunk starts on a remote block boundary
    raw_buf = torch.empty((c, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    stream_buf = (torch.empty((c * lbs, h, d), dtype=cache.dtype, device=cache.device)
                  if remote_layout == "HND" else None)
    out_buf = (torch.empty((c, h, lbs, d), dtype=cache.dtype, device=cache.device)
               if local_layout == "HND" else None)
    for start in range(0, len(ids), c):
        cid = ids[start : start + c]
        k = len(cid)
        raw = gather_rows(cache, cid, out=raw_buf)[:k].view(-1)  # the remote bytes, back to back
        valid = min(max(num_tokens - start * lbs, 0), k * lbs)  # tokens of the request in this chunk
        if stream_buf is None:
            stream = raw.view(k * lbs, h, d)  # NHD bytes are already token-major
        else:
            n_r = math.ceil(valid / rbs)
            stream = stream_buf[: k * lbs]
            remote = raw[: n_r * rbs * h * d].view(n_r, h, rbs, d)
            stream[: n_r * rbs].view(n_r, rbs, h, d).copy_(remote.transpose(1, 2))
        stream[valid:].zero_()
        blocks = stream.view(k, lbs, h, d)
        if out_buf is not None:
            out_buf[:k].copy_(blocks.transpose(1, 2))
            blocks = out_buf[:k]
        scatter_rows(cache, cid, blocks)


def expand_block_ids(block_ids: Sequence[int] | np.ndarray, factor: int, skip: int = 0) -> np.ndarray:
    """Block ids at one block size as ids at a size ``factor`` times smaller.

    Block b becomes ``b*factor .. b*factor + factor - 1``; the first ``skip`` of the
    expanded ids are dropped (e.g. sub-blocks a prefix hit already covers).
    """
    if not isinstance(factor, int | np.integer) or factor < 1:
        raise ValueError(f"factor: expected an int >= 1, got {factor!r}")
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"block_ids: expected a 1-d list, got shape {ids.shape}")
    if len(ids) and ids.min() < 0:
        raise ValueError(f"block_ids: expected ids >= 0, got {int(ids.min())}")
    if not 0 <= skip <= len(ids) * factor:
        raise ValueError(f"skip: expected 0 <= skip <= {len(ids) * factor}, got {skip}")
    return (ids[:, None] * factor + np.arange(factor, dtype=np.int64)).ravel()[skip:]


def head_slice_ranges(layout: str, block_size: int, num_heads: int, head_size: int, itemsize: int,
                      heads: range) -> tuple[np.ndarray, int]:
    """Byte ranges (offsets within one block, common length) where ``heads`` live.

    HND: one range. NHD: ``block_size`` ranges, one per token, strided by the token's bytes.
    """
    _check_layout("layout", layout)
    if heads.step != 1 or not 0 <= heads.start < heads.stop <= num_heads:
        raise ValueError(f"heads: expected a range within [0, {num_heads}), got {heads}")
    n = len(heads)
    if layout == "HND":
        per_head = block_size * head_size * itemsize
        return np.array([heads.start * per_head], dtype=np.int64), n * per_head
    token = num_heads * head_size * itemsize
    offsets = np.arange(block_size, dtype=np.int64) * token + heads.start * head_size * itemsize
    return offsets, n * head_size * itemsize


def place_heads(dst: torch.Tensor, src: torch.Tensor, *, layout: str, local_heads: range) -> None:
    """Copy ``src`` ``[n, *block]`` (its heads only) into heads ``local_heads`` of ``dst``.

    Both in ``layout`` with one block size; a contiguous slice in HND, strided in NHD.
    """
    _check_layout("layout", layout)
    if dst.dtype != src.dtype:
        raise ValueError(f"dtype mismatch: dst {dst.dtype}, src {src.dtype}")
    if dst.ndim != 4 or src.ndim != 4:
        raise ValueError(f"expected 4-d blocks, got dst {tuple(dst.shape)} and src {tuple(src.shape)}")
    hd = 2 if layout == "NHD" else 1
    n_heads = local_heads.stop - local_heads.start
    expect = list(dst.shape)
    expect[hd] = n_heads
    if list(src.shape) != expect or not 0 <= local_heads.start < local_heads.stop <= dst.shape[hd]:
        raise ValueError(f"src shape {tuple(src.shape)} does not fit heads {local_heads} of dst "
                         f"{tuple(dst.shape)} in {layout}")
    dst.narrow(hd, local_heads.start, n_heads).copy_(src)
