"""Every listener binds to loopback unless a config says otherwise (SECURITY.md)."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvxfer.cache import allocate_kv_cache, spec_from_config
from kvxfer.config import CacheConfig, ConnectorConfig, InstanceConfig, LaunchConfig, ModelConfig, ServerConfig
from kvxfer.connector import Connector


def test_config_defaults_are_loopback() -> None:
    assert ConnectorConfig().side_channel.host == "127.0.0.1"
    assert ServerConfig().host == "127.0.0.1"
    assert LaunchConfig(instances=["x.yaml"]).router.host == "127.0.0.1"


@pytest.mark.parametrize("plane", ["tcp", "ucx"])
def test_a_default_connector_listens_on_loopback_only(plane: str) -> None:
    cfg = InstanceConfig(role="prefill", engine_id="P", model=ModelConfig(num_layers=2),
                         cache=CacheConfig(num_blocks=8), connector=ConnectorConfig(name=plane))
    c = Connector.from_config(msgspec.structs.replace(
        cfg, connector=msgspec.structs.replace(cfg.connector, side_channel=msgspec.structs.replace(
            cfg.connector.side_channel, port=0))))
    c.register_kv_caches(allocate_kv_cache(spec_from_config(cfg), 8))
    try:
        assert c.server is not None
        side = c.server._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert side.startswith("tcp://127.0.0.1:"), side
        if plane == "tcp":
            from kvxfer.connectors.tcp import Address

            addr = msgspec.msgpack.decode(c.plane.address(), type=Address)
            assert addr.host == "127.0.0.1"
        else:
            from kvxfer.connectors.ucx import UcxAddress

            addr = msgspec.msgpack.decode(c.plane.address(), type=UcxAddress)
            assert addr.control.startswith("tcp://127.0.0.1:"), addr.control
    finally:
        c.close()
