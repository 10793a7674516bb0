"""Security defaults (docs/security.md): every listener binds to loopback unless a config says
otherwise, and with a shared secret the data plane serves only authenticated connections."""

from __future__ import annotations

import socket
import struct

import msgspec
import numpy as np
import pytest
import zmq

from kvxfer.cache import allocate_kv_cache, spec_from_config
from kvxfer.config import (
    AuthConfig,
    CacheConfig,
    ConnectorConfig,
    InstanceConfig,
    LaunchConfig,
    ModelConfig,
    ServerConfig,
)
from kvxfer.connector import Connector
from kvxfer.handshake import SideChannelClient
from kvxfer.protocol import DataHello, ReadRequest, decode_data, encode


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


def _frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("!I", len(payload)) + payload)


def test_with_auth_a_tcp_data_connection_without_a_valid_token_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVX_SEC_TEST", "s3cret")
    cfg = InstanceConfig(role="prefill", engine_id="P", model=ModelConfig(num_layers=2),
                         cache=CacheConfig(num_blocks=8),
                         connector=ConnectorConfig(name="tcp", auth=AuthConfig(secret_env="KVX_SEC_TEST")))
    cfg = msgspec.structs.replace(cfg, connector=msgspec.structs.replace(
        cfg.connector, side_channel=msgspec.structs.replace(cfg.connector.side_channel, port=0)))
    c = Connector.from_config(cfg)
    c.register_kv_caches(allocate_kv_cache(spec_from_config(cfg), 8))
    try:
        params = c.hold("r", [1, 2], 32)
        meta, token = SideChannelClient(5.0, 0).handshake("127.0.0.1", c.side_channel_port, "D", 0,
                                                          params.layout, b"s3cret")
        from kvxfer.connectors.tcp import Address

        addr = msgspec.msgpack.decode(meta.data_address, type=Address)
        stride = meta.regions[0].block_stride
        read = encode(ReadRequest(request_id="r", batch_id=1, regions=np.asarray([0], "<i8").tobytes(),
                                  offsets=np.asarray([stride], "<i8").tobytes(),
                                  lengths=np.asarray([stride], "<i8").tobytes()))
        for bad in (b"", b"not-the-token"):
            with socket.create_connection((addr.host, addr.port), timeout=5) as s:
                _frame(s, encode(DataHello(engine_id="intruder", token=bad)))
                _frame(s, read)
                try:
                    got = s.recv(4)
                except ConnectionResetError:
                    got = b""
                assert got == b"", "the connection is closed without an answer"
        with socket.create_connection((addr.host, addr.port), timeout=5) as s:  # the real token reads
            _frame(s, encode(DataHello(engine_id="D", token=token)))
            _frame(s, read)
            (n,) = struct.unpack("!I", s.recv(4, socket.MSG_WAITALL))
            assert decode_data(s.recv(n, socket.MSG_WAITALL)).nbytes == stride
    finally:
        c.close()
