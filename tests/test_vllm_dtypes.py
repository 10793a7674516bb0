"""An fp8 KV cache, and a model with sliding-window layers, on real vLLM pairs.

Three vLLM CPU servers run at once, all serving a tiny Gemma 2 whose layer 0 slides over 64
tokens and layer 1 attends to all: an fp8_e4m3 pair and an fp8_e5m2 prefill server
(``--kv-cache-dtype``; vLLM's CPU build keeps fp8 in uint8 tensors and needs AVX-512 or AMX).
One set of servers covers both cases (each server start costs CI time); the same Gemma 2 pair
in bfloat16 gave the same results by hand (docs/vllm.md).
- vLLM turns its hybrid KV cache allocator off for a connector without HMA, so every layer,
  sliding or not, keeps the whole prompt's blocks, and kvxfer moves them all: whole blocks,
  bit-exact (one byte an element), decode equal to the decode server's own, token for token.
- fp8_e5m2 into fp8_e4m3: refused at the handshake (``incompatible``, dtypes named); vLLM
  recomputes, the answer is right and the prefill server frees its blocks at once.
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


def _cpu_has_fp8_kernels() -> bool:
    """vLLM's CPU build runs an fp8 KV cache only with AVX-512 or AMX (it raises otherwise)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return True  # not Linux's /proc: let vLLM say
    return bool(flags & {"avx512f", "amx_tile"})


pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not _cpu_has_fp8_kernels(), reason="this CPU has neither AVX-512 nor AMX, which "
                                 "vLLM's CPU build needs for an fp8 KV cache")]

PROMPTS = [prompts()[0], prompts()[2]]  # 300 tokens (beyond the 64-token window, a partial block) and 77
WINDOW = 64
Servers = dict[str, tuple[VllmServer, int]]  # name -> (server, kvxfer metrics port)


def problems(*servers: VllmServer) -> str:
    """kvxfer's warnings and the errors in both servers' logs, for a failure message."""
    return "\n".join(filter(None, (s.problems() for s in servers))) or "(no kvxfer warning or error in the logs)"


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gemma2")
    subprocess.run([sys.executable, str(EXAMPLE / "tiny_model.py"), str(path), "--arch", "gemma2",
                    "--sliding-window", str(WINDOW)], check=True, capture_output=True, timeout=300)
    return path


@pytest.fixture(scope="module")
def servers(gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    logs = tmp_path_factory.mktemp("vllm-dtypes")
    shapes = {  # name: (role, cores, --kv-cache-dtype)
        "e4m3-p": ("prefill", "0", "fp8_e4m3"),
        "e4m3-d": ("decode", "1", "fp8_e4m3"),
        "e5m2-p": ("prefill", "0", "fp8_e5m2"),
    }
    out: Servers = {}
    for name, (role, cpu, cache_dtype) in shapes.items():
        port = free_port()
        out[name] = (VllmServer(gemma, free_port(), role, extra=extra("tcp", port), cpu=cpu,
                                log=logs / f"{name}.log", args=["--kv-cache-dtype", cache_dtype]), port)
    try:
        for s, _ in out.values():
            s.wait_ready()
        yield out
    finally:
        for s, _ in out.values():
            s.stop()


def test_an_fp8_cache_of_a_sliding_window_model_moves_every_layer_whole(servers: Servers) -> None:
    """Layer 0 sees 64 tokens, layer 1 all: with the hybrid allocator off, kvxfer moves both
    layers' blocks of the whole prompt (NixlConnector, with HMA, moves only the window)."""
    (ps, pm), (ds, dm) = servers["e4m3-p"], servers["e4m3-d"]
    assert "Turning off hybrid kv cache manager" in ds.log_path.read_text(errors="replace")
    before = scrape(dm)
    v0 = vllm_sample(ds, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    for prompt in PROMPTS:
        ref = token_ids(local(ds.url, prompt, MAX_TOKENS))
        got = token_ids(disaggregated(ps.url, ds.url, prompt, MAX_TOKENS))
        assert got == ref, f"{len(prompt)}-token prompt: decode after the fp8 transfer differs\n{problems(ps, ds)}"
    after = scrape(dm)
    assert after["kvxfer_loads_failed_total"] - before.get("kvxfer_loads_failed_total", 0) == 0, problems(ps, ds)
    assert after["kvxfer_loads_ok_total"] - before.get("kvxfer_loads_ok_total", 0) == len(PROMPTS)
    blocks = sum(math.ceil(len(x) / BLOCK) for x in PROMPTS)
    assert after["kvxfer_bytes_received_total"] - before.get("kvxfer_bytes_received_total", 0) == \
        blocks * LAYERS * KV_HEADS * 2 * BLOCK * HEAD * 1, "both layers' blocks of every prompt, one byte an element"
    external = vllm_sample(ds, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - v0
    assert external == sum(map(len, PROMPTS)), "every prompt token was loaded, none recomputed"
    assert wait_until(lambda: scrape(pm)["kvxfer_held_blocks"] == 0)
    assert wait_until(lambda: vllm_sample(ps, "vllm:kv_cache_usage_perc") == 0.0)
    assert wait_until(lambda: vllm_sample(ds, "vllm:kv_cache_usage_perc") == 0.0)


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
