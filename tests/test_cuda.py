"""Device (CUDA) caches, end to end: the engine's tensors live on the GPU, the data plane sees a
host mirror (``connector.host_staging: auto``), and the bytes that land in the decode side's GPU
tensors equal the bytes the prefill side's GPU tensors held. Real agent processes and sockets, as
in test_agent; skipped where no CUDA device is visible (CI has none; run on a GPU machine)."""

from __future__ import annotations

import time

import pytest
import torch
from test_agent import NB, _save_layer_case, cfg, wait_for

from kvxfer.cache import allocate_kv_cache, spec_from_config
from kvxfer.config import InstanceConfig
from kvxfer.connector import Connector, EngineConnector

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PLANES = ["tcp", "cma", "ucx"]


def make_on(c: InstanceConfig, device: str, fill: int | None = None) -> tuple[EngineConnector, list[torch.Tensor]]:
    """A connector over a cache allocated on ``device``, filled with seeded random bytes."""
    conn = Connector.from_config(c)
    cache = allocate_kv_cache(spec_from_config(c), NB, device=device)
    assert all(t.device.type == torch.device(device).type for t in cache.tensors)
    if fill is not None:
        for i, t in enumerate(cache.tensors):
            raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(fill + i))
            t.view(-1).view(torch.uint8).copy_(raw.to(t.device))
    conn.register_kv_caches(cache)
    return conn, cache.tensors


def _same(a: torch.Tensor, ia: list[int], b: torch.Tensor, ib: list[int]) -> bool:
    return torch.equal(a[ia].view(torch.uint8).cpu(), b[ib].view(torch.uint8).cpu())


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("data_path", ["engine", "agent"])
@pytest.mark.parametrize("devices", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_pull_between_gpu_caches_is_bit_exact(plane: str, data_path: str, devices: tuple[str, str]) -> None:
    if plane == "ucx":
        pytest.importorskip("ucxx")
    p, pt = make_on(cfg("prefill", plane, data_path=data_path), devices[0], fill=5)
    c, ct = make_on(cfg("decode", plane, data_path=data_path), devices[1])
    try:
        src, dst = [5, 9, 10, 11, 40], [60, 2, 3, 4, 17]
        params = p.hold("r1", src, 5 * 16)
        c.start_load("r1", params, dst)
        out = wait_for(c, "r1")
        assert out.receiving == ["r1"], out.errors
        for a, b in zip(pt, ct, strict=True):
            assert _same(a, src, b, dst)
        untouched = [i for i in range(NB) if i not in dst]
        for b in ct:  # nothing else was written
            assert not b[untouched].view(torch.uint8).any()
        deadline = time.monotonic() + 10
        sent: list[str] = []
        while "r1" not in sent and time.monotonic() < deadline:
            sent += p.poll(0.05).sending
        assert sent == ["r1"]
    finally:
        c.close()
        p.close()


@pytest.mark.parametrize("plane", ["tcp", "cma"])
@pytest.mark.parametrize("data_path", ["engine", "agent"])
def test_push_layer_by_layer_between_gpu_caches_is_bit_exact(plane: str, data_path: str) -> None:
    """Each save_layer copies that layer of the held blocks device-to-host before it is pushed;
    the decode side copies each landed request host-to-device."""
    p, pt = make_on(cfg("prefill", plane, data_path=data_path), "cuda", fill=7)
    c, ct = make_on(cfg("decode", plane, data_path=data_path), "cuda")
    try:
        _save_layer_case(p, pt, c, ct)
    finally:
        c.close()
        p.close()
