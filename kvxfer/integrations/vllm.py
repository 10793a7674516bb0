"""kvxfer as a vLLM KV connector: ``kv_connector: KvxferConnector``.

vLLM builds a connector twice, as in its own NixlConnector: a scheduler side (in the engine
core) that decides what to load and what to keep for a reader, and a worker side (one per
rank) that owns a ``kvxfer.Connector`` over the rank's KV tensors. They talk through the
per-step metadata vLLM carries from scheduler to workers.

Prefill (``kv_role: kv_producer``): a request sent with ``kv_transfer_params:
{"do_remote_decode": true}`` finishes after its prompt; ``request_finished`` keeps its blocks
(vLLM frees them once a worker reports the request in ``finished_sending``), returns the
kvxfer params for the decode instance, and the next step's metadata tells every worker to
hold those blocks. Decode (``kv_consumer``): a request arriving with those params reports its
prompt as external tokens, loaded asynchronously; once vLLM has allocated blocks, the workers
pull them. A failed load is reported with its block ids, and vLLM recomputes them
(``kv_load_failure_policy: recompute``) or fails the request (its default).

Settings come from ``kv_connector_extra_config`` (see :class:`VllmSettings`): its
``connector`` key takes a kvxfer YAML's ``connector`` section, validated by the same schema
(:class:`kvxfer.config.ConnectorConfig`), or its ``config`` key names a kvxfer YAML whose
``connector`` section is used. Model, cache and parallel geometry always come from vLLM.
vLLM's CPU cache is one tensor per layer, shaped ``[blocks, kv_heads, block_size, 2 * head_size]``,
K rows then V rows per head: kvxfer's ``kv_fused`` HND layout.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvxfer.cache.spec import TORCH_DTYPES, KVCacheSpec, spec_from_config
from kvxfer.cache.tensors import KVCache
from kvxfer.config import (
    CacheConfig,
    CacheDtype,
    Config,
    ConfigError,
    ConnectorConfig,
    InstanceConfig,
    ModelConfig,
    ParallelConfig,
    Port,
    Problem,
    Role,
    SideChannelConfig,
    check,
    collect,
    connector_listeners,
    convert,
    is_loopback,
    read_yaml,
    unauthenticated_refusal,
    warn_unauthenticated,
)
from kvxfer.connector import Connector, EngineConnector
from kvxfer.metrics import MetricsServer
from kvxfer.protocol import KVTransferParams, RemoteRank
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.consumer import AlreadyLoading

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

PARAMS_KEY = "kvxfer"  # where kvxfer's params ride inside vLLM's kv_transfer_params
ROLES: dict[str, Role] = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
_LAYER = re.compile(r"layers\.(\d+)\.")


SOURCE = "kv_transfer_config"  # how errors name vLLM's --kv-transfer-config
EXTRA = "kv_connector_extra_config"
# vLLM hands every rank's side-channel address over in its handshake metadata: free ports by default
SIDE_CHANNEL_PORT = 0
# Deprecated flat keys of kv_connector_extra_config and their place in its connector section.
LEGACY_KEYS = {
    "data_plane": "name", "data_plane_options": "data_plane", "side_channel_host": "side_channel.host",
    "side_channel_port": "side_channel.port", "handshake_s": "timeouts.handshake_s",
    "transfer_s": "timeouts.transfer_s", "lease_s": "timeouts.lease_s", "abort_s": "timeouts.abort_s",
    "auth_secret_env": "auth.secret_env",
}


def _vllm_connector() -> ConnectorConfig:
    return ConnectorConfig(side_channel=SideChannelConfig(port=SIDE_CHANNEL_PORT))


class VllmSettings(Config, frozen=True):
    """``kv_connector_extra_config``; unknown keys are refused by name, every error at once.

    ``connector`` is a kvxfer YAML's ``connector`` section (every field: data plane and its
    options, side channel, timeouts, auth), except that ``side_channel.port`` defaults to 0;
    ``config`` names a kvxfer instance YAML to take that section from instead (not both).
    """

    connector: ConnectorConfig = msgspec.field(default_factory=_vllm_connector)
    config: str | None = None  # a kvxfer instance YAML whose `connector` section is used
    model_name: str | None = None  # what both instances must agree on; default vLLM's served name
    metrics_port: Port | None = None  # kvxfer's Prometheus endpoint; rank r on port + r (0: any free port)
    metrics_host: str = "127.0.0.1"

    @check("connector.auth", "metrics_host", "metrics_port")
    def _check_metrics_listener(self) -> Iterator[Problem]:
        if self.connector.auth is None and self.metrics_port is not None and not is_loopback(self.metrics_host):
            yield "metrics_host", unauthenticated_refusal(self.metrics_host, "the metrics endpoint of metrics_port")


def _settings_data(extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str], list[Problem]]:
    """``extra`` as VllmSettings data: legacy keys moved into ``connector``, a ``config`` YAML's section read.

    Returns the data, {connector path: legacy key} (to name the key a user wrote), and problems.
    """
    data = dict(extra)
    legacy = {k: data.pop(k) for k in list(data) if k in LEGACY_KEYS}
    problems: list[Problem] = []
    renames: dict[str, str] = {}
    if "config" in data:
        problems += [(k, "cannot be combined with config (the connector section comes from that file)")
                     for k in ("connector", *legacy) if k in data or k in legacy]
        path = data["config"]
        if not problems and isinstance(path, str):
            try:
                data["connector"] = msgspec.to_builtins(convert(read_yaml(path), InstanceConfig, path).connector)
            except ConfigError as e:
                problems += [("config", line) for line in e.lines()]
        return data, renames, problems
    if legacy:
        logger.warning("%s: %s deprecated; give %s instead", EXTRA, ", ".join(sorted(legacy)),
                       ", ".join(f"connector.{LEGACY_KEYS[k]}" for k in sorted(legacy)))
    conn = data.get("connector")
    if conn is None:
        conn = {}
    if not isinstance(conn, dict):
        return data, renames, problems  # refused by the schema, with its path
    conn = copy.deepcopy(conn)
    for key, value in legacy.items():
        *parents, leaf = LEGACY_KEYS[key].split(".")
        node = conn
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        if not isinstance(node, dict):
            problems.append((key, f"cannot be combined with connector.{'.'.join(parents)}, not a mapping"))
        elif leaf in node:
            problems.append((key, f"also set as connector.{LEGACY_KEYS[key]}; set it once"))
        else:
            node[leaf] = value
            renames[f"connector.{LEGACY_KEYS[key]}"] = key
    side = conn.setdefault("side_channel", {})
    if isinstance(side, dict):
        side.setdefault("port", SIDE_CHANNEL_PORT)
    data["connector"] = conn
    return data, renames, problems


def _renamed(path: str, renames: dict[str, str]) -> str:
    for conn_path, key in renames.items():
        if path == conn_path or path.startswith(conn_path + "."):
            return key + path[len(conn_path):]
    return path


def read_settings(extra: dict[str, Any], kv_role: str | None = None) -> VllmSettings:
    """Validate ``kv_connector_extra_config`` (and ``kv_role`` when given); one ConfigError names every problem."""
    data, renames, problems = _settings_data(extra)
    settings, found = collect(data, VllmSettings)
    problems += [(_renamed(p, renames), m) for p, m in found]
    errors = [(f"{EXTRA}.{p}", m) for p, m in problems]
    if kv_role is not None and kv_role not in ROLES:
        errors.append(("kv_role", f"expected one of {sorted(ROLES)}, got {kv_role!r}"))
    if errors:
        raise ConfigError(SOURCE, errors=errors)
    assert isinstance(settings, VllmSettings)
    listeners = [(f"{EXTRA}.{_renamed('connector.' + p, renames)}", host)
                 for p, host in connector_listeners(settings.connector)]
    if settings.metrics_port is not None and not is_loopback(settings.metrics_host):
        listeners.append((f"{EXTRA}.metrics_host", settings.metrics_host))
    warn_unauthenticated(SOURCE, settings.connector.auth, listeners)
    return settings


def _name(text: str) -> str:
    """A kvxfer name (letters, digits, ``._-``) from a vLLM id or model path."""
    out = re.sub(r"[^A-Za-z0-9._-]", "-", text.rstrip("/").rsplit("/", 1)[-1]).lstrip("._-")
    return out[:128] or "vllm"


def fused_order(vllm_config: VllmConfig, dtype: CacheDtype) -> str:
    """The order vLLM's CPU attention keeps inside a block ("vec" for its vec and vec16 kernels,
    else the kernel's name), or "" where kvxfer cannot tell: blocks then move only whole."""
    if vllm_config.cache_config.cache_dtype not in ("auto", None):  # fp8 caches: another writer, not checked
        return ""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = str(_get_attn_isa(TORCH_DTYPES[dtype], vllm_config.cache_config.block_size,
                                vllm_config.model_config.get_head_size()))
    except (ImportError, AttributeError, TypeError, NotImplementedError, KeyError) as e:
        logger.warning("vLLM's CPU attention kernel not known (%s): KV blocks move only whole, to one block size", e)
        return ""
    return "vec" if isa in ("vec", "vec16") else isa


# vLLM's --kv-cache-dtype values kvxfer moves, and the dtype it gives them ("auto": the model's)
FP8_CACHE_DTYPES: dict[str, CacheDtype] = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
MODEL_CACHE_DTYPES: tuple[CacheDtype, ...] = ("float32", "float16", "bfloat16")


def kv_dtype(cache_dtype: str | None, kv_caches: dict[str, torch.Tensor]) -> CacheDtype:
    """kvxfer's dtype for vLLM's KV tensors (``cache_dtype``: vLLM's ``--kv-cache-dtype``).

    An fp8 cache is a uint8 tensor in vLLM: kvxfer moves its bytes as the named float8 type, so
    a peer with the other fp8 format (or none) is refused at the handshake, not read as garbage.
    Its scales are not moved: both sides must have the same (vLLM's default 1.0, or the same
    checkpoint's). ValueError names what kvxfer cannot move."""
    cd = cache_dtype or "auto"
    found = {t.dtype for t in kv_caches.values()}
    if len(found) != 1:
        raise ValueError(f"register_kv_caches: KV tensors of {len(found)} dtypes ({sorted(map(str, found))}; "
                         "--kv-cache-dtype-skip-layers?): kvxfer moves one dtype per cache")
    (t,) = found
    if cd in FP8_CACHE_DTYPES:
        if t.itemsize != 1:
            raise ValueError(f"register_kv_caches: --kv-cache-dtype {cd} but the KV tensors are {t}")
        return FP8_CACHE_DTYPES[cd]
    if cd not in ("auto", *MODEL_CACHE_DTYPES):
        raise ValueError(f"register_kv_caches: --kv-cache-dtype {cd} is not one kvxfer moves (auto, "
                         f"{', '.join(FP8_CACHE_DTYPES)})")
    dtype = next((k for k in MODEL_CACHE_DTYPES if TORCH_DTYPES[k] == t), None)
    if dtype is None:
        raise ValueError(f"register_kv_caches: KV dtype {t} is not one kvxfer moves ({', '.join(MODEL_CACHE_DTYPES)}, "
                         f"or fp8 with --kv-cache-dtype {'/'.join(FP8_CACHE_DTYPES)})")
    return dtype


def layer_partition(num_layers: int, pp: int) -> list[int] | None:
    """vLLM's layers per pipeline stage (``get_pp_indices``: its own split, or ``VLLM_PP_LAYER_PARTITION``),
    which can differ from kvxfer's even split (4 layers on 3 stages: vLLM 1, 2, 1; kvxfer 2, 1, 1)."""
    if pp == 1:
        return None
    from vllm.distributed.utils import get_pp_indices

    return [end - start for start, end in (get_pp_indices(num_layers, r, pp) for r in range(pp))]


def instance_config(vllm_config: VllmConfig, num_blocks: int,
                    dtype: CacheDtype = "float32") -> tuple[VllmSettings, InstanceConfig]:
    """The kvxfer view of a vLLM instance: role, geometry from vLLM, connector from the settings."""
    kvt = vllm_config.kv_transfer_config
    if kvt is None:
        raise ConfigError(SOURCE, message="not set: the kvxfer connector runs only as vLLM's kv_connector")
    s = read_settings(dict(kvt.kv_connector_extra_config or {}), kvt.kv_role)
    if kvt.kv_role is None:
        raise ConfigError(SOURCE, "kv_role", f"expected one of {sorted(ROLES)}, got None")
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    hf = mc.hf_text_config
    served = mc.served_model_name
    if isinstance(served, list):  # vLLM resolves a list to its first name (get_served_model_name)
        served = served[0] if served else None
    model = ModelConfig(name=_name(s.model_name or served or mc.model),
                        num_layers=mc.get_total_num_hidden_layers(), num_heads=hf.num_attention_heads,
                        num_kv_heads=mc.get_total_num_kv_heads(), head_size=mc.get_head_size())
    return s, InstanceConfig(
        role=ROLES[kvt.kv_role], engine_id=_name(kvt.engine_id or "vllm"), model=model,
        cache=CacheConfig(block_size=vllm_config.cache_config.block_size, num_blocks=max(num_blocks, 1),
                          layout="HND", kv_fused=True, fused_order=fused_order(vllm_config, dtype), dtype=dtype,
                          huge_pages=False),
        parallel=ParallelConfig(tp=pc.tensor_parallel_size, pp=pc.pipeline_parallel_size,
                                layer_partition=layer_partition(model.num_layers, pc.pipeline_parallel_size)),
        connector=s.connector,
    )


# ---------------------------------------------------------------------------- scheduler -> worker
@dataclass
class LoadOrder:
    request_id: str  # this instance's id
    params: bytes  # kvxfer params (msgpack), the producer's id inside
    block_ids: list[int]  # every block of the prompt, local prefix hits included
    num_cached_tokens: int


@dataclass
class HoldOrder:
    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class KvxferMetadata(KVConnectorMetadata):
    loads: list[LoadOrder] = field(default_factory=list)
    holds: list[HoldOrder] = field(default_factory=list)
    abandons: list[tuple[str, bytes, str]] = field(default_factory=list)  # (request id, params, why)
    idle: bool = False  # the step computes nothing: the worker may wait for its loads (IDLE_STEP_WAIT_S)


@dataclass
class KvxferHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler once at start: where this rank's side channel listens, and its generation."""

    rank: int
    host: str
    port: int
    generation: int


@dataclass
class KvxferStats(KVConnectorStats):
    """Counter increments of kvxfer's connectors over one logging interval, summed over ranks."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


# at most this long an empty engine step (nothing scheduled) waits in poll for a load in flight to
# finish, or a hold to end: a new request that arrives meanwhile is scheduled this much later at
# worst. Longer than a 16 MiB load takes here (4-8 ms on cma): with 2 ms the wait ran out first and
# the load was handed over a few steps later (median 4.7 ms after the agent's event, against 0.6 ms
# with 10 ms). A holding prefill worker spent 2.0 CPU s in 10 with it, 4.2 with 2 ms, 9.6 without
# (an empty vLLM step costs its worker about 1.5 ms of CPU)
IDLE_STEP_WAIT_S = 0.010
# vLLM's stats interval is 10 s. Counts reach vLLM at the first engine step after each interval
# (a server that goes idle reports its last ones at its next step); kvxfer's own metrics endpoint
# (metrics_port) is always current
STATS_INTERVAL_S = 1.0
_clock = time.monotonic  # the stats interval's clock (a test's to replace)
COUNTERS = ("loads_started", "loads_ok", "loads_failed", "load_timeouts", "bytes_received", "busy_s")


class _UnlessRootHandles(logging.StreamHandler):
    """stderr, only while the root logger has no handler (Python's last-resort rule): once the
    application or a library configures logging, kvxfer's records go there instead, once."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def _log_to_stderr() -> None:
    """vLLM configures only its own loggers, so kvxfer's records would reach its log through
    Python's last-resort handler: bare text, no time, level or origin (an operator, or a test
    reading the log, could not tell a kvxfer error from any other line). While the process's root
    logger has no handler, they go to stderr with time, level, process and logger, from WARNING, or
    from ``KVXFER_LOG_LEVEL``. Once per process."""
    root = logging.getLogger("kvxfer")
    level = os.environ.get("KVXFER_LOG_LEVEL")
    if not any(isinstance(h, _UnlessRootHandles) for h in root.handlers):
        handler = _UnlessRootHandles()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s kvxfer[%(process)d] %(name)s: %(message)s"))
        handler.setLevel(logging.WARNING if not level else logging.NOTSET)
        root.addHandler(handler)
    if level:
        try:
            root.setLevel(level.upper())
        except ValueError:
            root.warning("KVXFER_LOG_LEVEL=%s is not a logging level; ignored", level)


def _params_of(request: Request) -> KVTransferParams | None:
    """The kvxfer params a decode request carries, or None; bad params are refused loudly."""
    p = request.kv_transfer_params
    if not p or not p.get("do_remote_prefill") or PARAMS_KEY not in p:
        return None
    try:
        return msgspec.convert(p[PARAMS_KEY], KVTransferParams)
    except msgspec.ValidationError as e:
        logger.error("request %s: kv_transfer_params.%s refused (%s); its prompt is computed here",
                     request.request_id, PARAMS_KEY, e)
        p["do_remote_prefill"] = False
        return None


class KvxferConnector(KVConnectorBase_V1):
    """vLLM's KV connector interface over kvxfer (one class, split by ``role`` as vLLM expects)."""

    _cache_hit_source = CacheHitSource.P2P  # vLLM's metrics count loaded prompt tokens as p2p hits

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings, self.cfg = instance_config(vllm_config, kv_cache_config.num_blocks)
        self.layout = ParallelLayout.from_config(self.cfg)
        # scheduler side
        self._pending = KvxferMetadata()
        self._matched: dict[str, int] = {}  # request id -> tokens vLLM had computed locally
        self._ranks: dict[int, RemoteRank] = {}
        # worker side
        self.connector: EngineConnector | None = None
        self.metrics_server: MetricsServer | None = None
        self._invalid: set[int] = set()
        self._failed_now: set[str] = set()  # loads refused at start: reported at the next poll
        self._released_now: set[str] = set()  # holds that could not be made: blocks go back at once
        self._loading: set[str] = set()  # loads started and not yet reported finished or failed
        self._holding: set[str] = set()  # holds made and not yet reported released
        self._last: dict[str, float] = {}
        self._stats_due = 0.0  # monotonic time of the next get_kv_connector_stats that asks the agent
        _log_to_stderr()
        logger.info("kvxfer %s side for %s (%s, data plane %s)", role.name.lower(), self.cfg.engine_id,
                    self.cfg.role, self.cfg.connector.name)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        kp = _params_of(request)
        if kp is None:
            return 0, False
        n = min(kp.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        if n <= 0:
            return 0, False
        self._matched[request.request_id] = num_computed_tokens
        return n, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        kp = _params_of(request)
        if kp is None:
            return
        assert request.kv_transfer_params is not None
        request.kv_transfer_params["do_remote_prefill"] = False  # one load per request
        computed = self._matched.pop(request.request_id, 0)
        if num_external_tokens > 0:
            ids = blocks.get_block_ids()[0]
            self._pending.loads.append(LoadOrder(request.request_id, kp.to_bytes(), list(ids), computed))
        else:  # everything was already here: the producer may free its blocks now
            self._pending.abandons.append((request.request_id, kp.to_bytes(), "prompt cached on the decode side"))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._pending = self._pending, KvxferMetadata()
        meta.idle = not scheduler_output.total_num_scheduled_tokens
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        p = request.kv_transfer_params
        if not p:
            return False, None
        kp = _params_of(request)
        if kp is not None:  # finished (aborted) before it was ever scheduled: free the producer's blocks
            p["do_remote_prefill"] = False
            self._matched.pop(request.request_id, None)
            self._pending.abandons.append((request.request_id, kp.to_bytes(), "request ended before its load"))
            return False, None
        if not p.get("do_remote_decode") or self.cfg.role == "decode":
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        n = request.num_computed_tokens
        bs = self.cfg.cache.block_size
        ids = list(block_ids[: -(-n // bs)])
        if n < 1 or not ids:
            return False, None
        if len(self._ranks) != self.cfg.world_size:
            logger.error("request %s: no side-channel address from %d of %d ranks; its KV is not offered",
                         request.request_id, self.cfg.world_size - len(self._ranks), self.cfg.world_size)
            return False, None
        params = KVTransferParams(
            request_id=request.request_id, engine_id=self.cfg.engine_id, num_tokens=n, block_ids=ids,
            block_size=bs, layout=self.layout, ranks=[self._ranks[r] for r in sorted(self._ranks)],
            lease_s=self.cfg.connector.timeouts.lease_s)
        self._pending.holds.append(HoldOrder(request.request_id, ids, n))
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      PARAMS_KEY: msgspec.to_builtins(params)}

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, k): v for k, v in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int],
                                                                   KVConnectorHandshakeMetadata]) -> None:
        for m in metadata.values():
            if isinstance(m, KvxferHandshakeMetadata):
                self._ranks[m.rank] = RemoteRank(rank=m.rank, host=m.host, port=m.port, generation=m.generation)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        by_layer = {}
        for name, t in kv_caches.items():
            m = _LAYER.search(name)
            if m is None:
                raise ValueError(f"register_kv_caches: cannot tell the layer of KV tensor {name!r}")
            by_layer[int(m.group(1))] = t
        layers = sorted(by_layer)
        first = next(iter(by_layer.values()))
        dtype = kv_dtype(self._vllm_config.cache_config.cache_dtype, kv_caches)
        by_layer = {i: t.view(TORCH_DTYPES[dtype]) for i, t in by_layer.items()}  # fp8: vLLM's uint8, as float8
        self.settings, self.cfg = instance_config(self._vllm_config, first.shape[0], dtype)
        tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
        rank = pp_rank * self.cfg.parallel.tp + tp_rank
        spec: KVCacheSpec = spec_from_config(self.cfg, pp_rank)
        if layers != list(spec.layers):
            raise ValueError(f"register_kv_caches: rank {rank} has layers {layers}, kvxfer's partition gives "
                             f"{list(spec.layers)}")
        cache = KVCache(spec=spec, num_blocks=first.shape[0], tensors=[by_layer[i] for i in layers], names=[])
        # the agent: on any CPU or this worker's cores (connector.agent_cpus), never with its OpenMP binding
        self.connector = Connector.from_config(self.cfg, rank)
        self.connector.register_kv_caches(cache)
        if self.settings.metrics_port is not None:
            port = self.settings.metrics_port + rank if self.settings.metrics_port else 0
            self.metrics_server = MetricsServer(self.settings.metrics_host, port)
            self.metrics_server.add(self.connector.metrics)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        c = self.connector
        if c is None:
            return None
        return KvxferHandshakeMetadata(rank=c.rank, host=self.cfg.connector.side_channel.host,
                                       port=c.side_channel_port, generation=c.generation)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferMetadata) and self.connector is not None
        c = self.connector
        for h in meta.holds:
            try:
                c.hold(h.request_id, h.block_ids, h.num_tokens)
                self._holding.add(h.request_id)
            except ValueError as e:
                logger.error("request %s: blocks not held for the decode side: %s", h.request_id, e)
                self._released_now.add(h.request_id)
        for rid, raw, why in meta.abandons:
            c.abandon(rid, KVTransferParams.from_bytes(raw), why)
        for ld in meta.loads:
            try:
                c.start_load(ld.request_id, KVTransferParams.from_bytes(ld.params), ld.block_ids,
                             ld.num_cached_tokens)
                self._loading.add(ld.request_id)
            except AlreadyLoading as e:  # the load in flight goes on
                logger.error("request %s: load refused: %s", ld.request_id, e)
            except ValueError as e:
                logger.error("request %s: load refused: %s; its prompt is computed here", ld.request_id, e)
                self._failed_now.add(ld.request_id)
                bs = self.cfg.cache.block_size
                self._invalid.update(ld.block_ids[ld.num_cached_tokens // bs :])
                # the producer frees its blocks now, not a lease later (what a load failing later does)
                try:
                    c.abandon(ld.request_id, KVTransferParams.from_bytes(ld.params), f"load refused: {e}")
                except (ValueError, RuntimeError) as e2:
                    logger.warning("request %s: abandon not sent (%s); the producer frees at its lease",
                                   ld.request_id, e2)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole requests, finished before vLLM schedules them

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # pull mode: the decode side reads; nothing is pushed

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.connector is None:
            return KVConnectorTransferResults()
        f = self.connector.poll(timeout_s=self._poll_wait())
        self._loading.difference_update(f.receiving)
        self._loading.difference_update(f.failed)
        self._holding.difference_update(f.sending)
        failed = set(f.failed) | self._failed_now
        for ids in f.failed.values():
            self._invalid.update(ids)
        out = KVConnectorTransferResults(finished_sending=set(f.sending) | self._released_now,
                                         finished_recving=set(f.receiving) | failed, failed_recving=failed)
        self._failed_now, self._released_now = set(), set()
        return out

    def _poll_wait(self) -> float:
        """How long this step's poll may wait for the agent's next event: IDLE_STEP_WAIT_S when the
        step computes nothing and loads or holds are in flight, else 0. vLLM's engine steps without
        pause while a request waits for its KV (decode) or for its readers to finish (prefill: its
        blocks stay allocated until the hold is released), thousands of empty steps a second. Those
        kept from the transfer agent the core it shares with this worker (agent_cpus: engine) or its
        engine's CPU share (any); a holding prefill worker took 96% of its core (9.6 CPU s in 10 s;
        2.0 with the wait), and in test_vllm_tp's CI failures a decode server whose workers shared
        that core started its load only once the prefill's hold had expired. A blocking wait gives
        the CPU back and returns the moment a load finishes or a hold is released. A step with work
        never waits."""
        if not (self._loading or self._holding) or not self.has_connector_metadata():
            return 0.0
        meta = self._get_connector_metadata()
        return IDLE_STEP_WAIT_S if isinstance(meta, KvxferMetadata) and meta.idle else 0.0

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """kvxfer's counter increments since the last report, at most every STATS_INTERVAL_S: vLLM asks
        every step, and with a transfer agent each answer is a round trip to it, which every step of
        every worker would wait for (vLLM logs these at its own, longer interval)."""
        if self.connector is None:
            return None
        t = _clock()
        if t < self._stats_due:
            return None
        self._stats_due = t + STATS_INTERVAL_S
        now = self.connector.stats()
        delta = {k: now.get(k, 0) - self._last.get(k, 0) for k in COUNTERS}
        self._last = now
        stats = KvxferStats(data=delta)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvxferStats(data=data) if data is not None else KvxferStats()

    def shutdown(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        if self.connector is not None:
            self.connector.close()
            self.connector = None
