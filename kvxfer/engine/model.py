"""A small decoder-only transformer over a paged KV cache: the reference engine's model.

RMSNorm, rotary positions, grouped-query attention whose K/V live in cache blocks addressed
by a block table, a SwiGLU MLP, greedy sampling. Every weight is drawn from a generator
seeded by (model seed, weight name), for the whole model; a tensor-parallel rank slices its
part out of the full tensor, so any TP/PP layout computes the same function. float32 by
default; float64 when the run must be bit-stable across different all-reduce orders.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from kvxfer.cache.tensors import KVCache
from kvxfer.config import ModelConfig
from kvxfer.topology import ParallelLayout

DTYPES = {"float32": torch.float32, "float64": torch.float64}
EPS = 1e-6


def _weight(seed: int, name: str, shape: tuple[int, ...], fan_in: int, dtype: torch.dtype) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return (torch.randn(shape, generator=g, dtype=torch.float64) / math.sqrt(fan_in)).to(dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dim of ``x`` [T, H, D] by position."""
    d = x.shape[-1]
    half = d // 2
    inv = 1.0 / (theta ** (torch.arange(half, dtype=torch.float64) / half))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    a, b = x[..., :half], x[..., half : 2 * half]
    return torch.cat([a * cos - b * sin, a * sin + b * cos, x[..., 2 * half :]], dim=-1)


class Span(NamedTuple):
    """New tokens of one request in a batch: their positions (the last of a context of
    ``context_len`` tokens) and the request's block table."""

    positions: torch.Tensor
    block_table: torch.Tensor
    context_len: int


class Transformer:
    """The layers of one (tp rank, pp stage) of the model; ``all_reduce`` sums across TP ranks."""

    def __init__(self, cfg: ModelConfig, layout: ParallelLayout, tp_rank: int = 0, pp_rank: int = 0,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if cfg.head_size % 2:
            raise ValueError(f"model.head_size: expected an even size for rotary positions, got {cfg.head_size}")
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.layers = layout.layers_of(pp_rank)
        self.first_stage = pp_rank == 0
        self.last_stage = pp_rank == layout.pp_size - 1
        tp = layout.tp_size
        self.all_reduce = all_reduce or (lambda x: x)
        self.q_heads = cfg.num_heads // tp
        self.kv_heads_global = list(layout.heads_of(tp_rank))
        self.kv_heads = len(self.kv_heads_global)
        self.group = cfg.num_heads // cfg.num_kv_heads  # q heads per kv head
        q0 = tp_rank * self.q_heads
        self.q_slice = slice(q0, q0 + self.q_heads)
        inter = cfg.intermediate_size // tp
        i0 = tp_rank * inter
        h, d, s, dt = cfg.hidden_size, cfg.head_size, cfg.seed, self.dtype
        self.embed = _weight(s, "embed", (cfg.vocab_size, h), 1, dt) if self.first_stage else None
        self.final_norm = torch.ones(h, dtype=dt)
        self.lm_head = _weight(s, "lm_head", (h, cfg.vocab_size), h, dt) if self.last_stage else None
        self.w: dict[int, dict[str, torch.Tensor]] = {}
        for layer in self.layers:
            p = f"layer{layer}."
            wq = _weight(s, p + "wq", (h, cfg.num_heads, d), h, dt)[:, self.q_slice]
            wk = _weight(s, p + "wk", (h, cfg.num_kv_heads, d), h, dt)[:, self.kv_heads_global]
            wv = _weight(s, p + "wv", (h, cfg.num_kv_heads, d), h, dt)[:, self.kv_heads_global]
            wo = _weight(s, p + "wo", (cfg.num_heads, d, h), cfg.num_heads * d, dt)[self.q_slice]
            self.w[layer] = {
                "wq": wq.reshape(h, -1).contiguous(), "wk": wk.reshape(h, -1).contiguous(),
                "wv": wv.reshape(h, -1).contiguous(), "wo": wo.reshape(-1, h).contiguous(),
                "gate": _weight(s, p + "gate", (h, cfg.intermediate_size), h, dt)[:, i0 : i0 + inter].contiguous(),
                "up": _weight(s, p + "up", (h, cfg.intermediate_size), h, dt)[:, i0 : i0 + inter].contiguous(),
                "down": _weight(s, p + "down", (cfg.intermediate_size, h), cfg.intermediate_size,
                                dt)[i0 : i0 + inter].contiguous(),
                "attn_norm": torch.ones(h, dtype=dt), "mlp_norm": torch.ones(h, dtype=dt),
            }

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.embed is not None
        return self.embed[tokens]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None
        return rms_norm(hidden, self.final_norm) @ self.lm_head

    def forward_layers(self, hidden: list[torch.Tensor], spans: list[Span], cache: KVCache,
                       after_layer: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """Run this stage's layers for a batch of requests (``hidden[i]``: the new tokens of
        ``spans[i]``); write each one's K/V into its blocks, attend over its own context.

        Each request is computed on its own, so its numbers do not depend on what it is batched
        with (a batched matmul may round differently); the all-reduce, an elementwise sum, is
        one per sublayer for the whole batch. ``after_layer(layer)`` runs once a layer's K/V of
        every request is written (push mode saves the layer there, while the next one computes)."""
        d, theta = self.cfg.head_size, self.cfg.rope_theta
        bs = cache.spec.block_size
        nhd = cache.spec.layout == "NHD"
        for layer in self.layers:
            w = self.w[layer]
            kc, vc = cache.layer_kv(layer)
            assert vc is not None
            outs = []
            for h, s in zip(hidden, spans, strict=True):
                t = len(s.positions)
                x = rms_norm(h, w["attn_norm"])
                q = rotary((x @ w["wq"]).view(t, self.q_heads, d), s.positions, theta)
                k = rotary((x @ w["wk"]).view(t, self.kv_heads, d), s.positions, theta)
                v = (x @ w["wv"]).view(t, self.kv_heads, d)
                blk, off = s.block_table[s.positions // bs], s.positions % bs
                table = s.block_table[: -(-s.context_len // bs)]
                if nhd:
                    kc[blk, off], vc[blk, off] = k.to(kc.dtype), v.to(vc.dtype)
                    kb, vb = kc[table], vc[table]
                else:
                    kc[blk, :, off], vc[blk, :, off] = k.to(kc.dtype), v.to(vc.dtype)
                    kb, vb = kc[table].transpose(1, 2), vc[table].transpose(1, 2)
                keys = kb.reshape(-1, self.kv_heads, d)[: s.context_len].to(self.dtype)
                vals = vb.reshape(-1, self.kv_heads, d)[: s.context_len].to(self.dtype)
                outs.append(self._attention(q, keys, vals, s.positions).reshape(t, -1) @ w["wo"])
            if after_layer is not None:  # every request's K/V of this layer is in its blocks
                after_layer(layer)
            hidden = [h + o for h, o in zip(hidden, self._reduce(outs), strict=True)]
            outs = []
            for h in hidden:
                x = rms_norm(h, w["mlp_norm"])
                outs.append((torch.nn.functional.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"])
            hidden = [h + o for h, o in zip(hidden, self._reduce(outs), strict=True)]
        return hidden

    def _reduce(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """One all-reduce over the TP ranks for every request's partial sums."""
        if len(parts) == 1:
            return [self.all_reduce(parts[0])]
        return list(self.all_reduce(torch.cat(parts)).split([len(p) for p in parts]))

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
        """Causal GQA: new queries [T, Hq, D] over the context [N, Hkv, D]."""
        d = q.shape[-1]
        # each local q head uses the kv head it maps to globally
        q_global = torch.arange(self.q_slice.start, self.q_slice.stop)
        kv_global = q_global // self.group
        kv_index = torch.tensor([self.kv_heads_global.index(int(g)) for g in kv_global])
        k = keys[:, kv_index]  # [N, Hq, D]
        v = vals[:, kv_index]
        scores = torch.einsum("thd,nhd->htn", q, k) / math.sqrt(d)
        n = keys.shape[0]
        mask = torch.arange(n)[None, :] > positions[:, None]  # [T, N]
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("htn,nhd->thd", probs, v)
