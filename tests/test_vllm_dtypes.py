"""KV caches other than the model's dtype and models with sliding-window layers, on real vLLM pairs.

Five vLLM CPU servers run at once: an fp8_e4m3 pair and an fp8_e5m2 prefill server
(``--kv-cache-dtype``; vLLM's CPU build keeps fp8 in uint8 tensors and needs AVX-512 or AMX),
and a pair serving a tiny Gemma 2 whose layer 0 slides over 64 tokens and layer 1 attends to all.
- fp8: blocks move whole, bit-exact (one byte an element), decode equals the decode server's own.
- fp8_e5m2 into fp8_e4m3: refused at the handshake (``incompatible``, dtypes named); vLLM
  recomputes, the answer is right and the prefill server frees its blocks at once.
- sliding window: vLLM turns its hybrid KV cache allocator off for a connector without HMA, so
  every layer keeps (and kvxfer moves) the whole prompt's blocks; decode equals local.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_vllm import (
    BLOCK,
    EXAMPLE,
    HEAD,
    KV_HEADS,
    LAYERS,
    MAX_TOKENS,
    extra,
    models,
    prompts,
    scrape,
    vllm_sample,
    wait_until,
)

from kvxfer.integrations.vllm_pd import (
    VllmServer,
    completion_body,
    disaggregated,
    free_port,
    local,
    post,
    prefill,
    prometheus_samples,
    token_ids,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
__all__ = ["models"]  # the session's tiny Llama, shared with test_vllm

PROMPTS = [prompts()[0], prompts()[2]]  # 300 tokens (beyond the 64-token window, a partial block) and 77
WINDOW = 64
Servers = dict[str, tuple[VllmServer, int]]  # name -> (server, kvxfer metrics port)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gemma2")
    subprocess.run([sys.executable, str(EXAMPLE / "tiny_model.py"), str(path), "--arch", "gemma2",
                    "--sliding-window", str(WINDOW)], check=True, capture_output=True, timeout=300)
    return path


@pytest.fixture(scope="module")
def servers(models: dict[int, Path], gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    logs = tmp_path_factory.mktemp("vllm-dtypes")
    shapes = {  # name: (model, role, cores, vLLM arguments)
        "e4m3-p": (models[0], "prefill", "0", ["--kv-cache-dtype", "fp8_e4m3"]),
        "e4m3-d": (models[0], "decode", "1", ["--kv-cache-dtype", "fp8_e4m3"]),
        "e5m2-p": (models[0], "prefill", "0", ["--kv-cache-dtype", "fp8_e5m2"]),
        "swa-p": (gemma, "prefill", "0", []),
        "swa-d": (gemma, "decode", "1", []),
    }
    out: Servers = {}
    for name, (model, role, cpu, args) in shapes.items():
        port = free_port()
        out[name] = (VllmServer(model, free_port(), role, extra=extra("tcp", port), cpu=cpu,
                                log=logs / f"{name}.log", args=args), port)
    try:
        for s, _ in out.values():
            s.wait_ready()
        yield out
    finally:
        for s, _ in out.values():
            s.stop()


def _load_all(servers: Servers, p: str, d: str, element_bytes: int) -> None:
    """Every prompt from ``p`` to ``d``: decode equals local, every block loaded whole, pools back to 0."""
    (ps, pm), (ds, dm) = servers[p], servers[d]
    before = scrape(dm)
    v0 = vllm_sample(ds, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    for prompt in PROMPTS:
        ref = token_ids(local(ds.url, prompt, MAX_TOKENS))
        got = token_ids(disaggregated(ps.url, ds.url, prompt, MAX_TOKENS))
        assert got == ref, f"{len(prompt)}-token prompt, {p} -> {d}: decode differs from local\n{ds.errors()}"
    after = scrape(dm)
    assert after["kvxfer_loads_failed_total"] - before.get("kvxfer_loads_failed_total", 0) == 0, ds.errors()
    assert after["kvxfer_loads_ok_total"] - before.get("kvxfer_loads_ok_total", 0) == len(PROMPTS)
    blocks = sum(math.ceil(len(x) / BLOCK) for x in PROMPTS)
    assert after["kvxfer_bytes_received_total"] - before.get("kvxfer_bytes_received_total", 0) == \
        blocks * LAYERS * KV_HEADS * 2 * BLOCK * HEAD * element_bytes, "every layer's blocks of every prompt, whole"
    external = vllm_sample(ds, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - v0
    assert external == sum(map(len, PROMPTS)), "every prompt token was loaded, none recomputed"
    assert wait_until(lambda: scrape(pm)["kvxfer_held_blocks"] == 0)
    assert wait_until(lambda: vllm_sample(ps, "vllm:kv_cache_usage_perc") == 0.0)
    assert wait_until(lambda: vllm_sample(ds, "vllm:kv_cache_usage_perc") == 0.0)


def test_an_fp8_cache_moves_bit_exact(servers: Servers) -> None:
    _load_all(servers, "e4m3-p", "e4m3-d", element_bytes=1)


def test_another_fp8_format_is_refused_and_recomputed(servers: Servers) -> None:
    (ps, pm), (ds, dm) = servers["e5m2-p"], servers["e4m3-d"]

    def refused() -> float:
        return sum(v for k, v in prometheus_samples(f"http://127.0.0.1:{dm}/metrics").items()
                   if k.startswith("kvxfer_loads_failed_by_code_total") and 'code="incompatible"' in k)

    r0, b0 = refused(), scrape(dm).get("kvxfer_bytes_received_total", 0)
    prompt = PROMPTS[1]
    ref = token_ids(local(ds.url, prompt, MAX_TOKENS))
    params = prefill(ps.url, prompt)
    assert wait_until(lambda: scrape(pm)["kvxfer_held_blocks"] > 0), "the e5m2 server holds the prompt"
    got = token_ids(post(ds.url + "/v1/completions", completion_body(prompt, MAX_TOKENS, params)))
    assert got == ref, "the refused load was recomputed with the decode server's own cache"
    assert refused() == r0 + 1, "refused at the handshake as incompatible"
    assert scrape(dm)["kvxfer_bytes_received_total"] == b0, "no byte of the other fp8 format landed"
    assert "dtype: local 'fp8_e4m3', remote 'fp8_e5m2'" in ds.log_path.read_text(errors="replace")
    # the decode side abandoned the hold: the prefill server frees it now, not a lease (30 s) later
    assert wait_until(lambda: scrape(pm)["kvxfer_held_blocks"] == 0, timeout_s=10.0)
    assert wait_until(lambda: vllm_sample(ps, "vllm:kv_cache_usage_perc") == 0.0, timeout_s=10.0)
    assert vllm_sample(ds, "vllm:kv_cache_usage_perc") == 0.0


def test_a_sliding_window_model_moves_every_layer_whole(servers: Servers) -> None:
    """Gemma 2's layer 0 sees 64 tokens, layer 1 all: with the hybrid allocator off, kvxfer moves
    both layers' blocks of the whole prompt (NixlConnector, with HMA, moves only the window)."""
    ds, _ = servers["swa-d"]
    assert "Turning off hybrid kv cache manager" in ds.log_path.read_text(errors="replace")
    _load_all(servers, "swa-p", "swa-d", element_bytes=2)
