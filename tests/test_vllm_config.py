"""How KvxferConnector reads its settings from vLLM's config (vLLM's config objects stubbed:
the unit under test is kvxfer's mapping, not vLLM)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvxfer.integrations.vllm as vllm_adapter  # needs vLLM: the vllm-test extra, as the README's command installs
from kvxfer.config import ConfigError
from kvxfer.connector import Connector
from kvxfer.protocol import KVTransferParams, RemoteRank
from kvxfer.transfer.aggregator import Finished

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]


def vllm_config(extra: dict[str, Any] | None = None, role: str = "kv_consumer", tp: int = 1, pp: int = 1) -> Any:
    hf = SimpleNamespace(num_attention_heads=8)
    model = SimpleNamespace(hf_text_config=hf, served_model_name="org/My Model", model="/models/m",
                            get_total_num_hidden_layers=lambda: 4, get_total_num_kv_heads=lambda: 4,
                            get_head_size=lambda: 64)
    kvt = SimpleNamespace(kv_connector_extra_config=extra or {}, kv_role=role, engine_id="0a9abb4a-09ba")
    return SimpleNamespace(kv_transfer_config=kvt, model_config=model,
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                           cache_config=SimpleNamespace(block_size=128, cache_dtype="auto"))


def test_geometry_comes_from_vllm_and_the_plane_from_extra_config() -> None:
    _, cfg = vllm_adapter.instance_config(
        vllm_config({"connector": {"name": "cma", "side_channel": {"port": 5900}, "timeouts": {"lease_s": 7.5},
                                   "auth": {"secret_env": "KV_SECRET"}}}, tp=2), num_blocks=321, dtype="bfloat16")
    assert cfg.role == "decode" and cfg.engine_id == "0a9abb4a-09ba"
    assert cfg.model.name == "My-Model"  # a kvxfer name from the served model name
    assert (cfg.model.num_layers, cfg.model.num_kv_heads, cfg.model.head_size) == (4, 4, 64)
    assert (cfg.cache.block_size, cfg.cache.num_blocks, cfg.cache.layout, cfg.cache.kv_fused) == (128, 321, "HND", True)
    assert cfg.parallel.tp == 2
    c = cfg.connector
    assert (c.name, c.side_channel.port, c.timeouts.lease_s, c.auth.secret_env) == ("cma", 5900, 7.5, "KV_SECRET")


def test_the_deprecated_flat_keys_still_work_and_say_what_replaces_them(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvxfer.integrations.vllm"):
        _, cfg = vllm_adapter.instance_config(vllm_config(
            {"data_plane": "cma", "side_channel_port": 5900, "lease_s": 7.5, "auth_secret_env": "KV_SECRET",
             "data_plane_options": {"timeout_s": 3.0}}), 64)
    c = cfg.connector
    assert (c.name, c.side_channel.port, c.timeouts.lease_s, c.auth.secret_env) == ("cma", 5900, 7.5, "KV_SECRET")
    assert c.data_plane == {"timeout_s": 3.0}
    assert "connector.timeouts.lease_s" in caplog.text and "deprecated" in caplog.text


def test_every_connector_field_comes_through_extra_config_and_reaches_the_connector(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One schema: what a kvxfer YAML's connector section takes, kv_connector_extra_config takes."""
    monkeypatch.setenv("KV_SECRET", "s3cret")
    s, cfg = vllm_adapter.instance_config(vllm_config({"connector": {
        "name": "tcp", "host_staging": "always", "data_plane": {"streams": 2},
        "timeouts": {"hold_wait_s": 2.5, "handshake_retries": 7, "reservation_s": 9.0},
        "auth": {"secret_env": "KV_SECRET"}}, "metrics_port": 0}), 64)
    t = cfg.connector.timeouts
    assert (t.hold_wait_s, t.handshake_retries, t.reservation_s) == (2.5, 7, 9.0)
    assert cfg.connector.host_staging == "always" and cfg.connector.data_plane == {"streams": 2}
    assert cfg.connector.side_channel.port == 0, "vLLM passes addresses itself: free ports by default"
    assert s.metrics_port == 0
    assert Connector.from_config(cfg).config == cfg  # the agent gets this config whole (its Start message)
    c = Connector.in_process(cfg)  # what the agent makes of it
    try:
        assert c.config.connector.timeouts.hold_wait_s == 2.5
        assert c.client.retries == 7
        assert c.secret == b"s3cret"
    finally:
        c.close()


def test_without_extra_config_the_side_channel_takes_free_ports() -> None:
    _, cfg = vllm_adapter.instance_config(vllm_config({}), 64)
    assert cfg.connector.side_channel.port == 0 and cfg.connector.side_channel.host == "127.0.0.1"
    assert cfg.connector.auth is None


def test_a_kvxfer_yaml_supplies_the_connector_section() -> None:
    _, cfg = vllm_adapter.instance_config(vllm_config({"config": str(ROOT / "configs" / "ucx-decode.yaml")}), 64)
    assert cfg.connector.name == "ucx" and cfg.connector.side_channel.port == 5720
    assert cfg.cache.kv_fused and cfg.cache.block_size == 128, "geometry still comes from vLLM"


@pytest.mark.parametrize(("extra", "role", "path", "match"), [
    ({"data_plan": "tcp"}, "kv_consumer", "kv_connector_extra_config.data_plan", "unknown key"),  # a typo is named
    ({"connector": {"timeout": {}}}, "kv_consumer", "kv_connector_extra_config.connector.timeout", "unknown key"),
    ({"lease_s": "soon"}, "kv_consumer", "kv_connector_extra_config.lease_s", "Expected `float`"),
    ({"side_channel_port": 70000}, "kv_consumer", "kv_connector_extra_config.side_channel_port", "<= 65535"),
    ({"connector": {"timeouts": {"hold_wait_s": -1}}}, "kv_consumer",
     "kv_connector_extra_config.connector.timeouts.hold_wait_s", ">= 0"),
    ({"metrics_port": 70000}, "kv_consumer", "kv_connector_extra_config.metrics_port", "<= 65535"),
    ({"lease_s": 1.0, "connector": {"timeouts": {"lease_s": 2.0}}}, "kv_consumer",
     "kv_connector_extra_config.lease_s", "also set as connector.timeouts.lease_s"),
    ({"config": "x.yaml", "connector": {}}, "kv_consumer", "kv_connector_extra_config.connector",
     "cannot be combined with config"),
    ({"config": "/nonexistent/x.yaml"}, "kv_consumer", "kv_connector_extra_config.config", "cannot read file"),
    ({}, "kv_nobody", "kv_role", "expected one of"),
])
def test_bad_settings_are_refused_by_name(extra: dict[str, Any], role: str, path: str, match: str) -> None:
    with pytest.raises(ConfigError) as info:
        vllm_adapter.instance_config(vllm_config(extra, role), 64)
    assert info.value.source == "kv_transfer_config"
    assert info.value.path == path, str(info.value)
    assert match in info.value.message, str(info.value)


def test_every_mistake_in_extra_config_is_reported_at_once() -> None:
    extra = {"data_plan": "tcp", "metrics_port": "9000",
             "connector": {"timeouts": {"hold_wait_s": -1, "transfer_s": 10, "abort_s": 5},
                           "side_channel": {"host": "0.0.0.0"}}}
    with pytest.raises(ConfigError) as info:
        vllm_adapter.instance_config(vllm_config(extra, "kv_nobody"), 64)
    paths = [p for p, _ in info.value.errors]
    assert sorted(paths) == sorted([
        "kv_connector_extra_config.data_plan", "kv_connector_extra_config.metrics_port",
        "kv_connector_extra_config.connector.timeouts.hold_wait_s",
        "kv_connector_extra_config.connector.timeouts.abort_s",
        "kv_connector_extra_config.connector.side_channel.host", "kv_role"]), str(info.value)
    assert len(str(info.value).splitlines()) == len(paths)


@pytest.mark.parametrize(("extra", "path"), [
    ({"connector": {"side_channel": {"host": "0.0.0.0"}}}, "kv_connector_extra_config.connector.side_channel.host"),
    ({"connector": {"data_plane": {"host": "10.1.2.3"}}}, "kv_connector_extra_config.connector.data_plane.host"),
    ({"side_channel_host": "::"}, "kv_connector_extra_config.side_channel_host"),
    ({"metrics_port": 0, "metrics_host": "0.0.0.0"}, "kv_connector_extra_config.metrics_host"),
])
def test_a_listener_beyond_loopback_needs_auth_or_the_explicit_opt_out(
        extra: dict[str, Any], path: str, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError) as info:
        vllm_adapter.instance_config(vllm_config(extra), 64)
    assert info.value.path == path, str(info.value)
    assert "is not a loopback address" in info.value.message and "connector.auth is not set" in info.value.message
    connector = {**extra.get("connector", {}), "auth": {"mode": "none"}}
    with caplog.at_level(logging.WARNING, logger="kvxfer.config"):
        _, cfg = vllm_adapter.instance_config(vllm_config({**extra, "connector": connector}), 64)
    assert cfg.connector.auth is not None and cfg.connector.auth.secret_env is None
    assert "connector.auth.mode is none" in caplog.text and path in caplog.text
    for secret in ({"secret_env": "KV_SECRET"}, {"mode": "secret", "secret_env": "KV_SECRET"}):
        vllm_adapter.instance_config(vllm_config({**extra, "connector": {**connector, "auth": secret}}), 64)


def test_the_yaml_named_by_config_is_checked_too(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("role: decode\nengine_id: d\nconnector: {side_channel: {host: 0.0.0.0}, timeouts: {lease_s: 0}}\n")
    with pytest.raises(ConfigError) as info:
        vllm_adapter.instance_config(vllm_config({"config": str(bad)}), 64)
    lines = [m for p, m in info.value.errors if p == "kv_connector_extra_config.config"]
    assert len(lines) == 2 and all(m.startswith(f"{bad}: connector.") for m in lines), str(info.value)


def test_vllm_finds_the_connector_by_name_through_the_plugin_and_by_module_path() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does at start: runs kvxfer's entry point
    by_name = KVConnectorFactory.get_connector_class(
        SimpleNamespace(kv_connector="KvxferConnector", kv_connector_module_path=None))
    by_path = KVConnectorFactory.get_connector_class(
        SimpleNamespace(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.integrations.vllm"))
    assert by_name is by_path is vllm_adapter.KvxferConnector


def test_pipeline_stages_take_vllms_layer_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM gives an uneven split's extra layers to the middle stages (and honours
    VLLM_PP_LAYER_PARTITION); kvxfer's own even split would put them first and refuse the caches."""
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    _, cfg = vllm_adapter.instance_config(vllm_config(pp=3), 64)  # 4 layers on 3 stages
    assert cfg.parallel.pp == 3 and cfg.parallel.layer_partition == [1, 2, 1]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,1,1")
    _, cfg = vllm_adapter.instance_config(vllm_config(pp=3), 64)
    assert cfg.parallel.layer_partition == [2, 1, 1]
    _, cfg = vllm_adapter.instance_config(vllm_config(), 64)
    assert cfg.parallel.layer_partition is None


def _caches(*dtypes: torch.dtype) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(2, 4, 16, 128, dtype=d) for i, d in enumerate(dtypes)}


@pytest.mark.parametrize(("cache_dtype", "tensors", "want"), [
    ("auto", torch.bfloat16, "bfloat16"),
    ("auto", torch.float32, "float32"),
    (None, torch.float16, "float16"),
    ("fp8", torch.uint8, "fp8_e4m3"),  # vLLM's fp8 is e4m3
    ("fp8_e4m3", torch.uint8, "fp8_e4m3"),
    ("fp8_e5m2", torch.uint8, "fp8_e5m2"),
])
def test_the_kv_dtype_comes_from_vllms_cache_dtype(cache_dtype: str | None, tensors: torch.dtype, want: str) -> None:
    assert vllm_adapter.kv_dtype(cache_dtype, _caches(tensors, tensors)) == want


@pytest.mark.parametrize(("cache_dtype", "tensors", "match"), [
    ("fp8_inc", (torch.float8_e4m3fn,), "--kv-cache-dtype fp8_inc is not one kvxfer moves"),
    ("turboquant_k8v4", (torch.uint8,), "is not one kvxfer moves (auto, fp8, fp8_e4m3, fp8_e5m2)"),
    ("auto", (torch.uint8,), "KV dtype torch.uint8 is not one kvxfer moves"),
    ("fp8", (torch.bfloat16,), "--kv-cache-dtype fp8 but the KV tensors are torch.bfloat16"),
    ("fp8", (torch.uint8, torch.bfloat16), "KV tensors of 2 dtypes"),  # --kv-cache-dtype-skip-layers
])
def test_a_kv_dtype_kvxfer_cannot_move_is_refused_by_name(cache_dtype: str, tensors: tuple[torch.dtype, ...],
                                                          match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        vllm_adapter.kv_dtype(cache_dtype, _caches(*tensors))


def test_an_fp8_cache_is_moved_as_its_float8_bytes() -> None:
    """vLLM's uint8 tensor, viewed as kvxfer's float8 dtype: the same memory, whole fused blocks."""
    from kvxfer.cache.spec import KVCacheSpec
    from kvxfer.cache.tensors import KVCache

    raw = torch.randint(0, 256, (3, 2, 16, 64), dtype=torch.uint8)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_size=32, block_size=16, dtype="fp8_e5m2", layout="HND",
                       kv_fused=True)
    cache = KVCache(spec=spec, num_blocks=3, tensors=[raw.view(torch.float8_e5m2)], names=[])
    assert cache.tensors[0].data_ptr() == raw.data_ptr() and spec.bytes_per_block == 2 * 16 * 64
    assert torch.equal(cache.block_bytes(0, 1), raw[1].flatten())


class _RecordingConnector:
    """The adapter's collaborator (a kvxfer Connector): records how long each poll may wait and
    reports the loads and holds the test finishes."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.finished: list[str] = []
        self.released: list[str] = []

    def start_load(self, request_id: str, params: Any, block_ids: Any, num_cached_tokens: int = 0) -> None:
        pass

    def hold(self, request_id: str, block_ids: Any, num_tokens: int) -> None:
        pass

    def poll(self, timeout_s: float = 0.0) -> Finished:
        self.waits.append(timeout_s)
        out, self.finished, self.released = Finished(receiving=self.finished, sending=self.released), [], []
        return out


def test_an_empty_engine_step_waits_for_loads_and_holds_in_flight_and_a_step_with_work_never_does() -> None:
    """vLLM steps without pause while a request waits for its KV, or its blocks for their readers;
    those empty steps took the CPU the transfer agent (and a decode server beside) needed. A step
    that computes nothing, with a load or a hold in flight, waits in poll (returning at its event);
    a step with work, or with nothing in flight, does not wait."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    sched = vllm_adapter.KvxferConnector(vllm_config(), KVConnectorRole.SCHEDULER, SimpleNamespace(num_blocks=64))
    worker = vllm_adapter.KvxferConnector(vllm_config(), KVConnectorRole.WORKER, SimpleNamespace(num_blocks=64))
    rec = _RecordingConnector()
    worker.connector = rec  # type: ignore[assignment]
    rank = RemoteRank(rank=0, host="127.0.0.1", port=5600, generation=1)
    params = KVTransferParams(request_id="r1", engine_id="P", num_tokens=32, block_ids=[5, 6], block_size=16,
                              layout=sched.layout, ranks=[rank], lease_s=10.0)

    def step(tokens: int, load: bool = False, hold: bool = False) -> float:
        if load:
            sched._pending.loads.append(vllm_adapter.LoadOrder("r1", params.to_bytes(), [1, 2], 0))
        if hold:
            sched._pending.holds.append(vllm_adapter.HoldOrder("h1", [3, 4], 20))
        meta = sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=tokens))  # type: ignore[arg-type]
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)  # type: ignore[arg-type]
        worker.get_finished(set())
        worker.clear_connector_metadata()
        return rec.waits[-1]

    assert step(0) == 0.0  # nothing in flight: an idle engine does not sleep in kvxfer
    assert step(0, load=True) == vllm_adapter.IDLE_STEP_WAIT_S  # the load just started: wait for it
    assert step(5) == 0.0  # other requests to compute: never wait
    assert step(0) == vllm_adapter.IDLE_STEP_WAIT_S
    rec.finished = ["r1"]
    assert step(0) == vllm_adapter.IDLE_STEP_WAIT_S  # this poll reports the load finished
    assert step(0) == 0.0  # nothing in flight any more
    # the prefill side: vLLM steps on while a finished request's blocks wait for their readers
    assert step(0, hold=True) == vllm_adapter.IDLE_STEP_WAIT_S  # the hold is made: wait for it to end
    assert step(3) == 0.0
    assert step(0) == vllm_adapter.IDLE_STEP_WAIT_S
    rec.released = ["h1"]
    assert step(0) == vllm_adapter.IDLE_STEP_WAIT_S  # this poll reports the hold released
    assert step(0) == 0.0


class _CountingConnector:
    """The adapter's collaborator: counts how often its counters are asked for (with an agent, a round trip)."""

    def __init__(self) -> None:
        self.asked = 0

    def stats(self) -> dict[str, float]:
        self.asked += 1
        return {"loads_started": float(self.asked), "loads_ok": float(self.asked)}


def test_vllm_asks_for_stats_every_step_and_the_agent_is_asked_at_most_once_an_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    now = [100.0]
    monkeypatch.setattr(vllm_adapter, "_clock", lambda: now[0])
    worker = vllm_adapter.KvxferConnector(vllm_config(), KVConnectorRole.WORKER, SimpleNamespace(num_blocks=64))
    rec = _CountingConnector()
    worker.connector = rec  # type: ignore[assignment]
    first = worker.get_kv_connector_stats()
    assert first is not None and first.data["loads_started"] == 1
    for _ in range(50):  # fifty steps within the interval: no round trip, nothing to report
        now[0] += vllm_adapter.STATS_INTERVAL_S / 100
        assert worker.get_kv_connector_stats() is None
    assert rec.asked == 1
    now[0] += vllm_adapter.STATS_INTERVAL_S
    later = worker.get_kv_connector_stats()
    assert rec.asked == 2 and later is not None and later.data["loads_started"] == 1, "the increment since the first"


def test_kvxfer_records_reach_a_vllm_processs_stderr_with_time_level_and_origin() -> None:
    """vLLM configures only its own loggers: without the adapter's handler kvxfer's warnings came out
    as bare text (Python's last-resort handler), which no one could tell from other lines."""
    code = ("import logging, vllm.logger; import kvxfer.integrations.vllm as a; a._log_to_stderr(); a._log_to_stderr();"
            " logging.getLogger('kvxfer.agent.client').info('not shown'); "
            "logging.getLogger('kvxfer.agent.client').error('rank 0: agent gone'); "
            "logging.basicConfig(format='ROOT %(message)s'); logging.getLogger('kvxfer.x').error('later')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "KVXFER_LOG_LEVEL"})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if "agent gone" in ln or "not shown" in ln]
    assert len(lines) == 1, r.stderr[-2000:]  # once (one handler however often called), INFO not shown
    assert [ln for ln in r.stderr.splitlines() if "later" in ln] == ["ROOT later"], \
        "once the application configures logging, its handler prints kvxfer's records, once"
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+"
    assert re.match(rf"^{stamp} ERROR kvxfer\[\d+\] kvxfer\.agent\.client: rank 0: agent gone$", lines[0]), lines[0]


def test_a_servers_stacks_name_each_process_and_its_innermost_frames() -> None:
    """What test_vllm_tp's no-answer failure prints: py-spy's dump of every process in the server's group,
    a line per thread, identical threads once."""
    from kvxfer.integrations.vllm_pd import VllmServer

    s = object.__new__(VllmServer)  # a stand-in server: one process of its own group, stuck in known frames
    code = ("import threading, time\ndef stuck():\n    time.sleep(60)\n"
            "for i in range(2):\n    threading.Thread(target=stuck, name=f't{i}').start()\nstuck()\n")
    s.proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    s.log_path = Path("/tmp/stand-in.log")
    try:
        deadline = time.monotonic() + 30
        while "'t0' (+1 alike)" not in (out := s.stacks()) and time.monotonic() < deadline:
            time.sleep(0.2)  # until the interpreter has reached the frames
        head, *threads = out.splitlines()
        title = f"{sys.executable} -c import threading, time def stuck():"  # the command line, on one line
        assert head.startswith(f"stand-in.log pid {s.proc.pid} {title}"), out
        assert len(threads) == 2, f"the main thread, and the two alike threads on one line: {out}"
        assert any(t.startswith("  't0' (+1 alike) idle: ") and "stuck (<string>:3) < Thread.run" in t
                   for t in threads), out
        assert any(t.startswith("  'MainThread' idle: ") and "stuck (<string>:3) < <module> (<string>:6)" in t
                   for t in threads), out
        assert all(t.count(" < ") == 1 for t in s.stacks(frames=2).splitlines()[1:]), "two frames a thread"
    finally:
        s.proc.kill()
        s.proc.wait(timeout=10)
    assert s.stacks() == "", "a server that is gone has no stacks"
