"""The engine-facing connector API.

``Connector`` is what an engine calls; ``DataPlane`` (from :mod:`kvxfer.dataplane`, re-exported
here) is what a connector plugin implements. Data planes are found through the
``kvxfer.connectors`` entry-point group; the core never imports one by module name.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvxfer.cache.spec import spec_from_config
from kvxfer.cache.staging import copy_blocks, mirror_of, unpin
from kvxfer.cache.tensors import KVCache
from kvxfer.config import InstanceConfig
from kvxfer.dataplane import (
    ENTRY_POINT_GROUP,
    BatchResult,
    DataPlane,
    Descriptors,
    ReadValidator,
    TokenChecker,
    available_data_planes,
    check_bounds,
    load_data_plane,
)
from kvxfer.handshake import Authenticator, SideChannelClient, SideChannelServer, read_secret
from kvxfer.metrics import ConnectorMetrics
from kvxfer.protocol import (
    Abandon,
    Ack,
    DoneNotice,
    DoneNotices,
    ErrorCode,
    ErrorReply,
    HandshakeRequest,
    HandshakeResponse,
    Hello,
    KVTransferParams,
    LayersReady,
    LeaseRenew,
    Message,
    PushTarget,
    RemoteRank,
    compat_hash,
)
from kvxfer.switch_interval import SwitchInterval
from kvxfer.topology import ParallelLayout, check_compatible
from kvxfer.transfer.aggregator import Finished, FinishedAggregator
from kvxfer.transfer.consumer import Consumer
from kvxfer.transfer.planner import region_info, spec_info
from kvxfer.transfer.producer import HoldRegistry
from kvxfer.transfer.pusher import Pusher

__all__ = [
    "ENTRY_POINT_GROUP", "BatchResult", "Connector", "DataPlane", "Descriptors", "EngineConnector", "Finished",
    "FinishedAggregator", "KVTransferParams", "PushTarget", "ReadValidator", "TokenChecker",
    "available_data_planes", "check_bounds", "load_data_plane",
]

logger = logging.getLogger(__name__)


def check_rank(config: InstanceConfig, rank: int) -> tuple[int, int]:
    """A connector's rank must be in the instance; (tp rank, pp rank)."""
    if not 0 <= rank < config.world_size:
        raise ValueError(f"rank: expected 0 <= rank < {config.world_size}, got {rank}")
    return rank % config.parallel.tp, rank // config.parallel.tp


def check_cache(config: InstanceConfig, rank: int, cache: KVCache) -> None:
    """The cache an engine registers must be the one the config describes for ``rank``."""
    expect = spec_from_config(config, rank // config.parallel.tp)
    got = cache.spec
    for f in ("num_layers", "first_layer", "num_kv_heads", "head_size", "block_size", "dtype", "mla"):
        if getattr(expect, f) != getattr(got, f):
            raise ValueError(f"register_kv_caches: cache {f}={getattr(got, f)!r} but the config gives "
                             f"{getattr(expect, f)!r} for rank {rank}")


class EngineConnector(Protocol):
    """What an engine may call on a rank's connector, wherever its data path runs."""

    config: InstanceConfig
    rank: int

    @property
    def metrics(self) -> ConnectorMetrics: ...
    def register_kv_caches(self, cache: KVCache) -> None: ...
    @property
    def side_channel_port(self) -> int: ...
    @property
    def generation(self) -> int: ...
    def poll(self, timeout_s: float = 0.0) -> Finished: ...
    def stats(self) -> dict[str, float]: ...
    @property
    def broken(self) -> str | None: ...
    def close(self) -> None: ...
    def hold(self, request_id: str, block_ids: Sequence[int] | np.ndarray, num_tokens: int,
             streaming: bool = False) -> KVTransferParams: ...
    def release(self, request_id: str) -> bool: ...
    def save_layer(self, request_id: str, layer: int) -> None: ...
    def push(self, request_id: str, target: PushTarget) -> None: ...
    def start_load(self, request_id: str, params: KVTransferParams, local_block_ids: Sequence[int] | np.ndarray,
                   num_cached_tokens: int = 0) -> None: ...
    def reserve(self, request_id: str, local_block_ids: Sequence[int] | np.ndarray, num_tokens: int,
                num_cached_tokens: int = 0) -> PushTarget: ...
    def wait_layer(self, request_id: str, layer: int, timeout_s: float) -> bool: ...
    def wait(self, request_id: str, params: KVTransferParams) -> None: ...
    def abandon(self, request_id: str, params: KVTransferParams | None, reason: str = "dropped") -> None: ...


class Connector:
    """What an engine rank calls: hold blocks for readers (producer) and load them (consumer).

    One per rank process. ``from_config`` finds the data plane by name through the
    ``kvxfer.connectors`` entry points. Threads and sockets start in ``register_kv_caches``
    and stop in ``close``.
    """

    def __init__(self, config: InstanceConfig, rank: int, data_plane: DataPlane,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tp_rank, self.pp_rank = check_rank(config, rank)
        self.config = config
        self.rank = rank
        self.layout = ParallelLayout.from_config(config)
        self.plane = data_plane
        self.plane.engine_id = config.engine_id
        self.clock = clock
        self.secret = read_secret(config.connector.auth.secret_env if config.connector.auth else None)
        self.generation = secrets.randbits(62)
        t = config.connector.timeouts
        self.client = SideChannelClient(t.handshake_s, t.handshake_retries)
        self.cache: KVCache | None = None
        self.holds: HoldRegistry | None = None
        self.consumer: Consumer | None = None
        self.pusher: Pusher | None = None
        self.server: SideChannelServer | None = None
        self.auth = Authenticator(self.secret)
        self.metrics = ConnectorMetrics(config.engine_id, rank, data_plane.name, clock)
        self.metrics.producer = self._side_stats
        # off here: an engine's connector (from_config) takes connector.gil_switch_interval_s; a
        # transfer agent's, whose only Python is kvxfer's, keeps the interpreter's interval
        self._switch = SwitchInterval(0.0)

    @classmethod
    def from_config(cls, config: InstanceConfig, rank: int = 0) -> EngineConnector:
        """The rank's connector: its data path in a transfer agent process, or in this one
        (``connector.data_path``; see :mod:`kvxfer.agent.client`)."""
        plane_cls = load_data_plane(config.connector.name)
        where = config.connector.data_path
        if where == "agent" and not plane_cls.cross_process:
            raise ValueError(f"connector.data_path: agent, but the {config.connector.name!r} data plane only "
                             "reaches planes of its own process; use engine (or auto)")
        if where == "agent" or (where == "auto" and plane_cls.cross_process):
            from kvxfer.agent.client import AgentConnector

            return AgentConnector(config, rank)
        if config.connector.agent_nice != 0:
            raise ValueError(f"connector.agent_nice: {config.connector.agent_nice} sets a transfer agent's priority, "
                             f"but this rank's data path runs in the engine's process (data_path: {where}, "
                             f"plane {config.connector.name!r}); leave it 0 or use a transfer agent")
        c = cls.in_process(config, rank)
        # in the engine's process its transfer threads need the engine's GIL for every read, served
        # or made (kvxfer.switch_interval): the short interval while loads or holds are in flight
        c._switch = SwitchInterval(config.connector.gil_switch_interval_s)  # its waits need its threads: no wait claim
        return c

    @classmethod
    def in_process(cls, config: InstanceConfig, rank: int = 0) -> Connector:
        """The rank's connector with its data path in this process (a transfer agent runs this)."""
        plane_cls = load_data_plane(config.connector.name)
        options = dict(config.connector.data_plane)
        known = plane_cls.known_options or frozenset()  # defaults for the planes that take these options
        if "host" in known:
            options.setdefault("host", config.connector.side_channel.host)
        if "timeout_s" in known:
            options.setdefault("timeout_s", config.connector.timeouts.transfer_s)
        return cls(config, rank, plane_cls(options))

    # ------------------------------------------------------------------ both sides
    def register_kv_caches(self, cache: KVCache) -> None:
        """Register this rank's cache with the data plane and start serving the side channel."""
        if self.cache is not None:
            raise RuntimeError("register_kv_caches: already registered")
        check_cache(self.config, self.rank, cache)
        self.device_cache: KVCache | None = None
        staging = self.config.connector.host_staging
        if staging == "always" or (staging == "auto" and cache.device.type != "cpu"):
            self.device_cache, cache = cache, mirror_of(cache)  # the data plane sees the host mirror
            logger.info("rank %d: staging a %s cache through a host mirror", self.rank, self.device_cache.device)
        self.plane.register(cache.regions)
        self.cache = cache
        t = self.config.connector.timeouts
        self.holds = HoldRegistry(self.layout, self.tp_rank, self.pp_rank, cache.num_blocks,
                                  {r.region_id: (r.block_stride, r.length) for r in cache.regions},
                                  t.lease_s, t.abort_s, self.clock,
                                  region_layers={r.region_id: r.layers for r in cache.regions})
        self.plane.set_read_validator(self.holds.validate)
        self.holds.on_change = self.plane.hold_changed
        if self.secret is not None:
            self.plane.set_token_checker(self.auth.check_token)
        sc = self.config.connector.side_channel
        port = sc.port + self.rank if sc.port else 0
        if self.config.role in ("decode", "both"):
            self.consumer = Consumer(self.config.engine_id, self.rank, self.layout, self.tp_rank, self.pp_rank,
                                     cache, self.plane, self.client, self.secret, self.config.model.name,
                                     t.transfer_s, t.lease_s, self.clock, on_loaded=self._unstage,
                                     metrics=self.metrics, hold_wait_s=t.hold_wait_s,
                                     reservation_s=t.reservation_s,
                                     inline_load_bytes=self.config.connector.inline_load_bytes)
            self.holds.on_release = self.consumer.wake_waiters
        if self.config.role in ("prefill", "both"):
            self.pusher = Pusher(self.config.engine_id, self.rank, self.layout, self.holds,
                                 SideChannelClient(t.handshake_s, t.handshake_retries), self.secret)
        self.server = SideChannelServer(sc.host, port, self._respond, name=f"kvxfer-side-{self.rank}")
        logger.info("rank %d registered %d regions (%.1f MiB); side channel %s:%d", self.rank,
                    len(cache.regions), cache.nbytes / 2**20, sc.host, self.server.port)

    @property
    def side_channel_port(self) -> int:
        if self.server is None:
            raise RuntimeError("not registered")
        return self.server.port

    def poll(self, timeout_s: float = 0.0) -> Finished:
        """Holds released, loads finished, loads failed (with their invalid block ids).

        Non-blocking by default; with ``timeout_s`` it waits up to that long for a load to finish
        or a hold to end (the wait releases the GIL, so the transfer threads run meanwhile).
        """
        out = Finished()
        if self.consumer is not None:
            out.extend(self.consumer.poll(timeout_s))  # a hold that ends wakes it too (holds.on_release)
        elif self.holds is not None and timeout_s > 0:
            self.holds.wait_released(timeout_s)
        if self.holds is not None:
            self.holds.expire()
            out.sending.extend(self.holds.take_released())
        self._switch.want((self.consumer is not None and self.consumer.loading)
                          or (self.holds is not None and len(self.holds) > 0))
        return out

    def stats(self) -> dict[str, float]:
        """Counters of this rank's connector (see :class:`kvxfer.metrics.ConnectorMetrics`).

        ``broken`` is 1 once this rank cannot load any more (its data plane is broken for good;
        :attr:`broken` says why): every pending and later load then fails at once."""
        return self.metrics.snapshot()

    @property
    def broken(self) -> str | None:
        """Why this rank cannot load any more, or None while it can."""
        return self.consumer.broken if self.consumer is not None else None

    def _side_stats(self) -> dict[str, float]:
        """The producer's hold counters and the plane's own (``plane_<name>``)."""
        out = {f"plane_{k}": v for k, v in self.plane.counters().items()}
        holds = self.holds
        if holds is None:
            return out
        return {**out, "held_requests": len(holds), "held_blocks": holds.held_blocks(),
                "refused_reads": holds.refused_reads,
                **{f"holds_{reason}": n for reason, n in holds.released_by.items()}}

    def close(self) -> None:
        try:
            if self.consumer is not None:
                self.consumer.close()
            if self.pusher is not None:
                self.pusher.close()
            if self.server is not None:
                self.server.close()
            self.client.close()
            self.plane.close()
            if self.cache is not None:
                unpin(self.cache)  # the host mirror's pinning (a device cache's), once nothing reads it
        finally:
            self._switch.close()  # whatever failed above: the engine's switch interval comes back

    # ------------------------------------------------------------------ producer
    def hold(self, request_id: str, block_ids: Sequence[int] | np.ndarray, num_tokens: int,
             streaming: bool = False) -> KVTransferParams:
        """Pin a prompt's blocks for the decode side; returns what it needs to read them.

        Pull: the prompt is computed. ``streaming`` (push): no layer is written yet; each
        becomes readable when ``save_layer`` says so, and ``push`` names who reads it."""
        if self.holds is None or self.server is None or self.cache is None:
            raise RuntimeError("hold: register_kv_caches first")
        ids = np.asarray(block_ids, dtype=np.int64)
        need = -(-num_tokens // self.cache.spec.block_size)
        if len(ids) < need:
            raise ValueError(f"request {request_id}: {num_tokens} tokens need {need} blocks, got {len(ids)}")
        if self.device_cache is not None and not streaming:  # on the host before anyone reads them
            copy_blocks(self.device_cache, self.cache, ids[:need])
        self.holds.hold(request_id, ids[:need], num_tokens, streaming=streaming)
        self._switch.want(True)  # this process's threads serve its reads: until a poll finds no hold left
        return self._params(request_id, ids[:need], num_tokens)

    def _params(self, request_id: str, block_ids: np.ndarray, num_tokens: int) -> KVTransferParams:
        """This rank's params for a held request: what a reader needs to read it."""
        assert self.server is not None and self.cache is not None
        sc = self.config.connector.side_channel
        return KVTransferParams(
            request_id=request_id, engine_id=self.config.engine_id, num_tokens=num_tokens,
            block_ids=block_ids.tolist(), block_size=self.cache.spec.block_size, layout=self.layout,
            ranks=[RemoteRank(rank=self.rank, host=sc.host, port=self.server.port, generation=self.generation)],
            lease_s=self.config.connector.timeouts.lease_s,
        )

    def save_layer(self, request_id: str, layer: int) -> None:
        """Push mode: the engine's forward pass has written ``layer`` (a global layer id on this
        rank) of a streaming hold; its push targets read it now."""
        if self.holds is None or self.pusher is None:
            raise RuntimeError("save_layer: register_kv_caches first, on a prefill (or both) rank")
        if self.device_cache is not None and self.cache is not None:
            ids = self.holds.block_ids_of(request_id)
            if ids is not None:
                copy_blocks(self.device_cache, self.cache, ids, layer)
        if self.holds.save_layer(request_id, layer):
            self.pusher.notify(request_id)

    def push(self, request_id: str, target: PushTarget) -> None:
        """Push mode: the decode side reserved blocks for this held request (``target``, from its
        ``reserve``). Every layer saved so far is read at once, the rest as they are saved."""
        if self.holds is None or self.pusher is None or self.server is None or self.cache is None:
            raise RuntimeError("push: register_kv_caches first, on a prefill (or both) rank")
        if not isinstance(target, PushTarget):
            raise ValueError(f"request {request_id}: push target must be a PushTarget, got {type(target).__name__}")
        check_compatible(self.layout, target.layout)
        if not target.ranks:
            raise ValueError(f"request {request_id}: push target {target.request_id} names no decode rank")
        held = self.holds.num_tokens_of(request_id)
        if held is None:
            raise ValueError(f"request {request_id} is not held (never held, released, or expired)")
        if held != target.num_tokens:
            raise ValueError(f"request {request_id}: {held} tokens held, but the push target reserved "
                             f"{target.num_tokens}")
        ids = self.holds.block_ids_of(request_id)
        assert ids is not None
        if self.holds.attach(request_id, target, self._params(request_id, ids, held)):
            self.pusher.notify(request_id)

    def _unstage(self, block_ids: list[int]) -> None:
        """Consumer side: loaded blocks go from the host mirror to the device cache."""
        if self.device_cache is not None and self.cache is not None:
            copy_blocks(self.cache, self.device_cache, block_ids)

    def release(self, request_id: str) -> bool:
        """The engine frees a hold itself (e.g. the request was cancelled)."""
        return self.holds.release(request_id, "engine", "released by the engine") if self.holds is not None else False

    def _respond(self, msg: Message, peer: str) -> Message:
        holds, cache = self.holds, self.cache
        assert holds is not None and cache is not None
        if isinstance(msg, Hello):
            return self.auth.challenge(msg)
        if isinstance(msg, HandshakeRequest):
            why = self.auth.verify(msg)
            if why is not None:
                logger.warning("side channel: refused handshake from %s (%s): %s", msg.engine_id, peer, why)
                return ErrorReply(code=ErrorCode.AUTH, message=why)
            mine, theirs = self.layout, msg.layout
            for f in ("num_layers", "num_kv_heads", "mla"):
                if getattr(mine, f) != getattr(theirs, f):
                    return ErrorReply(code=ErrorCode.INCOMPATIBLE, message=f"{f}: producer {getattr(mine, f)!r}, "
                                      f"consumer {getattr(theirs, f)!r}")
            spec = cache.spec
            return HandshakeResponse(
                engine_id=self.config.engine_id, rank=self.rank, tp_rank=self.tp_rank, pp_rank=self.pp_rank,
                generation=self.generation, layout=self.layout, spec=spec_info(spec),
                regions=[region_info(r) for r in cache.regions], data_plane=self.plane.name,
                data_address=self.plane.address(),
                compat_hash=compat_hash(self.config.model.name, self.layout.num_layers, self.layout.num_kv_heads,
                                        spec.head_size, spec.dtype, spec.mla),
                model=self.config.model.name,
            )
        if isinstance(msg, LayersReady):
            if not self.auth.check_token(msg.token):
                return ErrorReply(code=ErrorCode.AUTH, message="no valid handshake token")
            if msg.generation != self.generation:
                return ErrorReply(code=ErrorCode.STALE_GENERATION,
                                  message=f"this rank serves generation {self.generation}")
            if self.consumer is None:
                return ErrorReply(code=ErrorCode.UNEXPECTED, message=f"a {self.config.role} rank takes no push")
            refusal = self.consumer.layers_ready(msg)
            return ErrorReply(code=refusal.code, message=refusal.message) if refusal else Ack()
        if isinstance(msg, DoneNotice | DoneNotices | LeaseRenew | Abandon):
            if not self.auth.check_token(msg.token):
                return ErrorReply(code=ErrorCode.AUTH, message="no valid handshake token")
            if msg.generation != self.generation:
                return ErrorReply(code=ErrorCode.STALE_GENERATION,
                                  message=f"this rank serves generation {self.generation}")
            if isinstance(msg, DoneNotice):
                why = holds.on_done(msg.request_id, msg.engine_id, msg.rank, msg.layout)
                return ErrorReply(code=ErrorCode.UNKNOWN_REQUEST, message=why) if why else Ack()
            if isinstance(msg, DoneNotices):  # each counted alone; the reply names those not held
                unknown = [rid for rid in msg.request_ids
                           if holds.on_done(rid, msg.engine_id, msg.rank, msg.layout) is not None]
                if unknown:
                    return ErrorReply(code=ErrorCode.UNKNOWN_REQUEST,
                                      message=f"{len(unknown)} of {len(msg.request_ids)} requests are not held: "
                                      + ", ".join(unknown[:8]) + (" ..." if len(unknown) > 8 else ""))
                return Ack()
            if isinstance(msg, LeaseRenew):
                holds.renew(msg.request_ids)
                return Ack()
            holds.abandon(msg.request_id, f"abandoned by the consumer: {msg.reason}")
            return Ack()
        return ErrorReply(code=ErrorCode.UNEXPECTED,
                          message=f"{type(msg).__name__} is not a request this server answers")

    # ------------------------------------------------------------------ consumer
    def _consumer(self) -> Consumer:
        if self.consumer is None:
            raise RuntimeError(f"this rank is a {self.config.role} instance; loading needs role decode or both")
        return self.consumer

    def start_load(self, request_id: str, params: KVTransferParams, local_block_ids: Sequence[int] | np.ndarray,
                   num_cached_tokens: int = 0) -> None:
        """Begin pulling the request's blocks; ``poll`` reports it finished or failed."""
        self._consumer().start_load(request_id, params, local_block_ids, num_cached_tokens)
        self._switch.want(True)

    def start_loads(self, loads: Sequence[tuple[str, KVTransferParams, Sequence[int] | np.ndarray, int]]
                    ) -> list[Exception | None]:
        """``start_load`` for a burst the caller already holds (the transfer agent: the loads
        queued on its channel), begun together where the fast path can; what each refused one
        raised, at its place (None: started)."""
        return self._consumer().start_loads(loads)

    def reserve(self, request_id: str, local_block_ids: Sequence[int] | np.ndarray, num_tokens: int,
                num_cached_tokens: int = 0) -> PushTarget:
        """Push mode: reserve blocks a prefill instance will push a prompt into; returns the
        target to hand it (merge the ranks' targets with ``merge_targets``). ``poll`` reports
        the request in ``receiving`` once every layer has landed, or in ``failed``; the
        reservation ends after ``timeouts.reservation_s``, or ``transfer_s`` after the last push."""
        consumer = self._consumer()
        if self.server is None:
            raise RuntimeError("reserve: register_kv_caches first")
        consumer.reserve(request_id, local_block_ids, num_tokens, num_cached_tokens)
        self._switch.want(True)
        sc = self.config.connector.side_channel
        return PushTarget(request_id=request_id, engine_id=self.config.engine_id, num_tokens=num_tokens,
                          num_cached_tokens=num_cached_tokens, layout=self.layout,
                          ranks=[RemoteRank(rank=self.rank, host=sc.host, port=self.server.port,
                                            generation=self.generation)],
                          lease_s=self.config.connector.timeouts.reservation_s)

    def wait_layer(self, request_id: str, layer: int, timeout_s: float) -> bool:
        """Push mode: wait until ``layer`` of a reserved request has landed (True), the request
        failed or is unknown (False), or ``timeout_s`` passed (False)."""
        return self._consumer().wait_layer(request_id, layer, timeout_s)

    def wait(self, request_id: str, params: KVTransferParams) -> None:
        """The request is queued here: renew its producer holds until it is loaded or abandoned."""
        self._consumer().wait(request_id, params)

    def abandon(self, request_id: str, params: KVTransferParams | None, reason: str = "dropped") -> None:
        """The request will not be loaded: the producers free its blocks at once (push: the
        reservation ends, and a producer's next notice is refused)."""
        self._consumer().abandon(request_id, params, reason)
