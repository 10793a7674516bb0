"""KVCacheSpec: the shape, layout and dtype of one rank's paged KV cache.

A block holds ``block_size`` tokens of one layer's K (or V) for the rank's heads:
NHD is ``[block_size, heads, head_size]``, HND is ``[heads, block_size, head_size]``.
The uint8 dtype stores, per token and head, an fp32 scale and an fp32 zero point in
front of the ``head_size`` quantised values, so its storage head size is ``head_size + 8``.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch

from kvxfer.config import CacheDtype, InstanceConfig, Layout

TORCH_DTYPES: dict[CacheDtype, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of cache dtype ``name`` (a peer's, off the wire); KeyError for an unknown name."""
    for key, dtype in TORCH_DTYPES.items():
        if key == name:
            return dtype
    raise KeyError(name)

QUANT_HEADER_BYTES = 8  # fp32 scale + fp32 zero point per token per head

RegionKind = Literal["K", "V", "KV"]


class KVCacheSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's KV cache geometry; ``first_layer`` is the global index of its first layer."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: CacheDtype = "float32"
    layout: Layout = "NHD"
    kv_split: bool = True
    # vLLM's CPU layout (HND only): one tensor per layer shaped [blocks, heads, block_size, 2 x head_size];
    # in memory each head holds its K block, then its V block (rows in the kernel's own order)
    kv_fused: bool = False
    fused_order: str = ""  # see CacheConfig.fused_order
    mla: bool = False
    cross_layer: bool = False
    first_layer: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCacheSpec.{name}: expected an int >= 1, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"KVCacheSpec.block_size: expected a power of two, got {self.block_size}")
        if self.layout not in ("NHD", "HND"):
            raise ValueError(f"KVCacheSpec.layout: expected 'NHD' or 'HND', got {self.layout!r}")
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"KVCacheSpec.dtype: expected one of {sorted(TORCH_DTYPES)}, got {self.dtype!r}")
        if self.mla and self.num_kv_heads != 1:
            raise ValueError(f"KVCacheSpec.num_kv_heads: expected 1 with mla, got {self.num_kv_heads}")
        if self.mla and self.dtype == "uint8":
            raise ValueError("KVCacheSpec.dtype: uint8 is not supported with mla")
        if self.kv_fused and (self.mla or self.cross_layer or self.dtype == "uint8" or self.layout != "HND"):
            raise ValueError("KVCacheSpec.kv_fused: needs layout HND; not with mla, cross_layer or uint8")
        if self.first_layer < 0:
            raise ValueError(f"KVCacheSpec.first_layer: expected >= 0, got {self.first_layer}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def storage_head_size(self) -> int:
        """Elements per token per head as stored (uint8 carries its scale/zero in front; a fused
        cache's declared shape carries K and V in one 2 x head_size vector)."""
        if self.kv_fused:
            return 2 * self.head_size
        return self.head_size + QUANT_HEADER_BYTES if self.dtype == "uint8" else self.head_size

    @property
    def num_kv(self) -> int:
        """Separately stored K/V parts: 2 for K and V; 1 for MLA's latent or a fused K|V."""
        return 1 if self.mla or self.kv_fused else 2

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer's K (or V)."""
        if self.layout == "NHD":
            return (self.block_size, self.num_kv_heads, self.storage_head_size)
        return (self.num_kv_heads, self.block_size, self.storage_head_size)

    @property
    def bytes_per_block_kv(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.storage_head_size * self.itemsize

    @property
    def bytes_per_block_layer(self) -> int:
        """Bytes of one block of one layer, K and V together."""
        return self.bytes_per_block_kv * self.num_kv

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across every layer this rank holds."""
        return self.bytes_per_block_layer * self.num_layers

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    def tensor_shapes(self, num_blocks: int) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes of the tensors a cache of ``num_blocks`` is made of.

        Block-major everywhere so a block's bytes in a region start at
        ``block_id * block_stride``.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks: expected >= 1, got {num_blocks}")
        bs = self.block_shape
        if self.cross_layer:
            return [("kv", (num_blocks, self.num_layers, self.num_kv, *bs))]
        out: list[tuple[str, tuple[int, ...]]] = []
        for layer in self.layers:
            if self.mla or self.kv_fused:
                out.append((f"layer{layer}.kv", (num_blocks, *bs)))
            elif self.kv_split:
                out.append((f"layer{layer}.k", (num_blocks, *bs)))
                out.append((f"layer{layer}.v", (num_blocks, *bs)))
            else:
                out.append((f"layer{layer}.kv", (num_blocks, 2, *bs)))
        return out

    def compatibility_key(self) -> tuple[object, ...]:
        """What must match for two ranks' blocks to carry the same bytes per token/head."""
        return (self.head_size, self.dtype, self.mla, self.kv_fused)


def local_kv_heads(num_kv_heads: int, tp: int, mla: bool) -> int:
    """KV heads one TP rank holds: a slice of the heads, one replicated head, or the latent."""
    if mla:
        return 1
    return max(1, num_kv_heads // tp)


def spec_from_config(cfg: InstanceConfig, pp_rank: int = 0) -> KVCacheSpec:
    """The cache spec of a rank of an instance (TP ranks of a stage share one spec)."""
    from kvxfer.topology import layer_ranges  # topology depends on nothing in cache

    par = cfg.parallel
    if not 0 <= pp_rank < par.pp:
        raise ValueError(f"pp_rank: expected 0 <= pp_rank < {par.pp}, got {pp_rank}")
    layers = layer_ranges(cfg.model.num_layers, par.pp, par.layer_partition)[pp_rank]
    return KVCacheSpec(
        num_layers=len(layers),
        first_layer=layers.start,
        num_kv_heads=local_kv_heads(cfg.model.num_kv_heads, par.tp, cfg.model.mla),
        head_size=cfg.model.head_size,
        block_size=cfg.cache.block_size,
        dtype=cfg.cache.dtype,
        layout=cfg.cache.layout,
        kv_split=cfg.cache.kv_split,
        kv_fused=cfg.cache.kv_fused,
        fused_order=cfg.cache.fused_order if cfg.cache.kv_fused else "",
        mla=cfg.model.mla,
        cross_layer=cfg.cache.cross_layer,
    )
