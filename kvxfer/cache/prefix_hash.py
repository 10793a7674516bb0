"""Chained prefix hashes over full blocks of token ids.

The hash of block i covers its tokens and the hash of block i-1, so equal hashes mean
equal prefixes. Two instances agree on hashes when they use the same algorithm and seed
(``cache.hash_algo``, ``cache.hash_seed``), which is what lets a decode instance skip
blocks it already holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import xxhash

from kvxfer.config import HashAlgo


def _root(algo: HashAlgo, seed: int) -> bytes:
    return block_hash(b"", np.zeros(0, dtype=np.int64), algo, seed)


def block_hash(parent: bytes, tokens: np.ndarray, algo: HashAlgo = "xxh3_128", seed: int = 0) -> bytes:
    """Hash of one block's token ids (int64, little endian) chained to ``parent``."""
    data = parent + np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    if algo == "xxh3_128":
        return xxhash.xxh3_128(data, seed=seed).digest()
    if algo == "sha256":
        return hashlib.sha256(seed.to_bytes(8, "little") + data).digest()
    raise ValueError(f"cache.hash_algo: expected 'xxh3_128' or 'sha256', got {algo!r}")


def prefix_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    algo: HashAlgo = "xxh3_128",
    seed: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids`` (a partial tail is not hashed)."""
    tokens = np.asarray(token_ids, dtype="<i8")
    n_full = len(tokens) // block_size
    buf = tokens[: n_full * block_size].tobytes()
    step = block_size * 8
    h = _root(algo, seed) if parent is None else parent
    out = []
    if algo == "xxh3_128":
        digest = xxhash.xxh3_128_digest
        for i in range(n_full):  # each hash needs the previous one: inherently sequential
            h = digest(h + buf[i * step : (i + 1) * step], seed=seed)
            out.append(h)
        return out
    for i in range(n_full):
        h = block_hash(h, tokens[i * block_size : (i + 1) * block_size], algo, seed)
        out.append(h)
    return out
