"""Instance and launcher configuration: msgspec Structs loaded from YAML.

Every refusal names the file, the field path (``cache.block_size``) and what was
expected, so a serving engineer can fix a config without reading code. Values can be
overridden by environment variables ``KVXFER_<SECTION>__<FIELD>`` (``__`` separates
nesting levels; the value is parsed as a YAML scalar).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import yaml

logger = logging.getLogger(__name__)

ENV_PREFIX = "KVXFER_"

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535, description="0 picks an ephemeral port")]
Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=128)]
EnvVarName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]

Role = Literal["prefill", "decode", "both"]
Layout = Literal["NHD", "HND"]
CacheDtype = Literal["float32", "float16", "bfloat16", "float64", "uint8"]
ModelDtype = Literal["float32", "float64"]
HashAlgo = Literal["xxh3_128", "sha256"]
TransferMode = Literal["pull", "push"]


class ConfigError(ValueError):
    """A config was refused; ``str()`` names the file, the field path and the expectation."""

    def __init__(self, source: str, path: str, message: str) -> None:
        self.source = source
        self.path = path
        self.message = message
        where = f"{source}: {path}: " if path else f"{source}: "
        super().__init__(where + message)


def _refuse(field: str, message: str) -> ValueError:
    """An error raised inside ``__post_init__``; ``field`` is relative to the Struct."""
    return ValueError(f"[{field}] {message}")


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base for config sections: unknown keys are refused, values are immutable."""


class ModelConfig(Config):
    """The model whose KV cache moves; the reference engine builds it from a seed."""

    name: Name = "kvxfer-tiny"
    num_layers: PositiveInt = 4
    hidden_size: PositiveInt = 256
    num_heads: PositiveInt = 8
    num_kv_heads: PositiveInt = 2
    head_size: PositiveInt = 32
    intermediate_size: PositiveInt = 512
    vocab_size: PositiveInt = 1024
    max_position: PositiveInt = 4096
    rope_theta: PositiveFloat = 10000.0
    dtype: ModelDtype = "float32"
    seed: NonNegativeInt = 0
    mla: bool = False

    def __post_init__(self) -> None:
        if self.mla and self.num_kv_heads != 1:
            raise _refuse("num_kv_heads", f"expected 1 with mla (one latent head), got {self.num_kv_heads}")
        if self.num_heads % self.num_kv_heads:
            raise _refuse(
                "num_heads",
                f"expected a multiple of num_kv_heads={self.num_kv_heads}, got {self.num_heads}",
            )


class CacheConfig(Config):
    """The paged KV cache of one rank: geometry, layout, dtype, and prefix caching."""

    block_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 16
    num_blocks: PositiveInt = 1024
    layout: Layout = "NHD"
    dtype: CacheDtype = "float32"
    kv_split: bool = True
    # vLLM's CPU layout: one tensor per layer, [blocks, heads, block_size, 2 x head_size] in shape,
    # and in memory each head's K block, then its V block (HND only); inside a block the kernels
    # order tokens their own way, so blocks move whole and both sides need one block size
    kv_fused: bool = False
    cross_layer: bool = False
    device: Annotated[str, msgspec.Meta(pattern=r"^(cpu|cuda(:[0-9]+)?)$")] = "cpu"
    huge_pages: bool = True
    watermark: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.01
    enable_prefix_caching: bool = True
    hash_algo: HashAlgo = "xxh3_128"
    hash_seed: NonNegativeInt = 0

    def __post_init__(self) -> None:
        if self.block_size & (self.block_size - 1):
            raise _refuse("block_size", f"expected a power of two, got {self.block_size}")
        if self.kv_fused and (self.cross_layer or self.dtype == "uint8" or self.layout != "HND"):
            raise _refuse("kv_fused", "needs layout HND, and cannot be combined with cross_layer or the uint8 dtype")


class ParallelConfig(Config):
    """Tensor and pipeline parallel sizes; ``layer_partition`` is layers per PP stage."""

    tp: PositiveInt = 1
    pp: PositiveInt = 1
    layer_partition: list[PositiveInt] | None = None

    def __post_init__(self) -> None:
        if self.layer_partition is not None and len(self.layer_partition) != self.pp:
            raise _refuse(
                "layer_partition",
                f"expected {self.pp} entries (one per pp stage), got {len(self.layer_partition)}",
            )


class SideChannelConfig(Config):
    """ZMQ handshake server: rank r of an instance listens on ``port + r`` (0: ephemeral)."""

    host: str = "127.0.0.1"
    port: Port = 5600


class TimeoutsConfig(Config):
    """Every wait in kvxfer has one of these limits."""

    handshake_s: PositiveFloat = 5.0
    handshake_retries: NonNegativeInt = 3
    transfer_s: PositiveFloat = 30.0
    lease_s: PositiveFloat = 30.0
    abort_s: PositiveFloat = 600.0  # the longest a hold may live, renewals included
    reservation_s: PositiveFloat = 60.0
    # a read refused as "not held" is tried again this long: engines make holds asynchronously
    hold_wait_s: NonNegativeFloat = 1.0


class AuthConfig(Config):
    """Shared-secret authentication; the secret itself never appears in a config file."""

    secret_env: EnvVarName


DataPlaneValue = str | int | float | bool


class ConnectorConfig(Config):
    """Which data plane moves the bytes, and how the side channel is reached."""

    name: Name = "tcp"
    mode: TransferMode = "pull"
    side_channel: SideChannelConfig = msgspec.field(default_factory=SideChannelConfig)
    # Options for the data plane, free-form so third-party connectors need no schema change.
    data_plane: dict[str, Any] = msgspec.field(default_factory=dict)
    timeouts: TimeoutsConfig = msgspec.field(default_factory=TimeoutsConfig)
    auth: AuthConfig | None = None
    # Stage device caches through a host mirror (batched block copies): auto = when the cache
    # is not on the CPU; always = also for CPU caches (tests the path without a GPU).
    host_staging: Literal["auto", "always", "never"] = "auto"

    def __post_init__(self) -> None:
        for key, value in self.data_plane.items():
            if not isinstance(value, DataPlaneValue):
                raise _refuse(
                    f"data_plane.{key}",
                    f"expected a str, int, float or bool, got {type(value).__name__} {value!r}",
                )
        if self.timeouts.abort_s < self.timeouts.transfer_s:
            raise _refuse(
                "timeouts.abort_s",
                f"expected >= timeouts.transfer_s ({self.timeouts.transfer_s}), "
                f"got {self.timeouts.abort_s}",
            )


class ServerConfig(Config):
    """Where the instance takes requests from the router."""

    host: str = "127.0.0.1"
    port: Port = 8100
    # Prometheus metrics over HTTP (/metrics): rank r of the instance on metrics_port + r; off when unset
    metrics_port: Port | None = None


class InstanceConfig(Config):
    """One prefill, decode or combined instance: the whole of one YAML file."""

    role: Role
    engine_id: Name
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    connector: ConnectorConfig = msgspec.field(default_factory=ConnectorConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        model, par = self.model, self.parallel
        if par.layer_partition is not None and sum(par.layer_partition) != model.num_layers:
            raise _refuse(
                "parallel.layer_partition",
                f"expected entries summing to model.num_layers={model.num_layers}, "
                f"got {par.layer_partition} (sum {sum(par.layer_partition)})",
            )
        if par.layer_partition is None and par.pp > model.num_layers:
            raise _refuse(
                "parallel.pp",
                f"expected <= model.num_layers={model.num_layers}, got {par.pp}",
            )
        heads = model.num_kv_heads
        if not model.mla and heads % par.tp and par.tp % heads:
            raise _refuse(
                "parallel.tp",
                f"expected a divisor or a multiple of model.num_kv_heads={heads}, got {par.tp}",
            )
        if model.num_heads % par.tp:
            raise _refuse(
                "parallel.tp",
                f"expected a divisor of model.num_heads={model.num_heads}, got {par.tp}",
            )
        sc = self.connector.side_channel
        last = sc.port + par.tp * par.pp - 1
        if sc.port and last > 65535:
            raise _refuse(
                "connector.side_channel.port",
                f"expected port + tp*pp - 1 <= 65535 (one port per rank), got {sc.port} "
                f"with {par.tp * par.pp} ranks",
            )
        if self.cache.kv_fused and self.model.mla:
            raise _refuse("cache.kv_fused", "MLA has one latent, nothing to fuse")
        if self.cache.dtype == "uint8" and self.model.mla:
            raise _refuse("cache.dtype", "uint8 quantised cache is not supported with mla")

    @property
    def world_size(self) -> int:
        return self.parallel.tp * self.parallel.pp


class RouterConfig(Config):
    """The router in front of the instances of a launch."""

    host: str = "127.0.0.1"
    port: Port = 8000


class WorkloadConfig(Config):
    """Synthetic requests a launch sends through the router."""

    num_requests: PositiveInt = 8
    prompt_tokens: PositiveInt = 256
    output_tokens: PositiveInt = 16
    seed: NonNegativeInt = 0


class LaunchConfig(Config):
    """A paired set of instances (each its own YAML file), a router and a workload."""

    instances: Annotated[list[str], msgspec.Meta(min_length=1)]
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    workload: WorkloadConfig = msgspec.field(default_factory=WorkloadConfig)
    ready_timeout_s: PositiveFloat = 120.0
    request_timeout_s: PositiveFloat = 300.0  # the whole workload must finish within this
    prefill_timeout_s: PositiveFloat = 10.0  # the router then lets decode compute the prompt
    verify_port: Port = 8190  # the monolithic instance --verify starts


# --------------------------------------------------------------------------- loading

class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate keys instead of silently keeping the last."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node)
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        mapping[key] = loader.construct_object(value_node, deep=True)
    return mapping


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)

_MSGSPEC_PATH = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_FIELD_PREFIX = re.compile(r"^\[(?P<field>[^\]]+)\] (?P<msg>.*)$", re.S)
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`$")


def _format_validation_error(err: msgspec.ValidationError) -> tuple[str, str]:
    """Turn msgspec's ``msg - at `$.a.b``` into (``a.b``, msg), folding in our prefixes."""
    m = _MSGSPEC_PATH.match(str(err))
    assert m is not None
    msg, raw_path = m.group("msg"), m.group("path") or ""
    path = re.sub(r"\[(\d+)\]", r".\1", raw_path).lstrip(".")
    if pm := _FIELD_PREFIX.match(msg):
        path = f"{path}.{pm.group('field')}" if path else pm.group("field")
        msg = pm.group("msg")
    elif um := _UNKNOWN_FIELD.match(msg):
        path = f"{path}.{um.group('field')}" if path else um.group("field")
        msg = "unknown key (check the spelling against the documented fields)"
    elif msg.startswith("Object missing required field"):
        field = msg.split("`")[1]
        path = f"{path}.{field}" if path else field
        msg = "required field is missing"
    return path, msg


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, refusing duplicate keys and non-mapping documents."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(source, "", f"cannot read file: {e.strerror or e}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(source, "", f"invalid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, "", f"expected a mapping at the top level, got {type(data).__name__}")
    return data


def _struct_field_type(struct_type: Any, name: str) -> Any | None:
    """The annotated type of field ``name`` of a Struct type, or None if it has none."""
    for f in msgspec.structs.fields(struct_type):
        if f.encode_name == name:
            return f.type
    return None


def _unwrap_struct(tp: Any) -> type[msgspec.Struct] | None:
    """The Struct class inside ``tp`` (``X``, ``X | None``), or None for a leaf type."""
    info = msgspec.inspect.type_info(tp)
    if isinstance(info, msgspec.inspect.UnionType):
        for t in info.types:
            if isinstance(t, msgspec.inspect.StructType):
                return t.cls
        return None
    return info.cls if isinstance(info, msgspec.inspect.StructType) else None


def _is_dict_type(tp: Any) -> bool:
    return isinstance(msgspec.inspect.type_info(tp), msgspec.inspect.DictType)


def apply_env_overrides(
    data: dict[str, Any], root: type[msgspec.Struct], environ: Mapping[str, str], source: str
) -> tuple[dict[str, Any], list[str]]:
    """Return a copy of ``data`` with ``KVXFER_A__B=v`` applied as ``data[a][b] = yaml(v)``.

    An override naming no field of the schema is refused (a typo must not be ignored).
    """
    out: dict[str, Any] = _deep_copy(data)
    applied: list[str] = []
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var == ENV_PREFIX:
            continue
        parts = [p.lower() for p in var[len(ENV_PREFIX):].split("__")]
        if not all(parts):
            raise ConfigError(source, "", f"environment override {var}: empty path segment")
        struct_type: Any = root
        node = out
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if struct_type is None:  # inside a free-form dict (connector.data_plane)
                field_type = Any
            else:
                field_type = _struct_field_type(struct_type, part)
                if field_type is None:
                    if i == 0 and root is InstanceConfig and part in _NON_CONFIG_VARS:
                        break
                    raise ConfigError(
                        source, ".".join(parts), f"environment override {var} names no such field"
                    )
            if last:
                try:
                    node[part] = yaml.safe_load(environ[var]) if environ[var] != "" else ""
                except yaml.YAMLError as e:
                    raise ConfigError(source, ".".join(parts), f"{var}: invalid value: {e}") from None
                applied.append(var)
                break
            child = node.get(part)
            if child is None:
                child = {}
                node[part] = child
            if not isinstance(child, dict):
                raise ConfigError(source, ".".join(parts[: i + 1]), f"{var}: expected a mapping here")
            node = child
            struct_type = _unwrap_struct(field_type) if struct_type is not None else None
            if struct_type is None and not _is_dict_type(field_type) and field_type is not Any:
                raise ConfigError(
                    source, ".".join(parts[: i + 1]), f"environment override {var}: not a section"
                )
    return out, applied


# Variables under the prefix that are process settings, not config fields.
_NON_CONFIG_VARS = frozenset({"log_level", "secret"})


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


S = TypeVar("S", bound=msgspec.Struct)


def convert(data: Mapping[str, Any], struct_type: type[S], source: str = "<config>") -> S:
    """Validate a mapping into ``struct_type``, raising ConfigError with the field path."""
    try:
        return msgspec.convert(data, struct_type, strict=True)
    except msgspec.ValidationError as e:
        path, msg = _format_validation_error(e)
        raise ConfigError(source, path, msg) from None


def load_instance_config(
    path: str | Path, environ: Mapping[str, str] | None = None
) -> InstanceConfig:
    """Load one instance's YAML file, apply ``KVXFER_*`` overrides, validate."""
    source = str(path)
    data = read_yaml(path)
    env = os.environ if environ is None else environ
    data, applied = apply_env_overrides(data, InstanceConfig, env, source)
    if applied:
        logger.info("%s: environment overrides applied: %s", source, ", ".join(applied))
    return convert(data, InstanceConfig, source)


def load_launch_config(path: str | Path) -> LaunchConfig:
    """Load a launcher file; instance paths are resolved relative to it."""
    source = str(path)
    cfg = convert(read_yaml(path), LaunchConfig, source)
    base = Path(path).resolve().parent
    resolved = [str((base / p).resolve()) for p in cfg.instances]
    for i, p in enumerate(resolved):
        if not Path(p).is_file():
            raise ConfigError(source, f"instances.{i}", f"no such instance config: {p}")
    return msgspec.structs.replace(cfg, instances=resolved)


def is_launch_file(data: Mapping[str, Any]) -> bool:
    """A launcher file names instances; an instance file names a role."""
    return "instances" in data


def to_yaml(cfg: msgspec.Struct) -> str:
    """The resolved config, every default filled in, as YAML."""
    return yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False)
