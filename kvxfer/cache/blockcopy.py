"""Batched gathers and scatters of whole blocks, at memory speed.

Blocks are rows of a block-major tensor. Moving them as raw byte rows, one call for the
whole list, is several times faster than torch's ``index_copy_`` on narrow dtypes
(measured on these machines, 1 MiB of bf16 blocks in cache: ``index_select`` on int64 rows
18 us, numpy ``take`` 70 us; numpy row assignment 26 us, while ``index_copy_`` ran at
2.5 GB/s on uint8 rows and 7 GB/s on bf16). Gathers use ``index_select`` on the widest
integer view the row length allows; CPU scatters use numpy row assignment (zero-copy
views), device scatters ``index_copy_`` on the wide view.
"""

from __future__ import annotations

import torch


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_bytes]`` uint8 view of a contiguous block-major tensor."""
    if not t.is_contiguous():
        raise ValueError("expected a contiguous block-major tensor")
    return t.view(t.shape[0], -1).view(torch.uint8)


def _wide(rows: torch.Tensor) -> torch.Tensor:
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if rows.shape[1] % size == 0:
            return rows.view(dt)
    return rows


def gather_rows(t: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks ``ids`` of ``t`` packed into a contiguous ``[len(ids), *t.shape[1:]]`` tensor."""
    if out is None:
        out = torch.empty((len(ids), *t.shape[1:]), dtype=t.dtype, device=t.device)
    src, dst = _wide(_rows(t)), _rows(out)[: len(ids)]
    if out.device == t.device:
        torch.index_select(src, 0, ids.to(t.device), out=dst.view(src.dtype))
    else:
        dst.view(src.dtype).copy_(src.index_select(0, ids.to(t.device)), non_blocking=True)
    return out


def scatter_rows(t: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    """Write the first ``len(ids)`` blocks of ``src`` into blocks ``ids`` of ``t``."""
    dst = _rows(t)
    s = _rows(src.contiguous())[: len(ids)]
    if t.device.type == "cpu" and src.device.type == "cpu":
        dst.numpy()[ids.cpu().numpy()] = s.numpy()
    else:
        wide = _wide(dst)
        wide.index_copy_(0, ids.to(t.device), s.view(wide.dtype).to(t.device, non_blocking=True))
