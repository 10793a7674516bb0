"""Device (CUDA) caches, end to end: the engine's tensors live on the GPU, the data plane sees a
host mirror (``connector.host_staging: auto``), and the bytes that land in the decode side's GPU
tensors equal the bytes the prefill side's GPU tensors held. Real agent processes and sockets, as
in test_agent; skipped where no CUDA device is visible (CI has none; run on a GPU machine)."""

from __future__ import annotations

import time

import pytest
import torch
from test_agent import NB, cfg, released, wait_for
from test_cache_tensors import VARIANTS, spec_for

from kvxfer.cache import allocate_kv_cache, spec_from_config
from kvxfer.cache.staging import copy_blocks
from kvxfer.config import InstanceConfig
from kvxfer.connector import Connector, EngineConnector
from kvxfer.transfer.aggregator import Finished

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
        assert released(p, ["r1"]) == ["r1"]
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
        src, dst = [1, 2, 30], [7, 8, 50]
        p.hold("r1", src, 48, streaming=True)
        p.push("r1", c.reserve("d1", dst, 48))
        for layer in range(3):
            p.save_layer("r1", layer)
        deadline = time.monotonic() + 30
        out = Finished()
        while "d1" not in out.receiving and not out.failed and time.monotonic() < deadline:
            out.extend(c.poll(0.05))
        assert out.receiving == ["d1"] and sorted(out.layers.get("d1", [])) == [0, 1, 2], (out.failed, out.errors)
        for a, b in zip(pt, ct, strict=True):
            assert _same(a, src, b, dst)
    finally:
        c.close()
        p.close()


@pytest.mark.parametrize("data_path", ["engine", "agent"])
def test_the_host_mirror_is_pinned_while_open_and_unpinned_at_close(data_path: str) -> None:
    """Memory freed while still host-registered stays pinned, and the next allocation at its
    address cannot be registered (CUDA then reports the failure at torch's next kernel launch):
    connectors made and closed one after another in one process must each pin and unpin."""
    for i in range(3):
        c, _ = make_on(cfg("decode", "tcp", data_path=data_path), "cuda")
        mirror = c.cache
        assert mirror is not None and mirror._pinned, "a device cache's host mirror is pinned"
        c.close()
        assert mirror._pinned == [], f"round {i}: still pinned after close"
        torch.zeros(1024, device="cuda").add_(1)
        torch.cuda.synchronize()  # no CUDA error left behind


# few runs of ids: copied as slices; many: gathered and scattered (kvxfer.cache.staging.MAX_SLICE_RUNS)
ID_SETS = {"3 runs": [7, 2, 9, 3], "12 runs": [31, 2, 9, 5, 14, 17, 20, 23, 26, 29, 35, 11, 12]}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layer", [None, 6])
@pytest.mark.parametrize("ids", list(ID_SETS))
def test_copy_blocks_between_gpu_and_host_is_bit_exact(variant: dict, layer: int | None, ids: str) -> None:
    """The staging copies themselves, both ways, every cache variant: the blocks asked for (all
    layers, or one layer as a push stages it) arrive bit-exact, and nothing else is written."""
    spec = spec_for(dtype="bfloat16", **variant)
    n = 40
    gpu, host = allocate_kv_cache(spec, n, device="cuda"), allocate_kv_cache(spec, n)
    for t in gpu.tensors:
        t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    moved_ids = ID_SETS[ids]
    rest = [i for i in range(n) if i not in moved_ids]
    per = len(gpu.tensors) // spec.num_layers
    copy_blocks(gpu, host, moved_ids, layer=layer)
    for i, (g, h) in enumerate(zip(gpu.tensors, host.tensors, strict=True)):
        moved = layer is None or spec.cross_layer or i // per == layer - spec.first_layer
        assert torch.equal(h[moved_ids].view(torch.uint8), g[moved_ids].cpu().view(torch.uint8)) if moved \
            else not h.view(torch.uint8).any(), (i, moved)
        assert not h[rest].view(torch.uint8).any()
    back = allocate_kv_cache(spec, n, device="cuda")
    copy_blocks(host, back, moved_ids)
    for h, b in zip(host.tensors, back.tensors, strict=True):
        assert torch.equal(b[moved_ids].cpu().view(torch.uint8), h[moved_ids].view(torch.uint8))
        assert not b[rest].view(torch.uint8).any()
