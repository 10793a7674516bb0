"""Repack against a token-level oracle: token t, head h, dim d has a known value.

Every layout pair, block-size ratios 1/4..4, float32 / bfloat16 / uint8, non-contiguous
block id lists, and a last block only partly filled (with stale bytes past the end on
the sending side, which must not leak)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from kvxfer.repack import (
    blocks_to_receive,
    expand_block_ids,
    head_slice_ranges,
    place_heads,
    repack_inplace,
    to_local,
)

H, D = 3, 5  # odd sizes so a transposed view can never pass by accident
REMOTE_BS = 16
LOCAL_BS = [4, 8, 16, 32, 64]  # ratios 1/4 .. 4
DTYPES = [torch.float32, torch.bfloat16, torch.uint8]
LAYOUTS = ["NHD", "HND"]


def value(t: torch.Tensor, h: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:  # unique per (t, h, d), exact in float32
        v = (t * 1000 + h * 10 + d + 1).to(torch.float32)
    else:  # 1..251: exact in bfloat16 and uint8
        v = ((t * 37 + h * 11 + d * 3) % 251 + 1).to(torch.float32)
    return v.to(dtype)


def oracle_tokens(num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    t, h, d = torch.meshgrid(torch.arange(num_tokens), torch.arange(H), torch.arange(D), indexing="ij")
    return value(t, h, d, dtype)


def blocks_from_tokens(tokens: torch.Tensor, block_size: int, layout: str, fill: float = 0) -> torch.Tensor:
    """Oracle blocks in ``layout``; positions past the tokens hold ``fill``."""
    n = math.ceil(len(tokens) / block_size)
    out = torch.full((n * block_size, H, D), fill).to(tokens.dtype)
    out[: len(tokens)] = tokens
    out = out.view(n, block_size, H, D)
    return out.transpose(1, 2).contiguous() if layout == "HND" else out


CASES = list(itertools.product(LAYOUTS, LAYOUTS, LOCAL_BS, DTYPES))


@pytest.mark.parametrize(("remote_layout", "local_layout", "local_bs", "dtype"), CASES)
@pytest.mark.parametrize("num_tokens", [REMOTE_BS * 4, REMOTE_BS * 4 - 5, 3])
def test_to_local(remote_layout: str, local_layout: str, local_bs: int, dtype: torch.dtype,
                  num_tokens: int) -> None:
    tokens = oracle_tokens(num_tokens, dtype)
    remote = blocks_from_tokens(tokens, REMOTE_BS, remote_layout, fill=7)  # stale bytes past the end
    got = to_local(remote, remote_layout=remote_layout, local_layout=local_layout,
                   remote_block_size=REMOTE_BS, local_block_size=local_bs, num_tokens=num_tokens)
    assert torch.equal(got, blocks_from_tokens(tokens, local_bs, local_layout, fill=0))
    assert got.dtype == dtype


def test_to_local_default_keeps_every_remote_position() -> None:
    tokens = oracle_tokens(2 * REMOTE_BS, torch.float32)
    remote = blocks_from_tokens(tokens, REMOTE_BS, "HND")
    got = to_local(remote, remote_layout="HND", local_layout="NHD", remote_block_size=REMOTE_BS,
                   local_block_size=64)
    assert got.shape == (1, 64, H, D)  # ceil(2*16/64) blocks, zero past the last remote token
    assert torch.equal(got.view(64, H, D)[:32], tokens) and torch.count_nonzero(got.view(64, H, D)[32:]) == 0


def write_as_data_plane(cache: torch.Tensor, ids: list[int], remote: torch.Tensor, remote_layout: str,
                        num_tokens: int) -> None:
    """What the transfer core's descriptors do: the remote bytes, back to back, into the
    listed blocks' bytes in list order (NHD: only the tokens that exist; HND: whole blocks)."""
    data = remote.contiguous().view(-1)
    if remote_layout == "NHD":
        data = data[: num_tokens * H * D]
    per_block = cache[0].numel()
    for i, b in enumerate(ids):
        chunk = data[i * per_block : (i + 1) * per_block]
        if len(chunk):
            cache[b].view(-1)[: len(chunk)] = chunk


@pytest.mark.parametrize(("remote_layout", "local_layout", "local_bs", "dtype"), CASES)
@pytest.mark.parametrize("num_tokens", [REMOTE_BS * 4, REMOTE_BS * 4 - 5, 3])
@pytest.mark.parametrize("chunk_bytes", [1 << 22, 1], ids=["one-chunk", "smallest-chunks"])
def test_repack_inplace(remote_layout: str, local_layout: str, local_bs: int, dtype: torch.dtype,
                        num_tokens: int, chunk_bytes: int) -> None:
    tokens = oracle_tokens(num_tokens, dtype)
    remote = blocks_from_tokens(tokens, REMOTE_BS, remote_layout, fill=9)  # stale bytes past the end
    num_blocks = 40
    shape = (local_bs, H, D) if local_layout == "NHD" else (H, local_bs, D)
    gen = torch.Generator().manual_seed(num_tokens)
    cache = torch.randint(1, 200, (num_blocks, *shape), generator=gen).to(dtype)  # garbage everywhere
    before = cache.clone()
    need = blocks_to_receive(num_tokens, remote_layout=remote_layout, remote_block_size=REMOTE_BS,
                             local_block_size=local_bs)
    ids = torch.randperm(num_blocks, generator=gen)[:need].tolist()  # non-contiguous, unordered
    write_as_data_plane(cache, ids, remote, remote_layout, num_tokens)
    used = repack_inplace(cache, ids, remote_layout=remote_layout, local_layout=local_layout,
                          remote_block_size=REMOTE_BS, local_block_size=local_bs, num_tokens=num_tokens,
                          chunk_bytes=chunk_bytes)
    assert used == math.ceil(num_tokens / local_bs)
    expect = blocks_from_tokens(tokens, local_bs, local_layout, fill=0)
    assert torch.equal(cache[ids[:used]], expect)
    assert torch.count_nonzero(cache[ids[used:]].float()) == 0  # spare blocks are zeroed
    others = sorted(set(range(num_blocks)) - set(ids))
    assert torch.equal(cache[others], before[others])  # nothing else touched


def test_hnd_remote_with_larger_blocks_needs_whole_blocks() -> None:
    assert blocks_to_receive(20, remote_layout="HND", remote_block_size=64, local_block_size=16) == 4
    assert blocks_to_receive(20, remote_layout="NHD", remote_block_size=64, local_block_size=16) == 2
    cache = torch.zeros(8, 16, H, D)
    with pytest.raises(ValueError, match="need 4 local blocks of 16, got 2"):
        repack_inplace(cache, [0, 1], remote_layout="HND", local_layout="NHD", remote_block_size=64,
                       local_block_size=16, num_tokens=20)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(remote_layout="NDH"), "remote_layout: expected 'NHD' or 'HND', got 'NDH'"),
        (dict(local_layout="X"), "local_layout: expected 'NHD' or 'HND', got 'X'"),
        (dict(local_block_size=24), "do not divide one another: remote 16, local 24"),
        (dict(remote_block_size=0), "remote_block_size: expected an int >= 1, got 0"),
        (dict(remote_block_size=8), r"holds 16 tokens per block, expected remote_block_size=8"),
        (dict(num_tokens=100), r"num_tokens: expected 0 <= num_tokens <= 32, got 100"),
    ],
)
def test_to_local_refusals(kwargs: dict, match: str) -> None:
    args = dict(remote_layout="NHD", local_layout="HND", remote_block_size=16, local_block_size=16,
                num_tokens=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        to_local(torch.zeros(2, 16, H, D), **args)
    with pytest.raises(ValueError, match="expected \\[n, \\*block_shape\\] \\(4-d\\)"):
        to_local(torch.zeros(16, H, D), remote_layout="NHD", local_layout="NHD", remote_block_size=16,
                 local_block_size=16)


def test_repack_refusals_change_nothing() -> None:
    cache = torch.arange(8 * 16 * H * D, dtype=torch.float32).view(8, 16, H, D)
    before = cache.clone()
    common = dict(remote_layout="HND", local_layout="NHD", remote_block_size=16, local_block_size=16)
    for ids, n, match in [
        ([0, 9], 20, r"block_ids: expected ids in \[0, 8\)"),
        ([1, 1], 20, "ids repeat"),
        ([], 20, "non-empty"),
        ([0], 20, "need 2 local blocks of 16, got 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            repack_inplace(cache, ids, num_tokens=n, **common)
    with pytest.raises(ValueError, match="holds 16 tokens per block, expected local_block_size=32"):
        repack_inplace(cache, [0], num_tokens=4, **{**common, "local_block_size": 32})
    with pytest.raises(ValueError, match="contiguous"):
        repack_inplace(cache.transpose(1, 2), [0], num_tokens=4, **{**common, "local_layout": "HND"})
    assert torch.equal(cache, before)


def test_expand_block_ids() -> None:
    assert expand_block_ids([3, 0, 7], 4).tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 28, 29, 30, 31]
    assert expand_block_ids(np.array([2, 5]), 2, skip=3).tolist() == [11]
    assert expand_block_ids([], 4).tolist() == []
    assert expand_block_ids([1], 1).tolist() == [1]
    for bad, match in [(dict(factor=0), "factor"), (dict(skip=9), "skip"), (dict(block_ids=[-1]), ">= 0")]:
        args = dict(block_ids=[1, 2], factor=4, skip=0)
        args.update(bad)
        with pytest.raises(ValueError, match=match):
            expand_block_ids(**args)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_slices_gather_a_block_from_several_remote_ranks(layout: str, dtype: torch.dtype) -> None:
    """Local TP 1 reads heads [0,2) from one remote rank and [2,3) from another: placing each
    contribution by bytes (head_slice_ranges) or by tensor (place_heads) gives the same block."""
    bs, heads = 8, H
    tokens = oracle_tokens(2 * bs, dtype)
    full = blocks_from_tokens(tokens, bs, layout)  # what the local blocks must end up holding
    hd = 2 if layout == "NHD" else 1
    parts = [(range(0, 2), full.narrow(hd, 0, 2).contiguous()),
             (range(2, 3), full.narrow(hd, 2, 1).contiguous())]
    by_tensor = torch.zeros_like(full)
    by_bytes = torch.zeros_like(full)
    item = full.element_size()
    for local_heads, part in parts:
        place_heads(by_tensor, part, layout=layout, local_heads=local_heads)
        offsets, length = head_slice_ranges(layout, bs, heads, D, item, local_heads)
        assert len(offsets) == (1 if layout == "HND" else bs)
        src_off, src_len = head_slice_ranges(layout, bs, len(local_heads), D, item, range(len(local_heads)))
        assert src_len == length
        for b in range(full.shape[0]):
            dst = by_bytes[b].view(-1).view(torch.uint8)
            src = part[b].view(-1).view(torch.uint8)
            for do, so in zip(offsets.tolist(), src_off.tolist(), strict=True):
                dst[do : do + length] = src[so : so + length]
    assert torch.equal(by_tensor, full)
    assert torch.equal(by_bytes, full)


def test_place_heads_refusals() -> None:
    dst = torch.zeros(2, 8, 4, D)
    with pytest.raises(ValueError, match="dtype mismatch"):
        place_heads(dst, torch.zeros(2, 8, 2, D, dtype=torch.float64), layout="NHD", local_heads=range(0, 2))
    with pytest.raises(ValueError, match="does not fit heads"):
        place_heads(dst, torch.zeros(2, 8, 2, D), layout="NHD", local_heads=range(3, 5))
    with pytest.raises(ValueError, match="does not fit heads"):
        place_heads(dst, torch.zeros(2, 8, 2, D), layout="HND", local_heads=range(0, 2))
    with pytest.raises(ValueError, match="heads: expected a range within"):
        head_slice_ranges("NHD", 8, 4, D, 4, range(2, 6))
