"""Instance and launcher configuration: msgspec Structs loaded from YAML.

Every refusal names the file, the field path (``cache.block_size``) and what was
expected, so a serving engineer can fix a config without reading code; a file is refused
with every mistake it has, not only the first (each section and field is converted on its
own, and every cross-field check whose fields converted still runs). Values can be
overridden by environment variables ``KVXFER_<SECTION>__<FIELD>`` (``__`` separates
nesting levels; the value is parsed as a YAML scalar).

Secure by default: a listener bound to an address other than loopback (the side channel,
an explicit data plane ``host``, the metrics endpoint) needs ``connector.auth``; running
such a listener without authentication takes ``connector.auth: {mode: none}``, and is
logged as a warning whenever such a config is loaded.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
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
# fp8_*: a float8 cache moved as raw bytes, scales not included (vLLM's --kv-cache-dtype fp8*)
CacheDtype = Literal["float32", "float16", "bfloat16", "float64", "uint8", "fp8_e4m3", "fp8_e5m2"]
ModelDtype = Literal["float32", "float64"]
HashAlgo = Literal["xxh3_128", "sha256"]
TransferMode = Literal["pull", "push"]


Problem = tuple[str, str]  # (field path, message)
CheckFn = Callable[[Any], Iterator[Problem]]


class ConfigError(ValueError):
    """A config was refused; ``errors`` holds every (field path, message) found in it.

    ``str()`` lists them all, one per line, each as ``SOURCE: PATH: MESSAGE``; ``path`` and
    ``message`` are the first one's.
    """

    def __init__(self, source: str, path: str = "", message: str = "",
                 errors: Sequence[Problem] | None = None) -> None:
        self.source = source
        self.errors: list[Problem] = list(errors) if errors else [(path, message)]
        self.path, self.message = self.errors[0]
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        """One line per error: ``SOURCE: PATH: MESSAGE`` (``SOURCE: MESSAGE`` for the whole file)."""
        return [f"{self.source}: {p}: {m}" if p else f"{self.source}: {m}" for p, m in self.errors]


class ConfigProblems(ValueError):
    """Raised by a Config's ``__post_init__``: every cross-field problem, paths relative to the Struct."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(f"[{p}] {m}" for p, m in self.problems))


def check(*needs: str) -> Callable[[CheckFn], CheckFn]:
    """Mark a Config method as a cross-field check that reads the fields ``needs``.

    ``needs`` are field paths relative to the Struct (``model.num_layers``): every field the
    check reads. It yields (path relative to the Struct, message) for each problem. A loader
    runs it even when other fields were refused, as long as each of ``needs`` converted; the
    method then gets a namespace of the fields that converted, not the Struct (no properties,
    no methods), so a check must read nothing outside ``needs``.
    """

    def mark(fn: CheckFn) -> CheckFn:
        fn.__kvxfer_needs__ = tuple(needs)  # type: ignore[attr-defined]
        return fn

    return mark


@functools.cache
def _checks_of(cls: type) -> tuple[tuple[tuple[str, ...], CheckFn], ...]:
    """The checks of a Config class, base classes' first, each in declaration order."""
    out: list[tuple[tuple[str, ...], CheckFn]] = []
    for klass in reversed(cls.__mro__):
        for obj in vars(klass).values():
            needs = getattr(obj, "__kvxfer_needs__", None)
            if needs is not None:
                out.append((needs, obj))
    return tuple(out)


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base for config sections: unknown keys are refused, values are immutable.

    Cross-field rules are methods marked with :func:`check`; constructing a section (in code,
    by ``msgspec.structs.replace`` or by decoding) raises :class:`ConfigProblems` with all of them.
    """

    def __post_init__(self) -> None:
        problems = [p for _, fn in _checks_of(type(self)) for p in fn(self)]
        if problems:
            raise ConfigProblems(problems)


# ------------------------------------------------------------------------ loopback and auth

def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1 (also as ``[::1]`` or IPv4-mapped); no name is resolved."""
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def unauthenticated_refusal(host: str, listener: str = "") -> str:
    """The message for a non-loopback listener without ``connector.auth``."""
    what = f" ({listener} listens there)" if listener else ""
    return (f"{host} is not a loopback address{what} and connector.auth is not set; set connector.auth.secret_env, "
            f"or auth: {{mode: none}} to run without authentication")


class ModelConfig(Config, frozen=True):
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

    @check("mla", "num_kv_heads")
    def _check_mla_heads(self) -> Iterator[Problem]:
        if self.mla and self.num_kv_heads != 1:
            yield "num_kv_heads", f"expected 1 with mla (one latent head), got {self.num_kv_heads}"

    @check("num_heads", "num_kv_heads")
    def _check_heads(self) -> Iterator[Problem]:
        if self.num_heads % self.num_kv_heads:
            yield "num_heads", f"expected a multiple of num_kv_heads={self.num_kv_heads}, got {self.num_heads}"


class CacheConfig(Config, frozen=True):
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
    # the kernel's order inside a fused block: "vec" (vLLM's CPU vec/vec16 kernels: K transposed,
    # [head_size][block_size], then V token-major), another kernel's name (moved only whole, to the
    # same order), or "" (not known: moved whole, to any order)
    fused_order: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9]{0,16}$")] = ""
    cross_layer: bool = False
    device: Annotated[str, msgspec.Meta(pattern=r"^(cpu|cuda(:[0-9]+)?)$")] = "cpu"
    huge_pages: bool = True
    watermark: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.01
    enable_prefix_caching: bool = True
    hash_algo: HashAlgo = "xxh3_128"
    hash_seed: NonNegativeInt = 0

    @check("block_size")
    def _check_block_size(self) -> Iterator[Problem]:
        if self.block_size & (self.block_size - 1):
            yield "block_size", f"expected a power of two, got {self.block_size}"

    @check("kv_fused", "cross_layer", "dtype", "layout")
    def _check_kv_fused(self) -> Iterator[Problem]:
        if self.kv_fused and (self.cross_layer or self.dtype == "uint8" or self.layout != "HND"):
            yield "kv_fused", "needs layout HND, and cannot be combined with cross_layer or the uint8 dtype"


class ParallelConfig(Config, frozen=True):
    """Tensor and pipeline parallel sizes; ``layer_partition`` is layers per PP stage."""

    tp: PositiveInt = 1
    pp: PositiveInt = 1
    layer_partition: list[PositiveInt] | None = None

    @check("layer_partition", "pp")
    def _check_partition(self) -> Iterator[Problem]:
        if self.layer_partition is not None and len(self.layer_partition) != self.pp:
            yield "layer_partition", f"expected {self.pp} entries (one per pp stage), got {len(self.layer_partition)}"


class SideChannelConfig(Config, frozen=True):
    """ZMQ handshake server: rank r of an instance listens on ``port + r`` (0: ephemeral)."""

    host: str = "127.0.0.1"
    port: Port = 5600


class TimeoutsConfig(Config, frozen=True):
    """Every wait in kvxfer has one of these limits."""

    handshake_s: PositiveFloat = 5.0
    handshake_retries: NonNegativeInt = 3
    transfer_s: PositiveFloat = 30.0
    lease_s: PositiveFloat = 30.0
    abort_s: PositiveFloat = 600.0  # the longest a hold may live, renewals included
    reservation_s: PositiveFloat = 60.0
    # a read refused as "not held" is tried again this long: engines make holds asynchronously
    hold_wait_s: NonNegativeFloat = 5.0  # vLLM under load: a step can take seconds


class AuthConfig(Config, frozen=True):
    """Shared-secret authentication; the secret itself never appears in a config file.

    ``mode: secret`` (the default) needs ``secret_env``, the name of the environment variable
    holding the secret. ``mode: none`` is the explicit opt-out that lets a listener bind to a
    non-loopback address without authentication; ``secret_env`` stays None then, so
    ``auth.secret_env`` alone tells whether authentication is on.
    """

    mode: Literal["secret", "none"] = "secret"
    secret_env: EnvVarName | None = None

    @check("mode", "secret_env")
    def _check_mode(self) -> Iterator[Problem]:
        if self.mode == "secret" and self.secret_env is None:
            yield ("secret_env", "required with mode secret (the name of the environment variable holding "
                                 "the shared secret); or mode: none to run without authentication")
        if self.mode == "none" and self.secret_env is not None:
            yield "secret_env", f"expected no secret_env with mode none, got {self.secret_env!r}"


DataPlaneValue = str | int | float | bool


class ConnectorConfig(Config, frozen=True):
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
    # Where the rank's data path runs: in a transfer agent process of its own (its bytes never
    # wait for the engine's GIL), in the engine's process, or auto: the agent for every data
    # plane that works across processes (all but ``local``).
    data_path: Literal["auto", "agent", "engine"] = "auto"
    # Which CPUs a transfer agent may run on: any this process may use, or only those of the
    # engine thread that starts it (its worker's cores). ``engine`` suits servers on cores of their
    # own where the kernel shares CPU by session (autogroup): elsewhere an agent gets its session's
    # small share of another server's core. ``any`` suits cores left free of workers, and more
    # spinning workers than cores (pinned there, agents starved). docs/vllm.md has the figures.
    agent_cpus: Literal["any", "engine"] = "any"
    # The transfer agent's nice value (every thread of it), -20..19; 0 leaves it as the engine's
    # (an absolute value otherwise, not one relative to the engine's).
    # A negative value lets an agent's threads preempt a busy engine's when both want one core: a
    # transfer then keeps its speed while the engine spins (docs/benchmarks.md has the figures). It
    # needs CAP_SYS_NICE or an RLIMIT_NICE that allows it; without either the registration is
    # refused by name, never run at a priority other than the one asked for.
    agent_nice: Annotated[int, msgspec.Meta(ge=-20, le=19)] = 0
    # A load of at most this many bytes (this rank's share), from producer ranks already known,
    # is planned and issued on the thread that calls start_load (the agent's, with a transfer
    # agent), and on cma copied there too: no hand-off to the worker thread. 0: every load goes
    # through the worker.
    inline_load_bytes: NonNegativeInt = 16 << 20
    # With a transfer agent, a load of at most this many bytes (this rank's share) is copied by the
    # engine's own thread in start_load, where the data plane reads one-sided (cma) from producer
    # ranks the agent has handshaken, checked against their hold boards: no round trip through the
    # agent, as NIXL's caller copies. Anything else goes to the agent. 0: the agent loads everything.
    engine_copy_bytes: NonNegativeInt = 16 << 20
    # Such a copy of at least this many bytes lets the GIL go (the same native span copy), the
    # short switch interval claimed for it: a busy Python thread of the engine runs meanwhile, on a
    # core the copy's helper threads would have used. Kept (the default), the busy thread waits
    # while the engine's thread and the helpers copy (docs/benchmarks.md). 0: every copy keeps the GIL.
    engine_copy_release_gil_bytes: NonNegativeInt = 0
    # With a transfer agent: the interpreter's switch interval while this rank has loads in flight
    # (process-wide; the engine's own value comes back when no rank of the process has any). A busy
    # Python thread of the engine then hands the GIL to the thread that sees a load finish after this
    # long, not CPython's 5 ms. 0: never changed.
    gil_switch_interval_s: Annotated[float, msgspec.Meta(ge=0, le=0.1)] = 0.0005
    # With a transfer agent, while a ``poll(timeout_s)`` waits (GIL released) for one of those loads:
    # only the engine's other threads run Python meanwhile, and the woken thread has the GIL this long
    # after it asks (kvxfer/switch_interval.py). 0: the in-flight value serves the wait too (and with
    # gil_switch_interval_s 0 this one is off as well: kvxfer never touches the interval).
    gil_wait_switch_interval_s: Annotated[float, msgspec.Meta(ge=0, le=0.1)] = 0.00005

    @check("data_plane")
    def _check_data_plane(self) -> Iterator[Problem]:
        for key, value in self.data_plane.items():
            if not isinstance(value, DataPlaneValue):
                yield f"data_plane.{key}", f"expected a str, int, float or bool, got {type(value).__name__} {value!r}"

    @check("timeouts.abort_s", "timeouts.transfer_s")
    def _check_timeouts(self) -> Iterator[Problem]:
        if self.timeouts.abort_s < self.timeouts.transfer_s:
            yield ("timeouts.abort_s",
                   f"expected >= timeouts.transfer_s ({self.timeouts.transfer_s}), got {self.timeouts.abort_s}")

    @check("side_channel.host", "data_plane", "auth")
    def _check_listeners(self) -> Iterator[Problem]:
        if self.auth is None:
            for path, host in connector_listeners(self):
                yield path, unauthenticated_refusal(host)


def connector_listeners(connector: Any) -> list[tuple[str, str]]:
    """(path relative to ``connector``, host) of its listeners bound to a non-loopback address.

    The side channel, and the data plane's own ``host`` option where one is set (a data plane
    without one listens on the side channel's host).
    """
    out = []
    if not is_loopback(connector.side_channel.host):
        out.append(("side_channel.host", connector.side_channel.host))
    host = connector.data_plane.get("host")
    if isinstance(host, str) and not is_loopback(host):
        out.append(("data_plane.host", host))
    return out


class ServerConfig(Config, frozen=True):
    """Where the instance takes requests from the router."""

    host: str = "127.0.0.1"
    port: Port = 8100
    # Prometheus metrics over HTTP (/metrics): rank r of the instance on metrics_port + r; off when unset
    metrics_port: Port | None = None


class InstanceConfig(Config, frozen=True):
    """One prefill, decode or combined instance: the whole of one YAML file."""

    role: Role
    engine_id: Name
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    connector: ConnectorConfig = msgspec.field(default_factory=ConnectorConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)

    @check("model.num_layers", "parallel.pp", "parallel.layer_partition")
    def _check_layers(self) -> Iterator[Problem]:
        model, par = self.model, self.parallel
        if par.layer_partition is not None and sum(par.layer_partition) != model.num_layers:
            yield ("parallel.layer_partition",
                   f"expected entries summing to model.num_layers={model.num_layers}, "
                   f"got {par.layer_partition} (sum {sum(par.layer_partition)})")
        if par.layer_partition is None and par.pp > model.num_layers:
            yield "parallel.pp", f"expected <= model.num_layers={model.num_layers}, got {par.pp}"

    @check("model.mla", "model.num_kv_heads", "model.num_heads", "parallel.tp")
    def _check_tp(self) -> Iterator[Problem]:
        model, par = self.model, self.parallel
        heads = model.num_kv_heads
        if not model.mla and heads % par.tp and par.tp % heads:
            yield "parallel.tp", f"expected a divisor or a multiple of model.num_kv_heads={heads}, got {par.tp}"
        elif model.num_heads % par.tp:
            yield "parallel.tp", f"expected a divisor of model.num_heads={model.num_heads}, got {par.tp}"

    @check("connector.side_channel.port", "parallel.tp", "parallel.pp")
    def _check_side_channel_ports(self) -> Iterator[Problem]:
        sc, par = self.connector.side_channel, self.parallel
        if sc.port and sc.port + par.tp * par.pp - 1 > 65535:
            yield ("connector.side_channel.port",
                   f"expected port + tp*pp - 1 <= 65535 (one port per rank), got {sc.port} "
                   f"with {par.tp * par.pp} ranks")

    @check("cache.kv_fused", "cache.dtype", "model.mla")
    def _check_mla_cache(self) -> Iterator[Problem]:
        if self.cache.kv_fused and self.model.mla:
            yield "cache.kv_fused", "MLA has one latent, nothing to fuse"
        if self.cache.dtype == "uint8" and self.model.mla:
            yield "cache.dtype", "uint8 quantised cache is not supported with mla"

    @check("connector.auth", "server.host", "server.metrics_port")
    def _check_metrics_listener(self) -> Iterator[Problem]:
        s = self.server
        if self.connector.auth is None and s.metrics_port is not None and not is_loopback(s.host):
            yield "server.host", unauthenticated_refusal(s.host, "the metrics endpoint of server.metrics_port")

    @property
    def world_size(self) -> int:
        return self.parallel.tp * self.parallel.pp


def instance_listeners(cfg: InstanceConfig) -> list[tuple[str, str]]:
    """(field path, host) of every listener of an instance bound to a non-loopback address."""
    out = [(f"connector.{path}", host) for path, host in connector_listeners(cfg.connector)]
    if cfg.server.metrics_port is not None and not is_loopback(cfg.server.host):
        out.append(("server.host", cfg.server.host))
    return out


def warn_unauthenticated(source: str, auth: AuthConfig | None, listeners: Sequence[tuple[str, str]]) -> None:
    """Log a warning when ``auth: {mode: none}`` lets listeners serve beyond loopback."""
    if auth is not None and auth.mode == "none" and listeners:
        logger.warning("%s: connector.auth.mode is none, so these listeners serve anyone who can reach them, "
                       "without authentication: %s", source, ", ".join(f"{path} ({host})" for path, host in listeners))


class RouterConfig(Config, frozen=True):
    """The router in front of the instances of a launch.

    Its ``host`` is the launch's front door (requests in, tokens out), the way a vLLM API server
    is: it serves no KV memory and ``connector.auth`` does not cover it, so it may bind to any
    address without one.
    """

    """The router in front of the instances of a launch."""

    host: str = "127.0.0.1"
    port: Port = 8000


class WorkloadConfig(Config, frozen=True):
    """Synthetic requests a launch sends through the router."""

    num_requests: PositiveInt = 8
    prompt_tokens: PositiveInt = 256
    output_tokens: PositiveInt = 16
    seed: NonNegativeInt = 0


class LaunchConfig(Config, frozen=True):
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

    An override naming no field of the schema is refused (a typo must not be ignored); every
    bad override is named in one ConfigError.
    """
    out: dict[str, Any] = _deep_copy(data)
    applied: list[str] = []
    errors: list[Problem] = []
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var == ENV_PREFIX:
            continue
        parts = [p.lower() for p in var[len(ENV_PREFIX):].split("__")]
        if not all(parts):
            errors.append(("", f"environment override {var}: empty path segment"))
            continue
        problem = _apply_env_override(out, root, parts, var, environ[var])
        if problem is None:
            applied.append(var)
        elif problem[1]:
            errors.append(problem)
    if errors:
        raise ConfigError(source, errors=errors)
    return out, applied


def _apply_env_override(out: dict[str, Any], root: type[msgspec.Struct], parts: list[str], var: str,
                        value: str) -> Problem | None:
    """Apply one override to ``out``; None when applied, else the problem ("" message: not a config field)."""
    struct_type: Any = root
    node = out
    for i, part in enumerate(parts):
        field_type: object  # a field's annotation: a class, a union, typing.Any
        if struct_type is None:  # inside a free-form dict (connector.data_plane)
            field_type = Any
        else:
            field_type = _struct_field_type(struct_type, part)
            if field_type is None:
                if i == 0 and root is InstanceConfig and part in _NON_CONFIG_VARS:
                    return ("", "")
                return ".".join(parts), f"environment override {var} names no such field"
        if i == len(parts) - 1:
            try:
                node[part] = yaml.safe_load(value) if value != "" else ""
            except yaml.YAMLError as e:
                return ".".join(parts), f"{var}: invalid value: {e}"
            return None
        child = node.get(part)
        if child is None:
            child = {}
            node[part] = child
        if not isinstance(child, dict):
            return ".".join(parts[: i + 1]), f"{var}: expected a mapping here"
        node = child
        struct_type = _unwrap_struct(field_type) if struct_type is not None else None
        if struct_type is None and not _is_dict_type(field_type) and field_type is not Any:
            return ".".join(parts[: i + 1]), f"environment override {var}: not a section"
    return None


# Variables under the prefix that are process settings, not config fields.
_NON_CONFIG_VARS = frozenset({"log_level", "secret"})


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


S = TypeVar("S", bound=msgspec.Struct)


UNKNOWN_KEY = "unknown key (check the spelling against the documented fields)"
_FAILED: Any = object()  # a value that did not convert


class _Partial(SimpleNamespace):
    """The fields of a refused Struct that did convert: what the checks of the Struct around it may read."""


def _available(view: Any, need: str) -> bool:
    """Whether the field path ``need`` converted (it leads through no refused value)."""
    obj = view
    for part in need.split("."):
        if isinstance(obj, _Partial) and part not in vars(obj):
            return False
        if not isinstance(obj, _Partial) and not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return not isinstance(obj, _Partial)


def _join(path: str, sub: str) -> str:
    return f"{path}.{sub}" if path and sub else path or sub


def collect(data: Any, tp: Any, path: str = "") -> tuple[Any, list[Problem]]:
    """Convert ``data`` to ``tp``, finding every problem rather than stopping at the first.

    A Struct (also inside ``X | None``) given a mapping is converted field by field: unknown
    keys, missing required fields and each field's own errors are all collected, then every
    cross-field check (:func:`check`) whose fields converted runs. Anything else is one
    ``msgspec.convert``. Returns (the value, []) or (a placeholder, problems), each problem's
    path prefixed by ``path``; a refused Struct's placeholder keeps the fields that converted.
    """
    struct = _unwrap_struct(tp)
    if struct is not None and isinstance(data, dict):
        return _collect_struct(data, struct, path)
    try:
        return msgspec.convert(data, tp, strict=True), []
    except msgspec.ValidationError as e:
        sub, msg = _format_validation_error(e)
        return _FAILED, [(_join(path, sub), msg)]


def _collect_struct(data: dict[Any, Any], cls: type[msgspec.Struct], path: str) -> tuple[Any, list[Problem]]:
    fields = {f.encode_name: f for f in msgspec.structs.fields(cls)}
    values: dict[str, Any] = {}  # what converted, and the partial views of refused sections
    failed: set[str] = set()
    problems: list[Problem] = []
    for key, value in data.items():
        f = fields.get(key) if isinstance(key, str) else None
        if f is None:
            problems.append((_join(path, str(key)), UNKNOWN_KEY))
            continue
        converted, found = collect(value, f.type, _join(path, f.encode_name))
        problems += found
        if found:
            failed.add(f.name)
        if not found or isinstance(converted, _Partial):
            values[f.name] = converted
    for f in fields.values():
        if f.required and f.encode_name not in data:
            problems.append((_join(path, f.encode_name), "required field is missing"))
            failed.add(f.name)
    view = _Partial(**{f.name: values[f.name] if f.name in values else
                       f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
                       for f in fields.values() if f.name in values or f.name not in failed})
    for needs, fn in _checks_of(cls):
        if all(_available(view, need) for need in needs):
            problems += [(_join(path, p), m) for p, m in fn(view)]
    if problems:
        return view, problems
    try:
        return cls(**values), []
    except ConfigProblems as e:  # every check ran above, so only a check that reads outside its needs gets here
        return view, [(_join(path, p), m) for p, m in e.problems]


def convert(data: Mapping[str, Any], struct_type: type[S], source: str = "<config>") -> S:
    """Validate a mapping into ``struct_type``; a ConfigError names every problem with its field path."""
    value, problems = collect(data, struct_type)
    if problems:
        raise ConfigError(source, errors=problems)
    assert isinstance(value, struct_type)
    return value


def load_instance_config(
    path: str | Path, environ: Mapping[str, str] | None = None
) -> InstanceConfig:
    """Load one instance's YAML file, apply ``KVXFER_*`` overrides, validate (every error at once)."""
    source = str(path)
    data = read_yaml(path)
    env = os.environ if environ is None else environ
    data, applied = apply_env_overrides(data, InstanceConfig, env, source)
    if applied:
        logger.info("%s: environment overrides applied: %s", source, ", ".join(applied))
    cfg = convert(data, InstanceConfig, source)
    warn_unauthenticated(source, cfg.connector.auth, instance_listeners(cfg))
    return cfg


def load_launch_config(path: str | Path) -> LaunchConfig:
    """Load a launcher file; instance paths are resolved relative to it and must exist."""
    source = str(path)
    data = read_yaml(path)
    cfg, problems = collect(data, LaunchConfig)
    resolved: list[str] = []
    if not any(p.split(".")[0] == "instances" for p, _ in problems):  # a valid list: its files are checked too
        base = Path(path).resolve().parent
        resolved = [str((base / p).resolve()) for p in data["instances"]]
        problems += [(f"instances.{i}", f"no such instance config: {p}")
                     for i, p in enumerate(resolved) if not Path(p).is_file()]
    if problems:
        raise ConfigError(source, errors=problems)
    return msgspec.structs.replace(cfg, instances=resolved)


def is_launch_file(data: Mapping[str, Any]) -> bool:
    """A launcher file names instances; an instance file names a role."""
    return "instances" in data


def to_yaml(cfg: msgspec.Struct) -> str:
    """The resolved config, every default filled in, as YAML."""
    return yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False)
