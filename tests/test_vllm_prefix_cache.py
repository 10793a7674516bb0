"""A real vLLM pair with vLLM's defaults: prefix caching on, on both servers.

- a prompt whose first blocks the decode server already holds loads only the rest (a partial
  local hit), and one it holds but for its partial last block loads only that block;
- vLLM's ``prompt_tokens_by_source`` split matches what kvxfer moved, tokens are the ones the
  model computes on its own, and both servers' pools return to 0;
- a load that fails frees the prefill server's blocks through the consumer's abandon notice,
  counted as such (``kvxfer_holds_abandoned_total``), not by a lease running out.

References are computed on the prefill server: computing them on the decode server would fill
its prefix cache with the very prompts the test then loads.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_vllm import BLOCK, MAX_TOKENS, block_bytes, extra, log_problems, models, scrape, vllm_sample, wait_until

from kvxfer.integrations.vllm_pd import VllmServer, disaggregated, free_port, local, post, prefill, token_ids

DTYPE = "float32"

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
__all__ = ["models"]  # the session's tiny model, shared with test_vllm


@dataclass
class CachedPair:
    prefill: VllmServer
    decode: VllmServer
    p_metrics: int
    d_metrics: int
    logs: Path


@pytest.fixture(scope="module")
def cached(models: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[CachedPair]:
    logs = tmp_path_factory.mktemp("vllm-prefix-cache")
    pm, dm = free_port(), free_port()
    # float32: on a host with AMX, vLLM 0.32 runs bf16 at block 128 on its amx attention kernel, whose
    # worker died of SIGILL in this test (docs/vllm.md); the vec kernel float32 takes runs on every x86 host
    p = VllmServer(models[0], free_port(), "prefill", extra=extra("tcp", pm), cpu="0", log=logs / "prefill.log",
                   prefix_caching=True, dtype=DTYPE)
    d = VllmServer(models[0], free_port(), "decode", extra=extra("tcp", dm), cpu="1", log=logs / "decode.log",
                   prefix_caching=True, dtype=DTYPE)
    try:
        p.wait_ready()
        d.wait_ready()
        yield CachedPair(p, d, pm, dm, logs)
    finally:
        p.stop()
        d.stop()


def by_source(server: VllmServer) -> dict[str, float]:
    return {s: vllm_sample(server, "vllm:prompt_tokens_by_source_total", source=s)
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def test_local_prefix_hits_load_only_the_rest(cached: CachedPair) -> None:
    rng = random.Random(11)
    a = [rng.randrange(3, 1000) for _ in range(300)]  # 2 full blocks and a partial one
    b = a[: 2 * BLOCK] + [rng.randrange(3, 1000) for _ in range(100)]  # shares a's 2 full blocks
    refs = {"a": token_ids(local(cached.prefill.url, a, MAX_TOKENS)),
            "b": token_ids(local(cached.prefill.url, b, MAX_TOKENS))}
    # (prompt, tokens vLLM finds in the decode server's own cache, tokens kvxfer loads)
    cases = [("a", a, 0, 300), ("b", b, 2 * BLOCK, 100), ("a", a, 2 * BLOCK, 300 - 2 * BLOCK)]
    for name, prompt, hit, loaded in cases:
        v0, k0 = by_source(cached.decode), scrape(cached.d_metrics)
        got = token_ids(disaggregated(cached.prefill.url, cached.decode.url, prompt, MAX_TOKENS))
        assert got == refs[name], f"prompt {name} ({hit} tokens cached): decode differs from the model's own"
        v1, k1 = by_source(cached.decode), scrape(cached.d_metrics)
        assert v1["local_cache_hit"] - v0["local_cache_hit"] == hit, log_problems(cached.logs)
        assert v1["external_kv_transfer"] - v0["external_kv_transfer"] == loaded, log_problems(cached.logs)
        assert v1["local_compute"] == v0["local_compute"], "nothing of the prompt was recomputed"
        blocks = math.ceil(len(prompt) / BLOCK) - hit // BLOCK
        assert k1["kvxfer_bytes_received_total"] - k0.get("kvxfer_bytes_received_total", 0) == \
            blocks * block_bytes(DTYPE), f"prompt {name}: only the blocks not cached crossed"
    assert wait_until(lambda: vllm_sample(cached.prefill, "vllm:kv_cache_usage_perc") == 0.0)
    assert wait_until(lambda: vllm_sample(cached.decode, "vllm:kv_cache_usage_perc") == 0.0)
    assert scrape(cached.p_metrics)["kvxfer_holds_done_total"] >= len(cases)


def test_a_failed_load_frees_the_prefill_blocks_by_abandon(cached: CachedPair) -> None:
    rng = random.Random(12)
    prompt = [rng.randrange(3, 1000) for _ in range(200)]
    ref = token_ids(local(cached.prefill.url, prompt, MAX_TOKENS))
    p0 = scrape(cached.p_metrics)
    params = prefill(cached.prefill.url, prompt)
    lie = copy.deepcopy(params)
    lie["kvxfer"]["block_size"] = BLOCK // 2  # the decode side refuses to plan it: the load fails
    out = post(cached.decode.url + "/v1/completions",
               {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": lie})
    assert token_ids(out) == ref, "the failed load was recomputed on the decode side"

    def freed() -> bool:
        m = scrape(cached.p_metrics)
        abandoned = m["kvxfer_holds_abandoned_total"] - p0["kvxfer_holds_abandoned_total"]
        return m["kvxfer_held_blocks"] == 0 and abandoned == 1

    assert wait_until(freed), (f"the prefill side frees the hold on the consumer's abandon: {p0} -> "
                               f"{scrape(cached.p_metrics)}\n{log_problems(cached.logs)}")
    assert scrape(cached.p_metrics)["kvxfer_holds_expired_total"] == p0["kvxfer_holds_expired_total"], \
        "not by a lease running out"
    assert wait_until(lambda: vllm_sample(cached.prefill, "vllm:kv_cache_usage_perc") == 0.0)
    assert vllm_sample(cached.decode, "vllm:kv_cache_usage_perc") == 0.0
