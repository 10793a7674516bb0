"""How KvxferConnector reads its settings from vLLM's config (vLLM's config objects stubbed:
the unit under test is kvxfer's mapping, not vLLM)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import kvxfer.integrations.vllm as vllm_adapter  # needs vLLM: the vllm-test extra, as the README's command installs

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]


def vllm_config(extra: dict[str, Any] | None = None, role: str = "kv_consumer", tp: int = 1) -> Any:
    hf = SimpleNamespace(num_attention_heads=8)
    model = SimpleNamespace(hf_text_config=hf, served_model_name="org/My Model", model="/models/m",
                            get_total_num_hidden_layers=lambda: 4, get_total_num_kv_heads=lambda: 4,
                            get_head_size=lambda: 64)
    kvt = SimpleNamespace(kv_connector_extra_config=extra or {}, kv_role=role, engine_id="0a9abb4a-09ba")
    return SimpleNamespace(kv_transfer_config=kvt, model_config=model,
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
                           cache_config=SimpleNamespace(block_size=128))


def test_geometry_comes_from_vllm_and_the_plane_from_extra_config() -> None:
    _, cfg = vllm_adapter.instance_config(
        vllm_config({"data_plane": "cma", "side_channel_port": 5900, "lease_s": 7.5, "auth_secret_env": "KV_SECRET"},
                    tp=2), num_blocks=321, dtype="bfloat16")
    assert cfg.role == "decode" and cfg.engine_id == "0a9abb4a-09ba"
    assert cfg.model.name == "My-Model"  # a kvxfer name from the served model name
    assert (cfg.model.num_layers, cfg.model.num_kv_heads, cfg.model.head_size) == (4, 4, 64)
    assert (cfg.cache.block_size, cfg.cache.num_blocks, cfg.cache.layout, cfg.cache.kv_fused) == (128, 321, "HND", True)
    assert cfg.parallel.tp == 2
    c = cfg.connector
    assert (c.name, c.side_channel.port, c.timeouts.lease_s, c.auth.secret_env) == ("cma", 5900, 7.5, "KV_SECRET")


def test_a_kvxfer_yaml_supplies_the_connector_section() -> None:
    _, cfg = vllm_adapter.instance_config(vllm_config({"config": str(ROOT / "configs" / "ucx-decode.yaml")}), 64)
    assert cfg.connector.name == "ucx" and cfg.connector.side_channel.port == 5720
    assert cfg.cache.kv_fused and cfg.cache.block_size == 128, "geometry still comes from vLLM"


@pytest.mark.parametrize(("extra", "role", "match"), [
    ({"data_plan": "tcp"}, "kv_consumer", "data_plan"),  # a typo is named, not ignored
    ({"lease_s": "soon"}, "kv_consumer", "lease_s"),
    ({"side_channel_port": 70000}, "kv_consumer", "port"),
    ({}, "kv_nobody", "kv_role"),
])
def test_bad_settings_are_refused_by_name(extra: dict[str, Any], role: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        vllm_adapter.instance_config(vllm_config(extra, role), 64)


def test_vllm_finds_the_connector_by_name_through_the_plugin_and_by_module_path() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does at start: runs kvxfer's entry point
    by_name = KVConnectorFactory.get_connector_class(
        SimpleNamespace(kv_connector="KvxferConnector", kv_connector_module_path=None))
    by_path = KVConnectorFactory.get_connector_class(
        SimpleNamespace(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.integrations.vllm"))
    assert by_name is by_path is vllm_adapter.KvxferConnector
