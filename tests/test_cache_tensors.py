"""KV cache spec, allocation, memory-region contract, host staging and uint8 quantisation."""

from __future__ import annotations

import contextlib
import ctypes
import itertools

import pytest
import torch

from kvxfer.cache import (
    KVCacheSpec,
    allocate_kv_cache,
    dequantize_uint8,
    gather_to_host,
    quantize_uint8,
    scatter_from_host,
    spec_from_config,
)
from kvxfer.cache.staging import copy_blocks
from kvxfer.cache.tensors import KVCache
from kvxfer.config import CacheConfig, InstanceConfig, ModelConfig, ParallelConfig

VARIANTS = [
    dict(kv_split=True),
    dict(kv_split=False),
    dict(mla=True, num_kv_heads=1),
    dict(cross_layer=True),
    dict(cross_layer=True, mla=True, num_kv_heads=1),
]


def spec_for(layout: str = "NHD", dtype: str = "float32", **kw: object) -> KVCacheSpec:
    base = dict(num_layers=3, num_kv_heads=2, head_size=8, block_size=4, layout=layout, dtype=dtype,
                first_layer=5)
    base.update(kw)
    return KVCacheSpec(**base)  # type: ignore[arg-type]


def test_bytes_per_block_and_shapes() -> None:
    s = spec_for()
    assert s.block_shape == (4, 2, 8)
    assert spec_for(layout="HND").block_shape == (2, 4, 8)
    assert s.bytes_per_block_kv == 4 * 2 * 8 * 4
    assert s.bytes_per_block_layer == 2 * s.bytes_per_block_kv
    assert s.bytes_per_block == 3 * s.bytes_per_block_layer
    q = spec_for(dtype="uint8")
    assert q.storage_head_size == 16 and q.bytes_per_block_kv == 4 * 2 * 16
    m = spec_for(mla=True, num_kv_heads=1, dtype="bfloat16")
    assert m.num_kv == 1 and m.bytes_per_block == 3 * 4 * 1 * 8 * 2
    llama = KVCacheSpec(num_layers=32, num_kv_heads=8, head_size=128, block_size=16, dtype="bfloat16")
    assert llama.bytes_per_block == 2 * 2**20  # 4096 tokens = 256 blocks = 512 MiB


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(block_size=12), "block_size: expected a power of two, got 12"),
        (dict(num_layers=0), "num_layers: expected an int >= 1, got 0"),
        (dict(layout="NDH"), "layout: expected 'NHD' or 'HND', got 'NDH'"),
        (dict(dtype="int4"), "dtype: expected one of"),
        (dict(mla=True), "num_kv_heads: expected 1 with mla, got 2"),
    ],
)
def test_spec_refusals(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        spec_for(**kw)


@pytest.mark.parametrize(
    ("variant", "layout", "dtype"),
    [c for c in itertools.product(VARIANTS, ["NHD", "HND"], ["float32", "bfloat16", "uint8"])
     if not (c[0].get("mla") and c[2] == "uint8")],  # uint8 with mla is refused
)
def test_regions_follow_the_block_stride_contract(variant: dict, layout: str, dtype: str) -> None:
    """A block's bytes in a region start at block_id * block_stride, read from the raw address."""
    spec = spec_for(layout=layout, dtype=dtype, **variant)
    cache = allocate_kv_cache(spec, num_blocks=6)
    for t in cache.tensors:
        t.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),),
                                                         dtype=torch.uint8))
    for r, t in zip(cache.regions, cache.tensors, strict=True):
        assert r.address == t.data_ptr() and r.length == t.numel() * t.element_size()
        assert r.block_stride * 6 == r.length and r.num_blocks == 6 and r.device == "cpu"
        for block_id in (0, 3, 5):
            raw = ctypes.string_at(r.address + r.block_offset(block_id), r.block_stride)
            assert raw == t[block_id].contiguous().view(torch.uint8).numpy().tobytes()
    assert sum(r.block_stride for r in cache.regions) == spec.bytes_per_block
    # every layer the rank holds is covered, with its K and V
    covered = sorted(layer for r in cache.regions for layer in range(*r.layers))
    per_layer = 2 if (spec.kv_split and not spec.mla and not spec.cross_layer) else 1
    assert covered == sorted(list(spec.layers) * per_layer)


@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_kv_views_address_the_right_bytes(variant: dict) -> None:
    spec = spec_for(**variant)
    cache = allocate_kv_cache(spec, num_blocks=4)
    for layer in spec.layers:
        k, v = cache.layer_kv(layer)
        assert k.shape == (4, *spec.block_shape)
        k.fill_(layer)
        if v is not None:
            assert not spec.mla
            v.fill_(-layer)
        else:
            assert spec.mla
    for layer in spec.layers:
        k, v = cache.layer_kv(layer)
        assert torch.all(k == layer)
        if v is not None:
            assert torch.all(v == -layer)
    with pytest.raises(ValueError, match="not held by this rank"):
        cache.layer_kv(0)


def test_huge_page_and_plain_allocations_are_zeroed_and_equivalent() -> None:
    spec = spec_for(dtype="bfloat16")
    a = allocate_kv_cache(spec, 8, huge_pages=True)
    b = allocate_kv_cache(spec, 8, huge_pages=False)
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype and x.is_contiguous()
        assert torch.count_nonzero(x) == 0
    big = allocate_kv_cache(KVCacheSpec(num_layers=1, num_kv_heads=8, head_size=128, block_size=16), 64)
    assert big.tensors[0].data_ptr() % (2 << 20) == 0  # 2 MiB aligned for transparent huge pages


def test_wrapping_external_tensors_is_checked() -> None:
    spec = spec_for()
    good = [torch.zeros(s) for _, s in spec.tensor_shapes(4)]
    KVCache(spec=spec, num_blocks=4, tensors=good, names=[])
    with pytest.raises(ValueError, match="expected 6 tensors"):
        KVCache(spec=spec, num_blocks=4, tensors=good[:2], names=[])
    bad = list(good)
    bad[1] = torch.zeros(4, 2, 4, 8)
    with pytest.raises(ValueError, match=r"tensor layer5.v: expected shape \(4, 4, 2, 8\)"):
        KVCache(spec=spec, num_blocks=4, tensors=bad, names=[])
    bad[1] = torch.zeros(4, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"expected dtype torch\.float32"):
        KVCache(spec=spec, num_blocks=4, tensors=bad, names=[])
    with pytest.raises(ValueError, match="CUDA is not available") if not torch.cuda.is_available() else \
            pytest.raises(ValueError, match="expected cpu or cuda"):
        allocate_kv_cache(spec, 4, device="cuda" if not torch.cuda.is_available() else "meta")


def test_spec_from_config_per_rank() -> None:
    cfg = InstanceConfig(
        role="decode", engine_id="d",
        model=ModelConfig(num_layers=5, num_kv_heads=4, num_heads=8, head_size=16),
        cache=CacheConfig(block_size=32, layout="HND", dtype="bfloat16"),
        parallel=ParallelConfig(tp=2, pp=2),
    )
    s0, s1 = spec_from_config(cfg, 0), spec_from_config(cfg, 1)
    assert (s0.first_layer, s0.num_layers, s1.first_layer, s1.num_layers) == (0, 3, 3, 2)
    assert s0.num_kv_heads == 2 and s0.layout == "HND" and s0.block_size == 32
    rep = msgspec_replace(cfg, parallel=ParallelConfig(tp=8))
    assert spec_from_config(rep).num_kv_heads == 1  # heads replicated past the head count
    with pytest.raises(ValueError, match="pp_rank"):
        spec_from_config(cfg, 2)


def msgspec_replace(cfg: InstanceConfig, **kw: object) -> InstanceConfig:
    import msgspec

    return msgspec.structs.replace(cfg, **kw)


@pytest.mark.parametrize("variant", VARIANTS)
def test_host_staging_round_trip(variant: dict) -> None:
    spec = spec_for(dtype="bfloat16", **variant)
    src = allocate_kv_cache(spec, 10)
    for t in src.tensors:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    ids = [7, 2, 9, 2 + 1]
    staged = gather_to_host(src, ids)
    for t, buf in zip(src.tensors, staged, strict=True):
        assert buf.shape[0] == 4 and torch.equal(buf, t[torch.tensor(ids)])
    dst = allocate_kv_cache(spec, 10)
    scatter_from_host(dst, [0, 1, 4, 5], staged)
    for s, d in zip(src.tensors, dst.tensors, strict=True):
        assert torch.equal(d[torch.tensor([0, 1, 4, 5])], s[torch.tensor(ids)])
        assert torch.count_nonzero(d[torch.tensor([2, 3, 6, 7, 8, 9])].float()) == 0
    with pytest.raises(ValueError, match=r"block_ids: expected ids in \[0, 10\)"):
        gather_to_host(src, [10])
    with pytest.raises(ValueError, match=r"expected .* buffers"):
        scatter_from_host(dst, [0], [*staged, *staged])


@pytest.mark.parametrize("variant", VARIANTS)
def test_copy_blocks_of_one_layer_copies_that_layer_only(variant: dict) -> None:
    """Push stages each layer as it is written: the layer's blocks move, no other layer's bytes
    (a cross-layer cache keeps every layer in one tensor and copies it whole)."""
    spec = spec_for(**variant)
    src, dst = allocate_kv_cache(spec, 10), allocate_kv_cache(spec, 10)
    for t in src.tensors:
        t.copy_(torch.randn(t.shape))
    copy_blocks(src, dst, [3, 7], layer=6)
    per = len(src.tensors) // spec.num_layers
    for i, (s, d) in enumerate(zip(src.tensors, dst.tensors, strict=True)):
        moved = spec.cross_layer or i // per == 6 - spec.first_layer
        assert torch.equal(d[[3, 7]], s[[3, 7]]) if moved else torch.count_nonzero(d) == 0, (i, moved)
        assert torch.count_nonzero(d[[0, 1, 2, 4, 5, 6, 8, 9]]) == 0
    with pytest.raises(ValueError, match=r"layer 8 is not in this cache \(layers 5..7\)") if not spec.cross_layer \
            else contextlib.nullcontext():
        copy_blocks(src, dst, [1], layer=8)


def test_uint8_quantisation_round_trip() -> None:
    x = torch.randn(5, 3, 64) * 4
    q = quantize_uint8(x)
    assert q.dtype == torch.uint8 and q.shape == (5, 3, 72)
    err = (dequantize_uint8(q) - x).abs()
    span = x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)
    assert torch.all(err <= span / 255 / 2 + 1e-5)
    const = torch.full((2, 16), 3.5)
    assert torch.equal(dequantize_uint8(quantize_uint8(const)), const)
    with pytest.raises(ValueError, match="expected uint8"):
        dequantize_uint8(x)


def test_fused_cache_views_match_vllms_cpu_layout() -> None:
    """vLLM's CPU backend declares [blocks, heads, block_size, 2*head] and reads K and V as
    ``view(blocks, heads, 2*block_size, head).chunk(2, dim=2)``: K rows, then V rows, per head."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_size=4, block_size=8, layout="HND", kv_fused=True)
    cache = allocate_kv_cache(spec, 3, huge_pages=False)
    t = cache.tensors[0]
    assert tuple(t.shape) == (3, 2, 8, 8)
    t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape))
    want_k, want_v = t.view(3, 2, 16, 4).chunk(2, dim=2)
    k, v = cache.layer_kv(0)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    with pytest.raises(ValueError, match="HND"):
        KVCacheSpec(num_layers=1, num_kv_heads=2, head_size=4, block_size=8, layout="NHD", kv_fused=True)
