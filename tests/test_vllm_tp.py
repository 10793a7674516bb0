"""Different tensor- and pipeline-parallel sizes on the two sides of a real vLLM pair, both ways.

Three vLLM CPU servers run at once, each ``kv_both`` (it prefills for the others and decodes
from them): TP 2, PP 2 (two stages; vLLM 0.32's CPU build runs pipeline parallelism only without
``--enforce-eager``) and TP 1. Every worker is pinned to core 0 (``VLLM_CPU_OMP_THREADS_BIND=0|0``):
vLLM's workers spin while a transfer is pending, and with spinning workers pinned to both cores
the transfer agents waited seconds for a CPU (vLLM reserves cores for its engine and connector;
here core 1 is that, and the agents run there: ``agent_cpus: any``, said here though it is the
default). Four directions: TP 2 -> 1, TP 1 -> 2, PP 2 -> 1 and PP 1 -> 2. In each, every prompt is loaded
(vLLM counts it as external tokens, kvxfer's ranks receive exactly its blocks between them, no
load fails), decode equals what the decode server computes on its own, token for token, and
both pools end empty.

float32: a TP 2 server sums its row-parallel layers in another order than a TP 1 server, so its
KV differs from TP 1's own in the last bits; in bfloat16 that changes a token after a few even
when every byte arrives intact, in float32 not within these prompts.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_vllm import BLOCK, MAX_TOKENS, block_bytes, models, prompts, scrape, vllm_sample, wait_until

from kvxfer.integrations.vllm_pd import VllmServer, disaggregated, free_port, local, token_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
__all__ = ["models"]  # the session's tiny model, shared with test_vllm

DTYPE = "float32"
PROMPTS = [prompts()[0], prompts()[2]]  # 300 tokens (a partial third block) and 77 (one partial block)
# three servers on two cores: steps can take seconds. In one full CI-sized run a decode server took 30 s to
# start a request's load (the logs do not say why), and the prefill's 30 s lease ran out a second before its
# read; the load failed and vLLM recomputed, as it should. The lease here is what such a deployment would set.
TIMEOUTS = {"handshake_s": 5.0, "transfer_s": 60.0, "lease_s": 120.0}


@dataclass
class Server:
    vllm: VllmServer
    metrics_port: int  # kvxfer's endpoint of rank 0; rank r on metrics_port + r
    world: int  # ranks (tp x pp)

    def kvxfer(self) -> dict[str, float]:
        """kvxfer's metrics summed over the server's ranks."""
        out: dict[str, float] = {}
        for r in range(self.world):
            for k, v in scrape(self.metrics_port + r).items():
                out[k] = out.get(k, 0.0) + v
        return out


Servers = dict[str, Server]


def problems(*servers: Server) -> str:
    """kvxfer's warnings and the errors in both servers' logs, for a failure message."""
    return "\n".join(filter(None, (s.vllm.problems() for s in servers))) or "(no kvxfer warning or error in the logs)"


def _free_port_pair() -> int:
    """A free port whose next port is free too (rank 1's metrics endpoint)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports in a row")


@pytest.fixture(scope="module")
def servers(models: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    logs = tmp_path_factory.mktemp("vllm-tp-pp")
    shapes = {  # name: (vLLM arguments, cores, ranks, eager)
        "tp2": (["--tensor-parallel-size", "2"], "0|0", 2, True),
        "pp2": (["--pipeline-parallel-size", "2"], "0|0", 2, False),
        "tp1": ([], "0", 1, True),
    }
    out: Servers = {}
    for name, (args, cpu, world, eager) in shapes.items():
        port = _free_port_pair()
        # the agents go to core 1, the core this deployment keeps free of workers (agent_cpus: any);
        # with agent_cpus: engine, on their workers' core 0 behind three servers' spinning workers, a
        # load failed (session 20)
        cfg = {"connector": {"name": "tcp", "timeouts": TIMEOUTS, "agent_cpus": "any"}, "metrics_port": port}
        out[name] = Server(VllmServer(models[0], free_port(), "both", extra=cfg, dtype=DTYPE, cpu=cpu,
                                      log=logs / f"{name}.log", args=args, eager=eager), port, world)
    try:
        for s in out.values():
            s.vllm.wait_ready()
        yield out
    finally:
        for s in out.values():
            s.vllm.stop()


@pytest.mark.parametrize(("p", "d"), [("tp2", "tp1"), ("tp1", "tp2"), ("pp2", "tp1"), ("tp1", "pp2")])
def test_prompts_load_across_parallel_layouts(servers: Servers, p: str, d: str) -> None:
    ps, ds = servers[p], servers[d]
    before = ds.kvxfer()
    v0 = vllm_sample(ds.vllm, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    for prompt in PROMPTS:
        ref = token_ids(local(ds.vllm.url, prompt, MAX_TOKENS))
        try:
            got = token_ids(disaggregated(ps.vllm.url, ds.vllm.url, prompt, MAX_TOKENS))
        except TimeoutError as e:  # in some CI runs (sessions 6, 17, 25, 26): where both servers stood, and their
            # stacks, without the traceback (a CI log keeps only so much of a failure; sessions 26's lost the workers)
            pytest.fail(f"{len(prompt)}-token prompt, {p} -> {d}: no answer ({e})\n{problems(ps, ds)}\n"
                        f"{ds.vllm.stacks()}\n{ps.vllm.stacks()}", pytrace=False)
        assert got == ref, f"{len(prompt)}-token prompt, {p} -> {d}: decode differs from local\n{problems(ps, ds)}"
    after = ds.kvxfer()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kvxfer_loads_failed_total") == 0, problems(ps, ds)
    assert delta("kvxfer_loads_ok_total") == len(PROMPTS) * ds.world, "every decode rank loaded its part"
    blocks = sum(math.ceil(len(x) / BLOCK) for x in PROMPTS)
    assert delta("kvxfer_bytes_received_total") == blocks * block_bytes(DTYPE), \
        "the decode ranks received exactly the prompts' blocks between them (every layer, every head)"
    external = vllm_sample(ds.vllm, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - v0
    assert external == sum(map(len, PROMPTS)), "vLLM counts every prompt token as loaded from outside"
    assert wait_until(lambda: ps.kvxfer()["kvxfer_held_blocks"] == 0), "the prefill ranks freed every hold"
    assert wait_until(lambda: vllm_sample(ps.vllm, "vllm:kv_cache_usage_perc") == 0.0)
    assert wait_until(lambda: vllm_sample(ds.vllm, "vllm:kv_cache_usage_perc") == 0.0)
