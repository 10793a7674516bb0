"""uint8 KV quantisation with a per-token-per-head fp32 scale and zero point.

Each stored head vector is ``[scale: fp32][zero: fp32][head_size x uint8]``, so the
metadata travels inside the block with the values it describes: a transfer moves it
with no extra descriptors, and repacking treats it as 8 more bytes of head dimension.
"""

from __future__ import annotations

import torch

from kvxfer.cache.spec import QUANT_HEADER_BYTES


def quantize_uint8(x: torch.Tensor) -> torch.Tensor:
    """``[..., head_size]`` floats -> ``[..., head_size + 8]`` uint8 (header in front)."""
    if not x.is_floating_point():
        raise ValueError(f"quantize_uint8: expected a floating tensor, got {x.dtype}")
    xf = x.to(torch.float32)
    lo = xf.amin(dim=-1, keepdim=True)
    hi = xf.amax(dim=-1, keepdim=True)
    scale = (hi - lo) / 255.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((xf - lo) / scale).clamp_(0, 255).to(torch.uint8)
    header = torch.cat([scale, lo], dim=-1).contiguous().view(torch.uint8)
    return torch.cat([header, q], dim=-1)


def dequantize_uint8(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_uint8` (up to rounding): ``[..., head_size]`` in ``dtype``."""
    if q.dtype != torch.uint8 or q.shape[-1] <= QUANT_HEADER_BYTES:
        raise ValueError(
            f"dequantize_uint8: expected uint8 [..., head_size + 8], got {q.dtype} {tuple(q.shape)}"
        )
    header = q[..., :QUANT_HEADER_BYTES].contiguous().view(torch.float32)
    scale, zero = header[..., :1], header[..., 1:2]
    return (q[..., QUANT_HEADER_BYTES:].to(torch.float32) * scale + zero).to(dtype)
