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

Settings come from ``kv_connector_extra_config`` (see :class:`VllmSettings`), or from the
``connector`` section of a kvxfer YAML named by its ``config`` key. Model, cache and parallel
geometry always come from vLLM. vLLM's CPU cache is one tensor per layer, shaped
``[blocks, kv_heads, block_size, 2 * head_size]``, K rows then V rows per head: kvxfer's
``kv_fused`` HND layout.
"""

from __future__ import annotations

import logging
import os
import re
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
from kvxfer.config import CacheConfig, ConnectorConfig, InstanceConfig, ModelConfig, ParallelConfig, convert, read_yaml
from kvxfer.connector import Connector
from kvxfer.metrics import MetricsServer
from kvxfer.protocol import KVTransferParams, RemoteRank
from kvxfer.topology import ParallelLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

PARAMS_KEY = "kvxfer"  # where kvxfer's params ride inside vLLM's kv_transfer_params
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
_LAYER = re.compile(r"layers\.(\d+)\.")


class VllmSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``kv_connector_extra_config``; unknown keys are refused by name."""

    config: str | None = None  # a kvxfer instance YAML whose `connector` section is used
    data_plane: str = "tcp"
    data_plane_options: dict[str, Any] = msgspec.field(default_factory=dict)
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # rank r listens on port + r; 0 picks free ports
    handshake_s: float | None = None
    transfer_s: float | None = None
    lease_s: float | None = None
    abort_s: float | None = None
    auth_secret_env: str | None = None
    model_name: str | None = None  # what both instances must agree on; default vLLM's served name
    metrics_port: int | None = None  # kvxfer's Prometheus endpoint; rank r on port + r (0: any free port)
    metrics_host: str = "127.0.0.1"


def _name(text: str) -> str:
    """A kvxfer name (letters, digits, ``._-``) from a vLLM id or model path."""
    out = re.sub(r"[^A-Za-z0-9._-]", "-", text.rstrip("/").rsplit("/", 1)[-1]).lstrip("._-")
    return out[:128] or "vllm"


def instance_config(vllm_config: VllmConfig, num_blocks: int,
                    dtype: str = "float32") -> tuple[VllmSettings, InstanceConfig]:
    """The kvxfer view of a vLLM instance: role, geometry from vLLM, connector from the settings."""
    kvt = vllm_config.kv_transfer_config
    try:
        s = msgspec.convert(dict(kvt.kv_connector_extra_config or {}), VllmSettings)
    except msgspec.ValidationError as e:
        raise ValueError(f"kv_connector_extra_config: {e}") from None
    if kvt.kv_role not in ROLES:
        raise ValueError(f"kv_transfer_config.kv_role: expected one of {sorted(ROLES)}, got {kvt.kv_role!r}")
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    hf = mc.hf_text_config
    model = ModelConfig(name=_name(s.model_name or mc.served_model_name or mc.model),
                        num_layers=mc.get_total_num_hidden_layers(), num_heads=hf.num_attention_heads,
                        num_kv_heads=mc.get_total_num_kv_heads(), head_size=mc.get_head_size())
    if s.config is not None:
        connector = convert(read_yaml(s.config), InstanceConfig, s.config).connector
    else:
        t = {k: v for k, v in (("handshake_s", s.handshake_s), ("transfer_s", s.transfer_s),
                                ("lease_s", s.lease_s), ("abort_s", s.abort_s)) if v is not None}
        connector = convert({"name": s.data_plane, "data_plane": s.data_plane_options,
                             "side_channel": {"host": s.side_channel_host, "port": s.side_channel_port},
                             "timeouts": t, **({"auth": {"secret_env": s.auth_secret_env}} if s.auth_secret_env
                                               else {})},
                            ConnectorConfig, "kv_connector_extra_config")
    assert isinstance(connector, ConnectorConfig)
    return s, InstanceConfig(
        role=ROLES[kvt.kv_role], engine_id=_name(kvt.engine_id or "vllm"), model=model,
        cache=CacheConfig(block_size=vllm_config.cache_config.block_size, num_blocks=max(num_blocks, 1),
                          layout="HND", kv_fused=True, dtype=dtype, huge_pages=False),  # type: ignore[arg-type]
        parallel=ParallelConfig(tp=pc.tensor_parallel_size, pp=pc.pipeline_parallel_size),
        connector=connector,
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


COUNTERS = ("loads_started", "loads_ok", "loads_failed", "load_timeouts", "bytes_received", "busy_s")


def _log_to_stderr() -> None:
    """vLLM configures only its own loggers: with ``KVXFER_LOG_LEVEL`` set, kvxfer's go to stderr too."""
    level = os.environ.get("KVXFER_LOG_LEVEL")
    root = logging.getLogger("kvxfer")
    if level and not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(level.upper())


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

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 1
        self.settings, self.cfg = instance_config(vllm_config, num_blocks)
        self.layout = ParallelLayout.from_config(self.cfg)
        # scheduler side
        self._pending = KvxferMetadata()
        self._matched: dict[str, int] = {}  # request id -> tokens vLLM had computed locally
        self._ranks: dict[int, RemoteRank] = {}
        # worker side
        self.connector: Connector | None = None
        self.metrics_server: MetricsServer | None = None
        self._invalid: set[int] = set()
        self._failed_now: set[str] = set()  # loads refused at start: reported at the next poll
        self._released_now: set[str] = set()  # holds that could not be made: blocks go back at once
        self._last: dict[str, float] = {}
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
        dtype = next((k for k, v in TORCH_DTYPES.items() if v == first.dtype), None)
        if dtype is None:
            raise ValueError(f"register_kv_caches: KV dtype {first.dtype} is not one kvxfer moves")
        self.settings, self.cfg = instance_config(self._vllm_config, first.shape[0], dtype)
        tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
        rank = pp_rank * self.cfg.parallel.tp + tp_rank
        spec: KVCacheSpec = spec_from_config(self.cfg, pp_rank)
        if layers != list(spec.layers):
            raise ValueError(f"register_kv_caches: rank {rank} has layers {layers}, kvxfer's partition gives "
                             f"{list(spec.layers)}")
        cache = KVCache(spec=spec, num_blocks=first.shape[0], tensors=[by_layer[i] for i in layers], names=[])
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
            except ValueError as e:
                logger.error("request %s: blocks not held for the decode side: %s", h.request_id, e)
                self._released_now.add(h.request_id)
        for rid, raw, why in meta.abandons:
            c.abandon(rid, KVTransferParams.from_bytes(raw), why)
        for ld in meta.loads:
            try:
                c.start_load(ld.request_id, KVTransferParams.from_bytes(ld.params), ld.block_ids,
                             ld.num_cached_tokens)
            except ValueError as e:
                logger.error("request %s: load refused: %s", ld.request_id, e)
                self._failed_now.add(ld.request_id)
                bs = self.cfg.cache.block_size
                self._invalid.update(ld.block_ids[ld.num_cached_tokens // bs :])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole requests, finished before vLLM schedules them

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # pull mode: the decode side reads; nothing is pushed

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.connector is None:
            return KVConnectorTransferResults()
        f = self.connector.poll()
        failed = set(f.failed) | self._failed_now
        for ids in f.failed.values():
            self._invalid.update(ids)
        out = KVConnectorTransferResults(finished_sending=set(f.sending) | self._released_now,
                                         finished_recving=set(f.receiving) | failed, failed_recving=failed)
        self._failed_now, self._released_now = set(), set()
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.connector is None:
            return None
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
