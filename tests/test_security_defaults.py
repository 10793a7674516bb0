"""Security defaults (docs/security.md): every listener binds to loopback unless a config says
otherwise, and with a shared secret the data plane serves only authenticated connections."""

from __future__ import annotations

import logging
import socket
import struct
from pathlib import Path

import msgspec
import numpy as np
import pytest
import yaml
import zmq
from test_cli import kvxfer

from kvxfer.cache import allocate_kv_cache, spec_from_config
from kvxfer.config import (
    AuthConfig,
    CacheConfig,
    ConfigError,
    ConfigProblems,
    ConnectorConfig,
    InstanceConfig,
    LaunchConfig,
    ModelConfig,
    RouterConfig,
    ServerConfig,
    SideChannelConfig,
    is_loopback,
    load_instance_config,
)
from kvxfer.connector import Connector
from kvxfer.handshake import SideChannelClient
from kvxfer.protocol import DataHello, ReadRequest, decode_data, encode


def test_config_defaults_are_loopback() -> None:
    assert ConnectorConfig().side_channel.host == "127.0.0.1"
    assert ServerConfig().host == "127.0.0.1"
    assert LaunchConfig(instances=["x.yaml"]).router.host == "127.0.0.1"


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LOCALHOST", True), ("::ffff:127.0.0.1", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.1", False), ("192.168.1.2", False), ("fe80::1", False),
    ("*", False), ("", False), ("example.com", False), ("localhost.example.com", False),
])
def test_what_counts_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


# (YAML sections, the field path refused): the three kinds of listener an instance has
EXPOSED = [
    ({"connector": {"side_channel": {"host": "0.0.0.0"}}}, "connector.side_channel.host"),
    ({"connector": {"data_plane": {"host": "10.0.0.7"}}}, "connector.data_plane.host"),
    ({"server": {"host": "0.0.0.0", "metrics_port": 9400}}, "server.host"),
]


def _instance(tmp_path: Path, sections: dict, auth: dict | None = None) -> Path:
    data = {"role": "prefill", "engine_id": "p", **sections}
    if auth is not None:
        data["connector"] = {**data.get("connector", {}), "auth": auth}
    p = tmp_path / "exposed.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize(("sections", "path"), EXPOSED, ids=[p for _, p in EXPOSED])
def test_check_config_refuses_a_listener_beyond_loopback_without_auth(tmp_path: Path, sections: dict,
                                                                       path: str) -> None:
    f = _instance(tmp_path, sections)
    r = kvxfer("check-config", str(f))
    assert r.returncode == 1, r.stdout
    host = sections.get("server", {}).get("host") or next(iter(sections["connector"].values()))["host"]
    assert (f"error: {f}: {path}: {host} is not a loopback address" in r.stderr
            and "connector.auth is not set; set connector.auth.secret_env, or auth: {mode: none} to run without "
                "authentication" in r.stderr), r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.parametrize(("sections", "path"), EXPOSED, ids=[p for _, p in EXPOSED])
def test_auth_mode_none_allows_it_with_a_warning(tmp_path: Path, sections: dict, path: str) -> None:
    f = _instance(tmp_path, sections, {"mode": "none"})
    r = kvxfer("check-config", str(f))
    assert r.returncode == 0, r.stderr
    assert "WARNING kvxfer.config" in r.stderr and "connector.auth.mode is none" in r.stderr and path in r.stderr
    assert "mode: none" in r.stdout and "secret_env: null" in r.stdout  # the resolved config says so
    f = _instance(tmp_path, sections, {"secret_env": "KVX_SECRET"})  # a secret: no warning
    r = kvxfer("check-config", str(f))
    assert r.returncode == 0 and "WARNING" not in r.stderr, r.stderr


def test_serve_refuses_an_exposed_side_channel_before_it_starts(tmp_path: Path) -> None:
    f = _instance(tmp_path, EXPOSED[0][0])
    r = kvxfer("serve", str(f))
    assert r.returncode == 1 and "connector.side_channel.host: 0.0.0.0 is not a loopback address" in r.stderr


def test_loaders_log_the_opt_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = _instance(tmp_path, EXPOSED[0][0], {"mode": "none"})
    with caplog.at_level(logging.WARNING, logger="kvxfer.config"):
        cfg = load_instance_config(f, environ={})
    assert cfg.connector.auth == AuthConfig(mode="none") and cfg.connector.auth.secret_env is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "connector.side_channel.host (0.0.0.0)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvxfer.config"):  # loopback with mode none: nothing to warn of
        load_instance_config(_instance(tmp_path, {}, {"mode": "none"}), environ={})
    assert not caplog.records


def test_an_env_override_cannot_sneak_past_it(tmp_path: Path) -> None:
    f = _instance(tmp_path, {})
    with pytest.raises(ConfigError) as info:
        load_instance_config(f, environ={"KVXFER_CONNECTOR__SIDE_CHANNEL__HOST": "0.0.0.0"})
    assert info.value.path == "connector.side_channel.host"
    cfg = load_instance_config(f, environ={"KVXFER_CONNECTOR__SIDE_CHANNEL__HOST": "0.0.0.0",
                                           "KVXFER_CONNECTOR__AUTH__MODE": "none"})
    assert cfg.connector.side_channel.host == "0.0.0.0"


def test_configs_built_in_code_are_held_to_it_too() -> None:
    with pytest.raises(ConfigProblems, match=r"\[side_channel.host\] 0.0.0.0 is not a loopback address"):
        ConnectorConfig(side_channel=SideChannelConfig(host="0.0.0.0"))
    ConnectorConfig(side_channel=SideChannelConfig(host="0.0.0.0"), auth=AuthConfig(mode="none"))
    with pytest.raises(ConfigProblems, match=r"\[server.host\] 0.0.0.0 is not a loopback address"):
        InstanceConfig(role="both", engine_id="x", server=ServerConfig(host="0.0.0.0", metrics_port=0))
    # the request server without metrics is the router's to reach, not covered by connector.auth
    InstanceConfig(role="both", engine_id="x", server=ServerConfig(host="0.0.0.0"))
    LaunchConfig(instances=["x.yaml"], router=RouterConfig(host="0.0.0.0"))  # the front door: see RouterConfig


@pytest.mark.parametrize(("auth", "message"), [
    ({}, "required with mode secret"),
    ({"mode": "secret"}, "required with mode secret"),
    ({"mode": "none", "secret_env": "X"}, "expected no secret_env with mode none, got 'X'"),
])
def test_auth_modes(tmp_path: Path, auth: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_instance_config(_instance(tmp_path, {}, auth), environ={})
    assert info.value.path == "connector.auth.secret_env" and message in info.value.message, str(info.value)
    old = load_instance_config(_instance(tmp_path, {}, {"secret_env": "KVX_SECRET"}), environ={})
    assert old.connector.auth == AuthConfig(mode="secret", secret_env="KVX_SECRET")


@pytest.mark.parametrize("plane", ["tcp", "ucx"])
def test_a_default_connector_listens_on_loopback_only(plane: str) -> None:
    cfg = InstanceConfig(role="prefill", engine_id="P", model=ModelConfig(num_layers=2),
                         cache=CacheConfig(num_blocks=8), connector=ConnectorConfig(name=plane, data_path="engine"))
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
