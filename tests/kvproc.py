"""Producer and consumer rank processes for the transfer tests (real processes, real sockets).

Every KV value is a known function of (layer, K/V, token, global head, dim), so a consumer
can check what arrived without trusting anything the producer says.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import signal
import time
import traceback
from typing import Any

import msgspec
import torch

from kvxfer.cache import allocate_kv_cache, spec_from_config
from kvxfer.config import InstanceConfig
from kvxfer.connector import Connector
from kvxfer.protocol import KVTransferParams
from kvxfer.topology import ParallelLayout

GARBAGE = -7.0


def value(layer: int, kv: int, tokens: torch.Tensor, heads: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """Exact in float32: distinct per (layer, kv, token, head, dim)."""
    t, h, d = torch.meshgrid(tokens, heads, dims, indexing="ij")
    return (((layer * 2 + kv) * 4096 + t) * 16 + h) * 64 + d + 0.0


def owned_heads(cfg: InstanceConfig, tp_rank: int) -> torch.Tensor:
    lay = ParallelLayout.from_config(cfg)
    return torch.tensor(list(lay.heads_of(tp_rank)))


def blocks_of(tokens: torch.Tensor, block_size: int, layout: str) -> torch.Tensor:
    """[n*block_size, heads, dim] token-major -> [n, *block] in ``layout``."""
    n = tokens.shape[0] // block_size
    b = tokens.reshape(n, block_size, *tokens.shape[1:])
    return b.transpose(1, 2).contiguous() if layout == "HND" else b


def _vec_k(spec: Any, kv: int) -> bool:
    """K of a fused cache in vLLM's CPU "vec" order: each block's K of a head is stored transposed."""
    return bool(spec.kv_fused and spec.fused_order == "vec" and kv == 0)


def fill(cache: Any, cfg: InstanceConfig, tp_rank: int, block_ids: list[int], num_tokens: int,
         first_token: int = 0, garbage_before: int = 0) -> None:
    """Write the oracle's values for tokens [0, num_tokens) into ``block_ids`` (token order);
    positions past the end, and the first ``garbage_before`` tokens, hold GARBAGE."""
    spec = cache.spec
    bs = spec.block_size
    heads = owned_heads(cfg, tp_rank)
    dims = torch.arange(spec.head_size)
    n = len(block_ids)
    tok = torch.arange(first_token, first_token + n * bs)
    ids = torch.tensor(block_ids)
    for layer in spec.layers:
        for kv in range(1 if spec.mla else 2):  # K and V, also when fused in one tensor
            v = value(layer, kv, tok, heads, dims)
            v[tok >= num_tokens] = GARBAGE
            v[tok < garbage_before] = GARBAGE
            view = cache.layer_kv(layer)[kv]
            b = blocks_of(v, bs, spec.layout)
            if _vec_k(spec, kv):  # [n, heads, bs, dim] -> stored as [n, heads, dim, bs]
                b = b.transpose(2, 3).contiguous().view(b.shape)
            view.index_copy_(0, ids, b.to(view.dtype))


def check(cache: Any, cfg: InstanceConfig, tp_rank: int, block_ids: list[int], num_tokens: int) -> str | None:
    """None if the blocks hold exactly the oracle's values for tokens [0, num_tokens)."""
    spec = cache.spec
    bs = spec.block_size
    heads = owned_heads(cfg, tp_rank)
    dims = torch.arange(spec.head_size)
    n = math.ceil(num_tokens / bs)
    ids = torch.tensor(block_ids[:n])
    tok = torch.arange(n * bs)
    for layer in spec.layers:
        for kv in range(1 if spec.mla else 2):  # K and V, also when fused in one tensor
            got = cache.layer_kv(layer)[kv].index_select(0, ids)
            if _vec_k(spec, kv):
                n_, h_, bs_, d_ = got.shape
                got = got.reshape(n_, h_, d_, bs_).transpose(2, 3)
            if spec.layout == "HND":
                got = got.transpose(1, 2)
            got = got.reshape(n * bs, *got.shape[2:])[:num_tokens].float()
            want = value(layer, kv, tok, heads, dims)[:num_tokens]
            if not torch.equal(got, want):
                bad = (got != want).nonzero()[0].tolist()
                return f"layer {layer} kv {kv}: first mismatch at (token, head, dim) {bad}: got " \
                       f"{got[tuple(bad)].item()} want {want[tuple(bad)].item()}"
    return None


def _rank(cfg_json: bytes, rank: int) -> tuple[InstanceConfig, int, Any, Connector]:
    """Config, TP rank, cache and registered connector of one rank process."""
    cfg = msgspec.json.decode(cfg_json, type=InstanceConfig)
    tp_rank, pp_rank = rank % cfg.parallel.tp, rank // cfg.parallel.tp
    cache = allocate_kv_cache(spec_from_config(cfg, pp_rank), cfg.cache.num_blocks)
    c = Connector.from_config(cfg, rank)
    c.register_kv_caches(cache)
    return cfg, tp_rank, cache, c


def producer_main(cfg_json: bytes, rank: int, requests: list[tuple], conn: Any,
                  env: dict[str, str] | None = None, fill_mode: str = "oracle") -> None:
    """Hold the given requests ``(id, blocks, num_tokens[, garbage_before])``, send their params,
    then answer commands until told to stop. ``fill_mode`` "ones" skips the oracle (big caches)."""
    import os

    os.environ.update(env or {})
    if os.environ.get("KVPROC_LOG"):  # the test reads this rank's warnings from a file
        import logging

        logging.basicConfig(filename=os.environ["KVPROC_LOG"], level=logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s", force=True)
    try:
        cfg, tp_rank, cache, c = _rank(cfg_json, rank)
        params = []
        if fill_mode == "ones":
            for t in cache.tensors:
                t.fill_(1)
        for rid, blocks, ntok, *rest in requests:
            if fill_mode == "oracle":
                fill(cache, cfg, tp_rank, blocks, ntok, garbage_before=rest[0] if rest else 0)
            params.append(c.hold(rid, blocks, ntok).to_bytes())
        conn.send(("params", params, c.side_channel_port))
        released: list[str] = []
        while True:
            if conn.poll(0.02):
                cmd = conn.recv()
                if cmd == "stop":
                    break
                if cmd == "released":
                    conn.send(("released", list(released)))
                elif cmd == "stats":
                    conn.send(("stats", c.stats()))
                elif isinstance(cmd, tuple) and cmd[0] == "hold":  # ("hold", rid, blocks, ntok)
                    _, rid, blocks, ntok = cmd
                    if fill_mode == "oracle":
                        fill(cache, cfg, tp_rank, blocks, ntok)
                    conn.send(("params", c.hold(rid, blocks, ntok).to_bytes()))
            released.extend(c.poll().sending)
        c.close()
        conn.send(("closed", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def consumer_main(cfg_json: bytes, rank: int, params_bytes: bytes, local_blocks: list[int], conn: Any,
                  num_cached_tokens: int = 0, wait_s: float = 0.0, timeout_s: float = 60.0,
                  env: dict[str, str] | None = None, signal_first_write: bool = False,
                  use_block_manager: bool = False, local_id: str | None = None,
                  kill_on_first_write: list[int] | None = None, announce_wait: bool = False,
                  with_stats: bool = False) -> None:
    """Load one request, check it against the oracle, report (status, detail, elapsed).

    ``local_id`` is the id this side knows the request by (default: the producer's).

    With ``signal_first_write`` it also says ("writing",) as soon as the first block changes, after
    SIGKILLing the pids in ``kill_on_first_write`` (here, not in the test's process: a kill sent from there
    can land after the last byte on a loaded machine).
    With ``wait_s`` it first queues the request (``Connector.wait``) for that long; with ``announce_wait``
    it says ("waiting", None) once queued.
    With ``use_block_manager`` the blocks come from a BlockManager reservation (``local_blocks``
    is ignored); a failed load is discarded there, and the detail reports the free count.
    With ``with_stats`` a load that arrived intact has the connector's stats as its detail."""
    import os

    os.environ.update(env or {})
    try:
        cfg = msgspec.json.decode(cfg_json, type=InstanceConfig)
        tp_rank, pp_rank = rank % cfg.parallel.tp, rank // cfg.parallel.tp
        params = KVTransferParams.from_bytes(params_bytes)
        cache = allocate_kv_cache(spec_from_config(cfg, pp_rank), cfg.cache.num_blocks)
        if num_cached_tokens:  # a local prefix hit: these blocks already hold the right values
            nb = num_cached_tokens // cfg.cache.block_size
            fill(cache, cfg, tp_rank, local_blocks[:nb], num_cached_tokens)
        c = Connector.from_config(cfg, rank)
        c.register_kv_caches(cache)
        bm = None
        if use_block_manager:
            from kvxfer.cache import BlockManager

            bm = BlockManager.from_config(cfg.cache)
            alloc = bm.reserve(params.request_id, list(range(params.num_tokens)), timeout_s=timeout_s)
            local_blocks = alloc.block_ids
        if wait_s:
            c.wait(params.request_id, params)
            if announce_wait:
                conn.send(("waiting", None))
            time.sleep(wait_s)
        conn.send(("started", None))
        t0 = time.monotonic()
        rid = local_id or params.request_id
        c.start_load(rid, params, local_blocks, num_cached_tokens)
        result: tuple[str, Any, float] | None = None
        first = cache.tensors[0][local_blocks[0]]
        while time.monotonic() - t0 < timeout_s:
            if signal_first_write and bool(first.any()):
                for pid in kill_on_first_write or []:
                    os.kill(pid, signal.SIGKILL)
                conn.send(("writing", None))
                signal_first_write = False
            f = c.poll()
            if rid in f.receiving:
                why = check(cache, cfg, tp_rank, local_blocks, params.num_tokens)
                result = ("ok" if why is None else "mismatch", why, time.monotonic() - t0)
                if why is None and with_stats:
                    result = ("ok", c.stats(), result[2])
                break
            if rid in f.failed:
                invalid = f.failed[rid]
                detail: Any = (invalid, f.errors.get(rid, ""))
                if bm is not None:
                    assert sorted(invalid) == sorted(bm.get(params.request_id).new_block_ids)
                    bm.discard(params.request_id)
                    detail = (invalid, detail[1], bm.num_free_blocks, bm.num_blocks)
                result = ("failed", detail, time.monotonic() - t0)
                break
            time.sleep(0.001 if signal_first_write else 0.005)
        if result is None:
            result = ("hung", None, time.monotonic() - t0)
        time.sleep(0.2)  # let the done notices go out before closing
        c.close()
        conn.send(("result", *result))
    except Exception:
        conn.send(("error", traceback.format_exc(), 0.0))


def consumer_server(cfg_json: bytes, rank: int, conn: Any, env: dict[str, str] | None = None) -> None:
    """A long-lived consumer rank with a BlockManager: ("load", params, timeout_s, verify[,
    announce]) reserves blocks, loads, checks against the oracle (when ``verify``), and commits
    and frees them on success or discards them on failure; answers ("result", status, invalid,
    why, elapsed, error code). With ``announce`` it first says ("writing", None) once the first block changes.
    ("pool",) answers (free, total); ("stats",) the connector's stats; "stop" ends it."""
    import os

    from kvxfer.cache import BlockManager

    os.environ.update(env or {})
    try:
        cfg, tp_rank, cache, c = _rank(cfg_json, rank)
        bm = BlockManager.from_config(cfg.cache)
        conn.send(("ready", None))
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd[0] == "pool":
                conn.send(("pool", (bm.num_free_blocks, bm.num_blocks)))
            elif cmd[0] == "stats":
                conn.send(("stats", c.stats()))
            elif cmd[0] == "load":
                _, raw, timeout_s, verify, *rest = cmd
                announce = bool(rest and rest[0])
                params = KVTransferParams.from_bytes(raw)
                rid = params.request_id
                # distinct token ids per request: no prefix hit between requests
                alloc = bm.reserve(rid, [hash((rid, i)) & 0x7FFFFFFF for i in range(params.num_tokens)],
                                   timeout_s=600, max_cached_tokens=0)
                first = cache.tensors[0][alloc.block_ids[0]]
                first.zero_()
                t0 = time.monotonic()
                c.start_load(rid, params, alloc.block_ids)
                out: tuple[Any, ...] = ("result", "hung", [], "", 0.0, "")
                while time.monotonic() - t0 < timeout_s:
                    f = c.poll(timeout_s=0.001 if announce else 0.05)
                    if announce and bool(first.any()):
                        conn.send(("writing", None))
                        announce = False
                    if rid in f.receiving:
                        why = check(cache, cfg, tp_rank, alloc.block_ids, params.num_tokens) if verify else None
                        bm.commit(rid)
                        bm.free(rid)
                        out = ("result", "ok" if why is None else "mismatch", [], why or "", time.monotonic() - t0,
                               "")
                        break
                    if rid in f.failed:
                        invalid = sorted(f.failed[rid])
                        expected = sorted(bm.get(rid).new_block_ids)
                        bm.discard(rid)
                        status = "failed" if invalid == expected else "failed-wrong-ids"
                        code = f.codes[rid].value if rid in f.codes else ""
                        out = ("result", status, invalid, f.errors.get(rid, ""), time.monotonic() - t0, code)
                        break
                conn.send(out)
        c.close()
        conn.send(("closed", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))


# Rank processes fork from a server process that imported these modules once (a spawned process
# spent about 3 s importing torch and kvxfer, most of a bit-exact test's time). The server only
# imports: no thread, no UCX context, no socket; each rank builds its own, as a spawned one did, and
# gets the environment it needs as an argument (``env``), not from the server's.
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["kvproc", "pushproc", "kvxfer.agent.client", "kvxfer.transfer.consumer",
                            "kvxfer.transfer.producer"])


def start(target: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Run ``target(*args, pipe_end, **kwargs)`` in a fresh process (forked from the server above)."""
    parent, child = CTX.Pipe()
    p = CTX.Process(target=target, args=(*args, child), kwargs=kwargs, daemon=True)
    p.start()
    return p, parent


def recv(conn: Any, timeout: float = 60.0) -> tuple:
    if not conn.poll(timeout):
        raise TimeoutError("child process did not answer")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"child failed:\n{msg[1]}")
    return msg
