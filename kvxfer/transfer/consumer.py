"""The consumer side: one rank pulling a request's blocks from the producer ranks it needs.

Work happens on the connector's own thread, never the engine's: handshakes (cached per
remote engine, rank and registration generation), planning, issuing reads, finishing
staged repacks, and the done or abandon notices. The engine only calls ``start_load`` and
``poll``. Every load has a deadline; a load that fails for any reason (peer gone,
refused read, timeout, incompatible peer) reports its local block ids as invalid.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvxfer.cache.tensors import KVCache, MemoryRegion
from kvxfer.dataplane import BatchResult, DataPlane, Descriptors
from kvxfer.handshake import HandshakeError, SideChannelClient
from kvxfer.metrics import ConnectorMetrics
from kvxfer.protocol import (
    Abandon,
    DoneNotice,
    ErrorReply,
    HandshakeResponse,
    KVTransferParams,
    LeaseRenew,
    RemoteRank,
    compat_hash,
)
from kvxfer.topology import ParallelLayout, SourceSlice, check_compatible, readers_of, remote_sources
from kvxfer.transfer.aggregator import Finished
from kvxfer.transfer.planner import (
    SideLayout,
    StagedPlan,
    check_alignment,
    concat,
    finish_staged,
    plan_direct,
    plan_staged,
)
from kvxfer.transfer.producer import NOT_HELD

logger = logging.getLogger(__name__)

STAGING_REGION_BASE = 1 << 30
READ_AGAIN_AFTER_S = 0.02  # a read refused as "not held" is sent again this soon (within hold_wait_s)


class LoadFailed(RuntimeError):
    pass


@dataclass
class Peer:
    """A handshaken producer rank."""

    meta: HandshakeResponse
    token: bytes
    peer_id: str
    side: SideLayout
    host: str
    port: int


@dataclass
class Load:
    request_id: str
    params: KVTransferParams
    local_blocks_full: np.ndarray  # one id per local block of the prompt, prefix hits included
    skip_tokens: int
    deadline: float
    batches: dict[int, tuple[str, Descriptors]] = field(default_factory=dict)  # batch id -> (peer id, pieces)
    staged: list[tuple[StagedPlan, Peer]] = field(default_factory=list)
    peers: dict[int, Peer] = field(default_factory=dict)  # remote rank -> peer
    error: str | None = None
    nbytes: int = 0
    started: float = field(default_factory=time.monotonic)
    local_block_size: int = 1
    retrying: int = 0  # batches refused as "not held", to be read again
    hold_wait_until: float = 0.0  # no more such retries after this (consumer clock)

    @property
    def invalid_blocks(self) -> list[int]:
        """The blocks this load was to write (prefix-hit blocks stay valid)."""
        return self.local_blocks_full[self.skip_tokens // self.local_block_size :].tolist()


class Consumer:
    """Loads requests into this rank's cache; thread-safe entry points, one worker thread."""

    def __init__(self, engine_id: str, rank: int, layout: ParallelLayout, tp_rank: int, pp_rank: int,
                 cache: KVCache, plane: DataPlane, client: SideChannelClient, secret: bytes | None,
                 model: str, transfer_s: float, lease_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 on_loaded: Callable[[list[int]], None] | None = None,
                 metrics: ConnectorMetrics | None = None, hold_wait_s: float = 1.0) -> None:
        self.engine_id = engine_id
        self.rank = rank
        self.layout = layout
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.cache = cache
        self.plane = plane
        self.client = client
        self.secret = secret
        self.model = model
        self.transfer_s = transfer_s
        self.lease_s = lease_s
        # A read refused as "not held" is tried again for this long. Engines order holds
        # asynchronously: vLLM makes the prefill side's hold one engine step after the request
        # finished, and the decode side, told by that same response, can ask first.
        self.hold_wait_s = hold_wait_s
        self.clock = clock
        self.on_loaded = on_loaded  # e.g. copy the loaded blocks from a host mirror to the device
        self.local_side = SideLayout.from_cache(cache)
        self.stats = metrics or ConnectorMetrics(engine_id, rank, plane.name)
        self._peers: dict[tuple[str, int], Peer] = {}  # (engine, rank) -> latest generation's peer
        self._loads: dict[str, Load] = {}
        self._batch_loads: dict[int, Load] = {}  # data-plane batch id -> its load (consumer thread only)
        self._waiting: dict[str, KVTransferParams] = {}
        self._done = Finished()
        self._ready = threading.Event()  # set whenever _done gains something
        self._jobs: queue.Queue[tuple[str, object]] = queue.Queue()
        self._notices: queue.Queue[tuple[RemoteRank, object] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._staging_ids = itertools.count(STAGING_REGION_BASE)
        self._retries: list[tuple[float, Load, str, Descriptors]] = []  # (when, load, peer id, pieces)
        self._stop = threading.Event()
        plane.set_completion_callback(lambda: self._jobs.put(("wake", None)))
        self._worker = threading.Thread(target=self._run, name=f"kvxfer-consumer-{rank}", daemon=True)
        self._notifier = threading.Thread(target=self._notify_loop, name=f"kvxfer-notify-{rank}", daemon=True)
        self._worker.start()
        self._notifier.start()

    # ------------------------------------------------------------------ engine-facing
    def start_load(self, request_id: str, params: KVTransferParams, local_block_ids: list[int] | np.ndarray,
                   num_cached_tokens: int = 0) -> None:
        """Check the arguments (raising, with no state change), then load in the background."""
        ids = np.asarray(local_block_ids, dtype=np.int64)
        L = self.cache.spec.block_size
        need = math.ceil(params.num_tokens / L)
        if ids.ndim != 1 or len(ids) < need:
            raise ValueError(f"request {request_id}: {params.num_tokens} tokens need {need} local blocks of "
                             f"{L}, got {len(ids)}")
        if len(ids) and (ids.min() < 0 or ids.max() >= self.cache.num_blocks):
            raise ValueError(f"request {request_id}: local block ids must be in [0, {self.cache.num_blocks})")
        if len(np.unique(ids[:need])) != need:
            raise ValueError(f"request {request_id}: local block ids repeat")
        if not 0 <= num_cached_tokens <= params.num_tokens:
            raise ValueError(f"request {request_id}: num_cached_tokens must be in [0, {params.num_tokens}]")
        check_alignment(num_cached_tokens, params.block_size, L)
        check_compatible(self.layout, params.layout)
        if len(params.block_ids) < math.ceil(params.num_tokens / params.block_size):
            raise ValueError(f"request {request_id}: params carry {len(params.block_ids)} remote blocks for "
                             f"{params.num_tokens} tokens of {params.block_size}")
        with self._lock:
            if request_id in self._loads:
                raise ValueError(f"request {request_id} is already loading")
            self._waiting.pop(request_id, None)
            load = Load(request_id, params, ids[:need], num_cached_tokens, self.clock() + self.transfer_s,
                        local_block_size=L)
            self._loads[request_id] = load
            self.stats.load_started()
        self._jobs.put(("load", load))

    def wait(self, request_id: str, params: KVTransferParams) -> None:
        """The request waits in the decode queue: keep its producer holds alive until loaded."""
        with self._lock:
            self._waiting[request_id] = params
        self._jobs.put(("renew", None))  # renew now: the lease may be short and half spent

    def abandon(self, request_id: str, params: KVTransferParams, reason: str = "dropped") -> None:
        """The request will not be loaded: tell the producers to free it now."""
        with self._lock:
            self._waiting.pop(request_id, None)
        for r in params.ranks:
            self._notices.put((r, Abandon(request_id=params.request_id, generation=r.generation, reason=reason,
                                          token=self._token_for(params.engine_id, r))))

    def poll(self, timeout_s: float = 0.0) -> Finished:
        """What finished since the last call; with a timeout, wait (GIL released) for something."""
        if timeout_s > 0:
            self._ready.wait(timeout_s)
        with self._lock:
            out, self._done = self._done, Finished()
            self._ready.clear()
        return out

    def close(self) -> None:
        self._stop.set()
        self._jobs.put(("stop", None))
        self._notices.put(None)
        self._worker.join(timeout=10)
        self._notifier.join(timeout=10)

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        next_renew = self.clock() + self.lease_s / 3
        while not self._stop.is_set():
            try:
                kind, obj = self._jobs.get(timeout=0.05)
            except queue.Empty:
                kind, obj = "tick", None
            if kind == "stop":
                break
            if kind == "load":
                assert isinstance(obj, Load)
                self._begin(obj)
            elif kind == "renew":
                next_renew = self.clock()
            for res in self.plane.poll():
                self._on_batch(res)
            now = self.clock()
            self._read_again(now)
            self._check_deadlines(now)
            if now >= next_renew:
                self._renew_waiting()
                next_renew = now + self._renew_interval()

    def _peer(self, engine_id: str, r: RemoteRank, params: KVTransferParams) -> Peer:
        key = (engine_id, r.rank)
        peer = self._peers.get(key)
        if peer is not None and peer.meta.generation == r.generation:
            return peer
        if peer is not None:  # the producer restarted: drop what we knew of the old one
            logger.info("producer %s rank %d restarted (generation changed); handshaking again", engine_id, r.rank)
            self.plane.disconnect(peer.peer_id)
            del self._peers[key]
        t0 = time.monotonic()
        meta, token = self.client.handshake(r.host, r.port, self.engine_id, self.rank, self.layout, self.secret)
        self.stats.handshook(time.monotonic() - t0)
        self._check_peer(meta, engine_id, r, params)
        side = SideLayout.from_remote(meta.spec, meta.regions)
        peer_id = f"{engine_id}/{r.rank}/{meta.generation}"
        self.plane.connect(peer_id, meta.data_address, token)
        peer = Peer(meta, token, peer_id, side, r.host, r.port)
        self._peers[key] = peer
        return peer

    def _check_peer(self, meta: HandshakeResponse, engine_id: str, r: RemoteRank, params: KVTransferParams) -> None:
        if meta.engine_id != engine_id or meta.rank != r.rank:
            raise HandshakeError(f"{r.host}:{r.port} is {meta.engine_id} rank {meta.rank}, "
                                 f"expected {engine_id} rank {r.rank}")
        if meta.generation != r.generation:
            raise HandshakeError(f"producer {engine_id} rank {r.rank} restarted: params are for generation "
                                 f"{r.generation}, it now serves {meta.generation}; its blocks are gone")
        local = self.cache.spec
        mine = compat_hash(self.model, self.layout.num_layers, self.layout.num_kv_heads, local.head_size,
                           local.dtype, local.mla)
        if meta.compat_hash != mine:
            diffs = [f"{name}: local {a!r}, remote {b!r}" for name, a, b in (
                ("model", self.model, meta.model), ("num_layers", self.layout.num_layers, meta.layout.num_layers),
                ("num_kv_heads", self.layout.num_kv_heads, meta.layout.num_kv_heads),
                ("head_size", local.head_size, meta.spec.head_size), ("dtype", local.dtype, meta.spec.dtype),
                ("mla", local.mla, meta.spec.mla)) if a != b]
            raise HandshakeError(f"incompatible producer {engine_id} rank {r.rank}: " + ("; ".join(diffs) or
                                 f"compatibility hash {meta.compat_hash} != {mine}"))
        if meta.spec.kv_fused != local.kv_fused:
            raise HandshakeError(f"incompatible producer {engine_id} rank {r.rank}: kv_fused: local {local.kv_fused}, "
                                 f"remote {meta.spec.kv_fused} (no repack between fused and separate K/V yet)")
        rbs, lbs = meta.spec.block_size, local.block_size
        if local.kv_fused and rbs != lbs:
            raise HandshakeError(f"producer {engine_id} rank {r.rank}: fused caches (vLLM's CPU layout) move whole "
                                 f"blocks in the engine's own token order: block sizes must match (local {lbs}, "
                                 f"remote {rbs})")
        if max(rbs, lbs) % min(rbs, lbs):
            raise HandshakeError(f"unsupported block sizes: local {lbs}, remote {rbs} (must divide one another)")

    def _begin(self, load: Load) -> None:
        try:
            params = load.params
            slices = remote_sources(self.layout, self.tp_rank, self.pp_rank, params.layout)
            by_rank: dict[int, list[SourceSlice]] = {}
            for s in slices:
                by_rank.setdefault(s.remote_rank, []).append(s)
            ranks = {r.rank: r for r in params.ranks}
            remote_blocks = np.asarray(params.block_ids, dtype=np.int64)
            for rr, sls in by_rank.items():
                if rr not in ranks:
                    raise LoadFailed(f"params name no address for producer rank {rr}")
                peer = self._peer(params.engine_id, ranks[rr], params)
                load.peers[rr] = peer
                parts: list[Descriptors] = []
                for s in sls:
                    if peer.side.layout == self.local_side.layout:
                        parts.append(plan_direct(peer.side, self.local_side, s, remote_blocks, load.local_blocks_full,
                                                 load.skip_tokens, params.num_tokens))
                    else:
                        rid = next(self._staging_ids)
                        d, plan = plan_staged(peer.side, s, remote_blocks, load.skip_tokens, params.num_tokens, rid)
                        st = plan.staging
                        self.plane.register([MemoryRegion(region_id=rid, address=st.data_ptr(), length=st.numel(),
                                                          block_stride=st.numel(), num_blocks=1,
                                                          layers=(0, 0), kind="KV")])
                        load.staged.append((plan, peer))
                        parts.append(d)
                descs = concat(parts)
                self.stats.planned(len(descs))
                load.nbytes += descs.nbytes
                self._issue(load, peer.peer_id, descs)
        except (HandshakeError, LoadFailed, ValueError, ConnectionError) as e:
            self._fail(load, str(e))
            return
        if not load.batches:
            self._complete(load)

    def _issue(self, load: Load, peer_id: str, descs: Descriptors) -> None:
        # the producer knows the request by its own id, which may differ from ours
        batch = self.plane.read(peer_id, load.params.request_id, descs)
        load.batches[batch] = (peer_id, descs)
        self._batch_loads[batch] = load

    def _read_again(self, now: float) -> None:
        due = [r for r in self._retries if r[0] <= now]
        if not due:
            return
        self._retries = [r for r in self._retries if r[0] > now]
        for _, load, peer_id, descs in due:
            load.retrying -= 1
            if self._loads.get(load.request_id) is load and load.error is None:
                self._issue(load, peer_id, descs)

    def _on_batch(self, res: BatchResult) -> None:
        load = self._batch_loads.pop(res.batch_id, None)
        if load is None or res.batch_id not in load.batches:
            return
        _, descs = load.batches.pop(res.batch_id)
        now = self.clock()
        if not res.ok and NOT_HELD in (res.error or "") and load.error is None:
            if not load.hold_wait_until:
                load.hold_wait_until = now + self.hold_wait_s
            if now < load.hold_wait_until:  # the producer's hold may not be made yet: read again soon
                logger.debug("request %s: %s; reading again", load.request_id, res.error)
                load.retrying += 1
                self._retries.append((now + READ_AGAIN_AFTER_S, load, res.peer_id, descs))
                return
        if not res.ok:
            if load.error is None:
                load.error = res.error
            self._forget(res.peer_id)  # the next load handshakes again, on a fresh connection
        if not load.batches and not load.retrying:
            if load.error is not None:
                self._fail(load, load.error)
            else:
                self._complete(load)

    def _check_deadlines(self, now: float) -> None:
        with self._lock:
            late = [ld for ld in self._loads.values() if ld.deadline <= now]
        for load in late:
            # stop the data plane writing into these blocks before we call them invalid
            for peer_id in {peer_id for peer_id, _ in load.batches.values()}:
                self._forget(peer_id)
            self._drop_batches(load)
            self._fail(load, f"not loaded within {self.transfer_s:g}s", timed_out=True)

    def _drop_batches(self, load: Load) -> None:
        for batch in load.batches:
            self._batch_loads.pop(batch, None)
        load.batches.clear()
        if load.retrying:
            self._retries = [r for r in self._retries if r[1] is not load]
            load.retrying = 0

    def _forget(self, peer_id: str) -> None:
        """Close the data path to a peer and drop what the handshake told us of it."""
        self.plane.disconnect(peer_id)
        for key, p in list(self._peers.items()):
            if p.peer_id == peer_id:
                del self._peers[key]

    def _complete(self, load: Load) -> None:
        try:
            for plan, peer in load.staged:
                finish_staged(plan, peer.side, self.cache, load.local_blocks_full, load.skip_tokens,
                              load.params.num_tokens)
            if self.on_loaded is not None:
                self.on_loaded(load.invalid_blocks)
        except (ValueError, RuntimeError) as e:
            self._fail(load, f"repack failed: {e}")
            return
        self._release_staging(load)
        params = load.params
        for rr, peer in load.peers.items():
            self._notices.put((_rank_of(params, rr), self._done_notice(load, peer.meta.generation, peer.token)))
        if self.rank == 0:  # producer ranks no consumer rank reads still wait for one notice
            for r in params.ranks:
                tp, pp = r.rank % params.layout.tp_size, r.rank // params.layout.tp_size
                if readers_of(params.layout, tp, pp, self.layout) == 0:
                    self._notices.put((r, self._done_notice(load, r.generation, self._token_for(params.engine_id, r))))
        with self._lock:
            self._loads.pop(load.request_id, None)
            self._done.receiving.append(load.request_id)
            self._ready.set()
        self.stats.load_finished(time.monotonic() - load.started, load.nbytes)
        logger.debug("request %s: loaded %d bytes in %.1f ms", load.request_id, load.nbytes,
                     (time.monotonic() - load.started) * 1e3)

    def _done_notice(self, load: Load, generation: int, token: bytes) -> DoneNotice:
        return DoneNotice(request_id=load.params.request_id, engine_id=self.engine_id, rank=self.rank,
                          layout=self.layout, generation=generation, token=token)

    def _fail(self, load: Load, why: str, timed_out: bool = False) -> None:
        self._drop_batches(load)
        self._release_staging(load)
        logger.warning("request %s: load from %s failed: %s", load.request_id, load.params.engine_id, why)
        for r in load.params.ranks:
            self._notices.put((r, Abandon(request_id=load.params.request_id, generation=r.generation, reason=why[:1000],
                                          token=self._token_for(load.params.engine_id, r))))
        with self._lock:
            self._loads.pop(load.request_id, None)
            self._done.failed[load.request_id] = load.invalid_blocks
            self._done.errors[load.request_id] = why
            self._ready.set()
        self.stats.load_finished(time.monotonic() - load.started, error=why, timed_out=timed_out)

    def _release_staging(self, load: Load) -> None:
        if load.staged:
            self.plane.unregister([plan.region_id for plan, _ in load.staged])
            load.staged = []

    def _token_for(self, engine_id: str, r: RemoteRank) -> bytes:
        peer = self._peers.get((engine_id, r.rank))
        return peer.token if peer is not None and peer.meta.generation == r.generation else b""

    def _renew_interval(self) -> float:
        """A third of the shortest lease among waiting requests (the producer's, from params)."""
        with self._lock:
            leases = [p.lease_s for p in self._waiting.values()]
        return min([self.lease_s, *leases]) / 3

    def _renew_waiting(self) -> None:
        with self._lock:
            waiting = list(self._waiting.values())
        by_rank: dict[tuple[str, int, int], tuple[RemoteRank, list[str], str]] = {}
        for p in waiting:
            for r in p.ranks:
                key = (p.engine_id, r.rank, r.generation)
                by_rank.setdefault(key, (r, [], p.engine_id))[1].append(p.request_id)
        for r, ids, engine in by_rank.values():
            self._notices.put((r, LeaseRenew(request_ids=ids, generation=r.generation,
                                             token=self._token_for(engine, r))))

    def _notify_loop(self) -> None:
        while True:
            item = self._notices.get()
            if item is None:
                break
            r, msg = item
            try:
                reply = self.client.request(r.host, r.port, msg, retries=1)  # type: ignore[arg-type]
                if isinstance(reply, ErrorReply):
                    logger.info("producer rank %d answered %s: %s: %s", r.rank, type(msg).__name__, reply.code,
                                reply.message)
            except HandshakeError as e:
                logger.warning("%s to producer rank %d not delivered: %s", type(msg).__name__, r.rank, e)


def _rank_of(params: KVTransferParams, rank: int) -> RemoteRank:
    return next(r for r in params.ranks if r.rank == rank)
