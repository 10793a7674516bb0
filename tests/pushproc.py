"""Push-mode rank processes for the transfer tests (real processes, real sockets).

The decode rank reserves blocks and hands back its PushTarget; the prefill rank holds a
streaming hold, is told the target (before, or after some layers), and writes the oracle's
values layer by layer, saving each; the decode rank checks what landed against the oracle.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import msgspec
from kvproc import GARBAGE, _rank, check, fill

from kvxfer.protocol import PushTarget


def push_consumer_main(cfg_json: bytes, rank: int, rid: str, num_tokens: int, local_blocks: list[int], conn: Any,
                       timeout_s: float = 60.0, num_cached_tokens: int = 0) -> None:
    """Reserve, send ("target", bytes), then report ("result", status, detail, layers landed in order,
    stats, when the outcome was seen (time.monotonic: comparable across processes))."""
    try:
        cfg, tp_rank, cache, c = _rank(cfg_json, rank)
        for t in cache.tensors:
            t.fill_(GARBAGE)
        if num_cached_tokens:
            fill(cache, cfg, tp_rank, local_blocks[: num_cached_tokens // cfg.cache.block_size], num_cached_tokens)
        target = c.reserve(rid, local_blocks, num_tokens, num_cached_tokens)
        conn.send(("target", target.to_bytes()))
        landed: list[int] = []
        t0 = time.monotonic()
        result: tuple[Any, ...] = ("hung", None)
        seen_at = 0.0
        while time.monotonic() - t0 < timeout_s:
            f = c.poll(timeout_s=0.01)
            landed += f.layers.get(rid, [])
            seen_at = time.monotonic()
            if rid in f.receiving:
                why = check(cache, cfg, tp_rank, local_blocks, num_tokens)
                result = ("ok" if why is None else "mismatch", why)
                break
            if rid in f.failed:
                untouched = all(bool((t[f.failed[rid]] == GARBAGE).all()) for t in cache.tensors) \
                    if not num_cached_tokens else None
                result = ("failed", (f.failed[rid], f.errors.get(rid, ""), f.codes[rid].value, untouched))
                break
        time.sleep(0.2)  # the done notices go out before closing
        stats = c.stats()
        c.close()
        conn.send(("result", *result, landed, stats, seen_at))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def push_producer_main(cfg_json: bytes, rank: int, conn: Any) -> None:
    """Answer ("push", rid, blocks, ntok, target bytes | None, target after n layers, delay per layer),
    ("target", rid, bytes), ("released",), ("stats",), "stop"."""
    try:
        cfg, tp_rank, cache, c = _rank(cfg_json, rank)
        for t in cache.tensors:
            t.fill_(GARBAGE)
        conn.send(("ready", None))
        released: list[str] = []
        while True:
            if not conn.poll(0.02):
                released.extend(c.poll().sending)
                continue
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd[0] == "released":
                released.extend(c.poll().sending)
                conn.send(("released", list(released)))
            elif cmd[0] == "stats":
                conn.send(("stats", c.stats()))
            elif cmd[0] == "push":
                _, rid, blocks, ntok, raw, after, delay_s = cmd
                c.hold(rid, blocks, ntok, streaming=True)
                target = PushTarget.from_bytes(raw) if raw is not None else None
                if target is not None and after == 0:
                    c.push(rid, target)
                for i, layer in enumerate(cache.spec.layers):
                    write_layer(cache, cfg, tp_rank, blocks, ntok, layer)
                    c.save_layer(rid, layer)
                    if target is not None and after == i + 1:
                        c.push(rid, target)
                    time.sleep(delay_s)
                conn.send(("pushed", None))
        c.close()
        conn.send(("closed", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def write_layer(cache: Any, cfg: Any, tp_rank: int, blocks: list[int], ntok: int, layer: int) -> None:
    """The oracle's values for one layer (what the forward pass of that layer writes)."""
    spec = cache.spec
    one = msgspec.structs.replace(spec, num_layers=1, first_layer=layer)
    view = _LayerView(cache, one, layer)
    fill(view, cfg, tp_rank, blocks, ntok)


class _LayerView:
    """A cache seen as holding one layer (for ``fill``)."""

    def __init__(self, cache: Any, spec: Any, layer: int) -> None:
        self.spec, self._cache, self._layer = spec, cache, layer

    def layer_kv(self, layer: int) -> Any:
        return self._cache.layer_kv(layer)
