"""Config loading: every refusal names the file, the exact field path and the expectation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvxfer.config import (
    ConfigError,
    InstanceConfig,
    LaunchConfig,
    load_instance_config,
    load_launch_config,
)

REPO = Path(__file__).resolve().parents[1]
BASE = {"role": "prefill", "engine_id": "p0"}


def write(tmp_path: Path, data: object, name: str = "inst.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def refuse(tmp_path: Path, data: object, env: dict[str, str] | None = None) -> ConfigError:
    p = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_instance_config(p, environ=env or {})
    assert str(info.value).startswith(f"{p}: "), str(info.value)
    return info.value


def merged(**sections: object) -> dict[str, object]:
    return {**BASE, **sections}


@pytest.mark.parametrize(
    ("data", "path", "expect"),
    [
        (merged(cache={"block_size": 12}), "cache.block_size", "power of two, got 12"),
        (merged(cache={"block_size": 0}), "cache.block_size", ">= 1"),
        (merged(cache={"block_size": "16"}), "cache.block_size", "Expected `int`, got `str`"),
        (merged(cache={"num_blocks": 0}), "cache.num_blocks", ">= 1"),
        (merged(cache={"layout": "NDH"}), "cache.layout", "'NDH'"),
        (merged(cache={"dtype": "int4"}), "cache.dtype", "'int4'"),
        (merged(cache={"device": "tpu"}), "cache.device", "cpu|cuda"),
        (merged(cache={"watermark": 1.0}), "cache.watermark", "< 1.0"),
        (merged(cache={"bloc_size": 16}), "cache.bloc_size", "unknown key"),
        (merged(parallel={"tp": 0}), "parallel.tp", ">= 1"),
        (merged(parallel={"pp": -1}), "parallel.pp", ">= 1"),
        (merged(parallel={"tp": 3}), "parallel.tp", "divisor or a multiple of model.num_kv_heads=2"),
        (merged(parallel={"pp": 2, "layer_partition": [1, 2]}), "parallel.layer_partition",
         "summing to model.num_layers=4, got [1, 2] (sum 3)"),
        (merged(parallel={"pp": 2, "layer_partition": [4]}), "parallel.layer_partition",
         "expected 2 entries"),
        (merged(parallel={"pp": 2, "layer_partition": [4, 0]}), "parallel.layer_partition.1", ">= 1"),
        (merged(parallel={"pp": 5}), "parallel.pp", "<= model.num_layers=4"),
        (merged(connector={"side_channel": {"port": 70000}}), "connector.side_channel.port", "<= 65535"),
        (merged(connector={"side_channel": {"port": -1}}), "connector.side_channel.port", ">= 0"),
        (merged(server={"port": 65536}), "server.port", "<= 65535"),
        (merged(connector={"side_channel": {"port": 65535}}, parallel={"tp": 2}),
         "connector.side_channel.port", "one port per rank"),
        (merged(connector={"mode": "pushpull"}), "connector.mode", "'pushpull'"),
        (merged(connector={"timeouts": {"handshake_s": 0}}), "connector.timeouts.handshake_s", "> 0"),
        (merged(connector={"timeouts": {"transfer_s": 10, "abort_s": 5}}), "connector.timeouts.abort_s",
         ">= timeouts.transfer_s"),
        (merged(connector={"auth": {"secret_env": "not a name"}}), "connector.auth.secret_env",
         "matching regex"),
        (merged(connector={"inline_load_bytes": -1}), "connector.inline_load_bytes", ">= 0"),
        (merged(connector={"data_plane": {"streams": [1, 2]}}), "connector.data_plane.streams",
         "expected a str, int, float or bool, got list"),
        (merged(model={"num_kv_heads": 3, "num_heads": 8}), "model.num_heads",
         "multiple of num_kv_heads=3"),
        (merged(model={"mla": True, "num_kv_heads": 2}), "model.num_kv_heads", "expected 1 with mla"),
        (merged(model={"dtype": "float16"}), "model.dtype", "'float16'"),
        ({"role": "router", "engine_id": "p0"}, "role", "'router'"),
        ({"engine_id": "p0"}, "role", "required field is missing"),
        ({"role": "prefill", "engine_id": "bad id!"}, "engine_id", "matching regex"),
        (merged(extra=1), "extra", "unknown key"),
    ],
)
def test_refusals_name_the_field(tmp_path: Path, data: dict, path: str, expect: str) -> None:
    err = refuse(tmp_path, data)
    assert err.path == path, str(err)
    assert f": {path}: " in str(err)
    assert expect in err.message, str(err)


def test_yaml_syntax_duplicate_keys_and_non_mapping(tmp_path: Path) -> None:
    assert "invalid YAML" in str(refuse(tmp_path, "role: [prefill\n"))
    assert "duplicate key 'role'" in str(refuse(tmp_path, "role: prefill\nrole: decode\nengine_id: x\n"))
    assert "expected a mapping" in str(refuse(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="cannot read file"):
        load_instance_config(tmp_path / "missing.yaml", environ={})


def test_defaults_and_valid_file(tmp_path: Path) -> None:
    cfg = load_instance_config(write(tmp_path, BASE), environ={})
    assert cfg == InstanceConfig(role="prefill", engine_id="p0")
    assert cfg.cache.block_size == 16 and cfg.parallel.tp == 1 and cfg.connector.mode == "pull"
    good = merged(parallel={"pp": 2, "layer_partition": [3, 1]}, model={"num_kv_heads": 2})
    assert load_instance_config(write(tmp_path, good), environ={}).parallel.layer_partition == [3, 1]
    # tp above the kv head count replicates heads: allowed when it divides evenly
    assert load_instance_config(write(tmp_path, merged(parallel={"tp": 8})), environ={}).parallel.tp == 8


def test_env_overrides(tmp_path: Path) -> None:
    p = write(tmp_path, merged(cache={"block_size": 16}))
    env = {
        "KVXFER_CACHE__BLOCK_SIZE": "64",
        "KVXFER_ROLE": "decode",
        "KVXFER_CONNECTOR__TIMEOUTS__LEASE_S": "2.5",
        "KVXFER_CONNECTOR__DATA_PLANE__STREAMS": "2",
        "KVXFER_LOG_LEVEL": "DEBUG",  # a process setting, not a field
        "UNRELATED": "1",
    }
    cfg = load_instance_config(p, environ=env)
    assert cfg.cache.block_size == 64
    assert cfg.role == "decode"
    assert cfg.connector.timeouts.lease_s == 2.5
    assert cfg.connector.data_plane == {"streams": 2}


@pytest.mark.parametrize(
    ("env", "path", "expect"),
    [
        ({"KVXFER_CACHE__BLOCK_SIZE": "48"}, "cache.block_size", "power of two, got 48"),
        ({"KVXFER_CACHE__BLOK_SIZE": "16"}, "cache.blok_size", "KVXFER_CACHE__BLOK_SIZE names no such field"),
        ({"KVXFER_NOPE": "1"}, "nope", "names no such field"),
        ({"KVXFER_CACHE__BLOCK_SIZE__X": "1"}, "cache.block_size", "not a section"),
        ({"KVXFER_PARALLEL__TP": "two"}, "parallel.tp", "Expected `int`, got `str`"),
    ],
)
def test_env_override_refusals(tmp_path: Path, env: dict[str, str], path: str, expect: str) -> None:
    err = refuse(tmp_path, BASE, env)
    assert err.path == path, str(err)
    assert expect in str(err)


def test_launch_file(tmp_path: Path) -> None:
    write(tmp_path, BASE, "p.yaml")
    launch = write(tmp_path, {"instances": ["p.yaml"], "workload": {"num_requests": 3}}, "launch.yaml")
    cfg = load_launch_config(launch)
    assert isinstance(cfg, LaunchConfig)
    assert cfg.instances == [str((tmp_path / "p.yaml").resolve())]
    assert cfg.workload.num_requests == 3
    missing = write(tmp_path, {"instances": ["p.yaml", "nope.yaml"]}, "bad.yaml")
    with pytest.raises(ConfigError) as info:
        load_launch_config(missing)
    assert info.value.path == "instances.1" and "no such instance config" in str(info.value)
    empty = write(tmp_path, {"instances": []}, "empty.yaml")
    with pytest.raises(ConfigError) as info:
        load_launch_config(empty)
    assert info.value.path == "instances"


def test_shipped_configs_are_valid() -> None:
    files = sorted((REPO / "configs").glob("*.yaml"))
    assert files
    for f in files:
        data = yaml.safe_load(f.read_text())
        if "instances" in data:
            for inst in load_launch_config(f).instances:
                load_instance_config(inst, environ={})
        else:
            load_instance_config(f, environ={})


def test_every_error_of_a_file_at_once(tmp_path: Path) -> None:
    data = merged(cache={"block_size": 12, "bloc": 1}, parallel={"tp": "2"}, model={"num_heads": 7},
                  connector={"timeouts": {"transfer_s": 10, "abort_s": 5, "lease_s": -1}}, extra=1)
    err = refuse(tmp_path, data)
    assert sorted(err.errors) == sorted([
        ("cache.block_size", "expected a power of two, got 12"),
        ("cache.bloc", "unknown key (check the spelling against the documented fields)"),
        ("parallel.tp", "Expected `int`, got `str`"),
        ("model.num_heads", "expected a multiple of num_kv_heads=2, got 7"),
        ("connector.timeouts.lease_s", "Expected `float` > 0.0"),
        ("connector.timeouts.abort_s", "expected >= timeouts.transfer_s (10.0), got 5.0"),
        ("extra", "unknown key (check the spelling against the documented fields)"),
    ])
    assert (err.path, err.message) == err.errors[0]
    lines = str(err).splitlines()
    assert lines == [f"{err.source}: {p}: {m}" for p, m in err.errors]


def test_cross_field_checks_run_over_what_converted(tmp_path: Path) -> None:
    # cache.dtype is refused, but model and parallel converted: their checks still run
    err = refuse(tmp_path, merged(cache={"dtype": "int4"}, parallel={"tp": 3}))
    assert sorted(p for p, _ in err.errors) == ["cache.dtype", "parallel.tp"]
    # model.num_layers is refused: the checks that read it do not run (no made-up second error)
    err = refuse(tmp_path, merged(model={"num_layers": 0}, parallel={"pp": 5}))
    assert [p for p, _ in err.errors] == ["model.num_layers"]
    # a refused section's other fields still feed the checks around it
    err = refuse(tmp_path, merged(model={"hidden_size": 0}, parallel={"pp": 5}))
    assert sorted(p for p, _ in err.errors) == ["model.hidden_size", "parallel.pp"]


def test_every_bad_env_override_at_once(tmp_path: Path) -> None:
    err = refuse(tmp_path, BASE, {"KVXFER_CACHE__BLOK_SIZE": "16", "KVXFER_NOPE": "1", "KVXFER_CACHE__NUM_BLOCKS": "8"})
    assert [p for p, _ in err.errors] == ["cache.blok_size", "nope"]


def test_launch_file_reports_every_error(tmp_path: Path) -> None:
    write(tmp_path, BASE, "p.yaml")
    bad = write(tmp_path, {"instances": ["p.yaml", "nope.yaml", "gone.yaml"], "workload": {"num_requests": 0},
                           "router": {"prot": 1}}, "launch.yaml")
    with pytest.raises(ConfigError) as info:
        load_launch_config(bad)
    assert sorted(p for p, _ in info.value.errors) == ["instances.1", "instances.2", "router.prot",
                                                       "workload.num_requests"]
