"""A separately packaged data plane, installed with pip, found by entry point (in the transfer
agent too), moves blocks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import time, torch
    from kvxfer.cache import allocate_kv_cache, spec_from_config
    from kvxfer.config import CacheConfig, ConnectorConfig, InstanceConfig, ModelConfig, SideChannelConfig
    from kvxfer.connector import Connector, available_data_planes

    assert "counting-tcp" in available_data_planes(), sorted(available_data_planes())
    def cfg(role, eid):
        return InstanceConfig(role=role, engine_id=eid, model=ModelConfig(num_layers=2, num_kv_heads=2, num_heads=4,
            head_size=16), cache=CacheConfig(block_size=16, num_blocks=32),
            connector=ConnectorConfig(name="counting-tcp", side_channel=SideChannelConfig(port=0)))
    pc, dc = cfg("prefill", "P"), cfg("decode", "D")
    src, dst = allocate_kv_cache(spec_from_config(pc), 32), allocate_kv_cache(spec_from_config(dc), 32)
    for t in src.tensors:
        t.copy_(torch.randn(t.shape))
    P, D = Connector.from_config(pc), Connector.from_config(dc)
    P.register_kv_caches(src); D.register_kv_caches(dst)
    D.start_load("r", P.hold("r", [3, 4, 9], 40), [10, 11, 12])
    t0 = time.time()
    while not (f := D.poll()) and time.time() - t0 < 20:
        time.sleep(0.01)
    assert f.receiving == ["r"], f
    for s, d in zip(src.tensors, dst.tensors):
        assert torch.equal(d[[10, 11]], s[[3, 4]]) and torch.equal(d[12, :8], s[9, :8])
    print("moved", int(D.stats()["bytes_received"]), "bytes via", D.ready.plane)  # the plane ran in D's agent
    P.close(); D.close()
""")


def test_third_party_plane_installs_and_moves_blocks(tmp_path: Path) -> None:
    target = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          str(REPO / "examples" / "custom_connector")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    # 2 layers x K,V x 40 tokens x 2 kv heads x 16 dims x 4 bytes = 20480
    assert out.stdout.strip() == "moved 20480 bytes via counting-tcp"
