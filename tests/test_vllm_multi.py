"""More than one vLLM instance per side, behind the example proxy (round robin).

Two prefill and two decode servers run at once; one proxy spreads requests over both prefill
servers and one decode server (2P1D), another over one prefill server and both decode servers
(1P2D). Concurrent requests through each give the tokens the model computes on its own, every
server of the set takes part, no load fails, and every pool returns to 0.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_vllm import EXAMPLE, MAX_TOKENS, _listening, extra, log_problems, models, scrape, vllm_sample, wait_until

from kvxfer.integrations.vllm_pd import VllmServer, free_port, local, token_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
__all__ = ["models"]  # the session's tiny model, shared with test_vllm

REQUESTS = 8  # per proxy, all in flight at once


class Instances:
    def __init__(self, model: Path, logs: Path) -> None:
        self.logs = logs
        self.metrics: dict[str, int] = {}
        self.servers: dict[str, VllmServer] = {}
        for name, role, cpu in (("p1", "prefill", "0"), ("p2", "prefill", "0"), ("d1", "decode", "1"),
                                ("d2", "decode", "1")):
            self.metrics[name] = free_port()
            # float32: vec kernel on every x86 host (bf16 at block 128 takes vLLM's amx kernel where the host
            # has AMX, whose worker died of SIGILL with concurrent requests here; docs/vllm.md)
            self.servers[name] = VllmServer(model, free_port(), role, extra=extra("tcp", self.metrics[name]),
                                            cpu=cpu, log=logs / f"{name}.log", dtype="float32")

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()


@pytest.fixture(scope="module")
def instances(models: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Instances]:
    inst = Instances(models[0], tmp_path_factory.mktemp("vllm-multi"))
    try:
        for s in inst.servers.values():
            s.wait_ready()
        yield inst
    finally:
        inst.stop()


def through_proxy(port: int, prompt: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        text = r.read().decode()
    return token_ids(json.loads(text))


@pytest.mark.parametrize(("prefills", "decodes"), [(["p1", "p2"], ["d1"]), (["p1"], ["d1", "d2"])],
                         ids=["2P1D", "1P2D"])
def test_concurrent_requests_through_the_proxy(instances: Instances, prefills: list[str], decodes: list[str],
                                               tmp_path: Path) -> None:
    s, m = instances.servers, instances.metrics
    rng = random.Random(len(prefills) * 10 + len(decodes))
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(60, 400))] for _ in range(REQUESTS)]
    refs = [token_ids(local(s["p1"].url, p, MAX_TOKENS)) for p in prompts]
    before = {n: scrape(port) for n, port in m.items()}
    port = free_port()
    proxy = subprocess.Popen([sys.executable, str(EXAMPLE / "proxy.py"), "--prefill", *(s[n].url for n in prefills),
                              "--decode", *(s[n].url for n in decodes), "--port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=open(tmp_path / "proxy.log", "w"))  # noqa: SIM115
    try:
        assert wait_until(lambda: _listening(port), 30)
        with ThreadPoolExecutor(REQUESTS) as pool:
            got = list(pool.map(lambda p: through_proxy(port, p), prompts))
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
    assert got == refs, f"a request through the proxy differs from the model's own\n{log_problems(instances.logs)}"
    for n in prefills:  # the done notices may land just after the answers
        assert wait_until(lambda n=n: scrape(m[n])["kvxfer_held_blocks"] == 0), log_problems(instances.logs)
    after = {n: scrape(port) for n, port in m.items()}

    def delta(name: str, key: str) -> float:
        return after[name].get(key, 0) - before[name].get(key, 0)

    assert sum(delta(n, "kvxfer_loads_ok_total") for n in decodes) == REQUESTS, log_problems(instances.logs)
    assert all(delta(n, "kvxfer_loads_failed_total") == 0 for n in decodes)
    assert all(delta(n, "kvxfer_loads_ok_total") > 0 for n in decodes), "every decode server loaded"
    assert all(delta(n, "kvxfer_holds_done_total") > 0 for n in prefills), "every prefill server served"
    assert sum(delta(n, "kvxfer_holds_done_total") for n in prefills) == REQUESTS
    assert all(wait_until(lambda srv=srv: vllm_sample(srv, "vllm:kv_cache_usage_perc") == 0.0)
               for srv in s.values()), "every pool back to 0"
