"""Different block sizes on the two sides of a real vLLM pair, both directions.

vLLM's CPU kernels keep each block's K transposed (``[head_size][block_size]``), so a block
cannot be cut by bytes: kvxfer stages the prefill side's blocks whole and re-cuts them into
the decode side's block size (``fused_order: vec``). Four servers run at once: prefill at 64
and 128 tokens a block, decode at 64 and 128; each direction loads every prompt (no
recomputation), decodes exactly what the decode server computes on its own, and frees both
pools.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_vllm import MAX_TOKENS, PROMPT_LENS, extra, models, prompts, scrape, vllm_sample, wait_until

from kvxfer.integrations.vllm_pd import VllmServer, disaggregated, free_port, local, token_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
Servers = dict[str, tuple[VllmServer, int]]  # name -> (server, kvxfer metrics port)
__all__ = ["models"]  # the session's tiny model, shared with test_vllm


@pytest.fixture(scope="module")
def servers(models: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    logs = tmp_path_factory.mktemp("vllm-block-sizes")
    out: Servers = {}
    for name, role, bs, cpu in (("p64", "prefill", 64, "0"), ("p128", "prefill", 128, "0"),
                                ("d64", "decode", 64, "1"), ("d128", "decode", 128, "1")):
        port = free_port()
        # float32: the vec kernel on every x86 host (bf16 at these block sizes takes the amx kernel where the
        # host has AMX: another order inside a block, which kvxfer refuses to re-cut; docs/vllm.md)
        out[name] = (VllmServer(models[0], free_port(), role, extra=extra("tcp", port), cpu=cpu, dtype="float32",
                                log=logs / f"{name}.log", args=["--block-size", str(bs)]), port)
    try:
        for s, _ in out.values():
            s.wait_ready()
        yield out
    finally:
        for s, _ in out.values():
            s.stop()


@pytest.mark.parametrize(("p", "d"), [("p64", "d128"), ("p128", "d64")])
def test_prompts_load_across_block_sizes(servers: Servers, p: str, d: str) -> None:
    (ps, pm), (ds, dm) = servers[p], servers[d]
    before = scrape(dm)
    v0 = vllm_sample(ds, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    for prompt in prompts():
        ref = token_ids(local(ds.url, prompt, MAX_TOKENS))
        got = token_ids(disaggregated(ps.url, ds.url, prompt, MAX_TOKENS))
        assert got == ref, f"{len(prompt)}-token prompt, {p} -> {d}: decode differs from local"
    after = scrape(dm)
    assert after["kvxfer_loads_failed_total"] - before.get("kvxfer_loads_failed_total", 0) == 0, ds.errors()
    assert after["kvxfer_loads_ok_total"] - before.get("kvxfer_loads_ok_total", 0) == len(PROMPT_LENS)
    external = vllm_sample(ds, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - v0
    assert external == sum(PROMPT_LENS), "every prompt token was loaded, none recomputed"
    assert wait_until(lambda: scrape(pm)["kvxfer_held_blocks"] == 0)
    assert wait_until(lambda: vllm_sample(ps, "vllm:kv_cache_usage_perc") == 0.0)
    assert wait_until(lambda: vllm_sample(ds, "vllm:kv_cache_usage_perc") == 0.0)
