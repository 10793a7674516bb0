"""The consumer's push mode: reservations a producer streams into, layer by layer.

``reserve`` makes a load with no params; each ``LayersReady`` a producer rank sends (through
the side channel) makes the worker read the layers it says are saved. The reads are this
rank's own, checked against the live reservation, so a push never writes into blocks this rank
has released. :class:`PushReceiver` is a part of :class:`~kvxfer.transfer.consumer.Consumer`
(its state and threads are the consumer's; see that class for who owns what).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from kvxfer.cache.tensors import KVCache
from kvxfer.dataplane import Descriptors
from kvxfer.metrics import ConnectorMetrics
from kvxfer.protocol import ErrorCode, KVTransferParams, LayersReady, Refusal, RemoteRank
from kvxfer.topology import ParallelLayout, check_compatible
from kvxfer.transfer.aggregator import Finished
from kvxfer.transfer.load import (
    AlreadyLoading,
    Batch,
    Job,
    Load,
    LoadFailed,
    Peer,
    PushNotice,
    PushState,
    RankPush,
    repeats,
)
from kvxfer.transfer.load_planner import LoadPlanner
from kvxfer.transfer.planner import SideLayout, check_alignment


class PushReceiver:
    """Push mode of the consumer (mixed into it)."""

    # the consumer's, declared for the methods here
    rank: int
    layout: ParallelLayout
    cache: KVCache
    clock: Callable[[], float]
    transfer_s: float
    reservation_s: float
    stats: ConnectorMetrics
    local_side: SideLayout
    planner: LoadPlanner
    _lock: threading.Lock
    _layer_cv: threading.Condition
    _loads: dict[str, Load]
    _waiting: dict[str, KVTransferParams]
    _outcomes: OrderedDict[str, bool]
    _done: Finished
    _broken: str | None
    _ready: threading.Event
    _jobs: queue.Queue[Job]

    def _live(self, load: Load) -> bool:
        raise NotImplementedError  # the consumer's
    def _peer(self, engine_id: str, r: RemoteRank, params: KVTransferParams) -> Peer:
        raise NotImplementedError  # the consumer's
    def _issue(self, batch: Batch) -> None:
        raise NotImplementedError  # the consumer's
    def _complete(self, load: Load) -> None:
        raise NotImplementedError  # the consumer's

    # ------------------------------------------------------------------ engine and side-channel threads
    def reserve(self, request_id: str, local_block_ids: Sequence[int] | np.ndarray, num_tokens: int,
                num_cached_tokens: int = 0) -> None:
        """Push mode: blocks reserved for a prompt a producer will push (checked, raising with
        no state change); loads as the producer's notices come, until ``reservation_s``."""
        ids = np.asarray(local_block_ids, dtype=np.int64)
        L = self.cache.spec.block_size
        if num_tokens < 1:
            raise ValueError(f"request {request_id}: num_tokens must be >= 1, got {num_tokens}")
        need = math.ceil(num_tokens / L)
        if ids.ndim != 1 or len(ids) < need:
            raise ValueError(f"request {request_id}: {num_tokens} tokens need {need} local blocks of {L}, "
                             f"got {len(ids)}")
        if ids[:need].min() < 0 or ids[:need].max() >= self.cache.num_blocks:
            raise ValueError(f"request {request_id}: local block ids must be in [0, {self.cache.num_blocks})")
        if repeats(ids[:need]):
            raise ValueError(f"request {request_id}: local block ids repeat")
        if not 0 <= num_cached_tokens < num_tokens or num_cached_tokens % L:
            raise ValueError(f"request {request_id}: num_cached_tokens must be a multiple of {L} in "
                             f"[0, {num_tokens})")
        now = self.clock()
        with self._lock:
            if request_id in self._loads:
                raise AlreadyLoading(f"request {request_id} is already loading")
            if self._broken is not None:
                raise RuntimeError(f"cannot reserve: {self._broken}")
            self._waiting.pop(request_id, None)
            self._outcomes.pop(request_id, None)
            load = Load(request_id, None, ids[:need], num_cached_tokens, now + self.reservation_s, local_block_size=L,
                        push=PushState(num_tokens, now + self.reservation_s))
            load.began_at = time.monotonic()
            self._loads[request_id] = load
            self.stats.load_started()

    def layers_ready(self, msg: LayersReady) -> Refusal | None:
        """Side-channel thread: a producer rank saved layers of a reserved request. Refused when
        the reservation is gone (released, expired, finished, never made) or the notice does not
        fit it; otherwise the worker reads those layers."""
        with self._lock:
            load = self._loads.get(msg.request_id)
        if load is None or load.push is None:
            return Refusal(ErrorCode.UNKNOWN_REQUEST, f"no reservation {msg.request_id} on rank {self.rank} "
                           "(never made, finished, released or expired)")
        if load.deadline <= self.clock():
            return Refusal(ErrorCode.EXPIRED, f"reservation {msg.request_id} expired")
        src = msg.source
        if len(src.ranks) != 1:
            return Refusal(ErrorCode.BAD_PARAMS, f"a push notice names one producer rank, got {len(src.ranks)}")
        if src.num_tokens != load.push.num_tokens:
            return Refusal(ErrorCode.BAD_PARAMS, f"reservation {msg.request_id} is for {load.push.num_tokens} "
                           f"tokens, the push carries {src.num_tokens}")
        if any(not 0 <= layer < self.layout.num_layers for layer in msg.layers):
            return Refusal(ErrorCode.BAD_PARAMS, f"layers outside 0..{self.layout.num_layers - 1}")
        self._jobs.put(PushNotice(load, msg))
        return None

    def wait_layer(self, request_id: str, layer: int, timeout_s: float) -> bool:
        """Push mode: True once ``layer`` of the request has landed (or the whole load has);
        False if it failed, is unknown, or ``timeout_s`` passed first."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.layout.num_layers}, got {layer}")
        deadline = time.monotonic() + max(timeout_s, 0.0)
        with self._layer_cv:
            while True:
                load = self._loads.get(request_id)
                if load is None:
                    return self._outcomes.get(request_id, False)
                if load.push is not None and layer in load.push.landed:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._layer_cv.wait(remaining)

    # ------------------------------------------------------------------ worker thread
    def _on_layers_ready(self, load: Load, msg: LayersReady) -> None:
        """A producer rank saved layers: read whatever of them this rank needs and has not read."""
        if not self._live(load):
            return  # finished or failed meanwhile
        ps = load.push
        assert ps is not None
        src, rr = msg.source, msg.source.ranks[0]
        if load.params is None:
            check_compatible(self.layout, src.layout)
            check_alignment(load.skip_tokens, src.block_size, self.cache.spec.block_size)
            if len(src.block_ids) < math.ceil(src.num_tokens / src.block_size):
                raise LoadFailed(f"request {load.request_id}: the push carries {len(src.block_ids)} blocks for "
                                 f"{src.num_tokens} tokens of {src.block_size}")
            load.params = msgspec.structs.replace(src, ranks=[rr])
            ps.needed = self.planner.slices_by_rank(src)
        else:
            p = load.params
            for f in ("request_id", "engine_id", "block_ids", "block_size", "layout"):
                if getattr(src, f) != getattr(p, f):
                    raise LoadFailed(f"request {load.request_id}: producer rank {rr.rank} pushes another {f} than "
                                     f"rank {p.ranks[0].rank}")
            known = {r.rank: r for r in p.ranks}
            if rr.rank not in known:
                load.params = msgspec.structs.replace(p, ranks=[*p.ranks, rr])
            elif known[rr.rank] != rr:
                raise LoadFailed(f"request {load.request_id}: producer rank {rr.rank} changed its address or "
                                 "generation mid-push", ErrorCode.STALE_GENERATION)
        assert ps.needed is not None
        if rr.rank not in ps.needed:
            return  # this rank reads nothing of that producer rank
        load.deadline = min(ps.reserved_until, self.clock() + self.transfer_s)
        rp = ps.ranks.get(rr.rank)
        if rp is None:
            peer = self._peer(src.engine_id, rr, load.source)
            load.peers[rr.rank] = peer
            descs = self.planner.plan_rank(load, peer, ps.needed[rr.rank])
            spans = sorted((r.region_id, r.layers[0], r.layers[1]) for r in peer.meta.regions)
            table = np.array(spans, dtype=np.int64).reshape(-1, 3)
            pos = np.searchsorted(table[:, 0], descs.remote_region)
            n = len(descs)
            rp = RankPush(peer, descs, table[pos, 1], table[pos, 2], np.zeros(n, bool), np.zeros(n, bool))
            ps.ranks[rr.rank] = rp
        saved = np.zeros(self.layout.num_layers, dtype=np.int64)
        saved[np.asarray(msg.layers, dtype=np.int64)] = 1
        cs = np.concatenate([[0], np.cumsum(saved)])
        ready = (cs[rp.stop] - cs[rp.first]) == (rp.stop - rp.first)
        rows = np.flatnonzero(ready & ~rp.issued)
        if len(rows):
            d = rp.descs
            part = Descriptors(*(np.ascontiguousarray(getattr(d, f)[rows]) for f in
                                 ("remote_region", "remote_offset", "local_region", "local_offset", "length")))
            rp.issued[rows] = True
            batch = Batch(load, rp.peer.peer_id, part, rank=rr.rank, rows=rows)
            load.batches.append(batch)
            self._issue(batch)
        elif not load.batches and ps.all_issued():
            self._complete(load)

    def _landed(self, load: Load, batch: Batch) -> None:
        """A push read came back: report the layers now whole (not for staged loads, whose
        layers are usable only once repacked, at the end)."""
        ps = load.push
        if ps is None or batch.rows is None or ps.needed is None:
            return
        ps.ranks[batch.rank].landed[batch.rows] = True
        if load.staged:
            return
        new = []
        for layer in self.local_side_layers():
            if layer in ps.landed:
                continue
            for rr, sls in ps.needed.items():
                if not any(layer in s.layers for s in sls):
                    continue
                rp = ps.ranks.get(rr)
                if rp is None or not rp.landed[(rp.first <= layer) & (rp.stop > layer)].all():
                    break
            else:
                new.append(layer)
        if new:
            with self._layer_cv:
                ps.landed.update(new)
                self._done.layers.setdefault(load.request_id, []).extend(new)
                self._ready.set()
                self._layer_cv.notify_all()

    def local_side_layers(self) -> range:
        return range(self.local_side.first_layer, self.local_side.first_layer + self.local_side.num_layers)
