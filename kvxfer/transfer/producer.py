"""The producer side: holds on a request's blocks, and the rules for serving reads of them.

A hold pins a request's blocks until every consumer rank that topology says will read this
rank has sent a done notice, the consumer abandons the request, or the lease runs out. The
lease starts at ``lease_s``; renewals (sent while the request waits in the decode queue) and
reads push it out again, but never past ``abort_s`` after the hold began. Once a hold is
released, reads for it are refused: its blocks may already hold another request's KV.

Push mode: a *streaming* hold starts with no layer saved; ``save_layer`` marks each layer as
the engine's forward pass writes it, and a read of a region whose layers are not all saved is
refused (``not_ready``). The hold keeps the push targets (decode reservations) it feeds; the
:class:`~kvxfer.transfer.pusher.Pusher` tells them what is saved.

Engines make holds asynchronously (vLLM: one engine step after the request finished), so a
consumer's abandon can arrive before the hold it is for. Such an abandon is remembered for
``lease_s`` (bounded): the hold, when it comes, is released at once as "abandoned", not a
lease later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from kvxfer.dataplane import Descriptors
from kvxfer.protocol import ErrorCode, KVTransferParams, PushTarget, Refusal
from kvxfer.supervise import report
from kvxfer.topology import ParallelLayout, readers_of

logger = logging.getLogger(__name__)

# Why a hold ended: every reader said done, the consumer abandoned it (its load failed or the
# request ended), the lease ran out, or the engine released it. Counted per reason: a failed
# load should free its blocks by "abandoned" at once, not by "expired" a lease later.
ReleaseReason = Literal["done", "abandoned", "expired", "engine"]
RELEASE_REASONS: tuple[ReleaseReason, ...] = get_args(ReleaseReason)
MAX_EARLY_ABANDONS = 65536  # abandons remembered for holds not made yet (the oldest are forgotten first)


@dataclass
class Hold:
    request_id: str
    block_ids: np.ndarray
    num_tokens: int
    held_mask_cumsum: np.ndarray  # cumsum of a per-block "held" mask, for range checks
    lease_deadline: float
    abort_deadline: float
    expected_readers: int | None = None
    done_from: set[tuple[str, int]] = field(default_factory=set)
    # push mode: which of this rank's layers are saved (None: all, a pull hold), which regions
    # may be read (by position in the registry's sorted region ids), and whom to tell
    saved: np.ndarray | None = None
    ready: np.ndarray | None = None
    params: KVTransferParams | None = None  # this rank's params, for the push notices
    targets: list[PushTarget] = field(default_factory=list)
    unread: bool = False  # pushed only to targets none of whose ranks read this rank


class HoldRegistry:
    """Holds of one producer rank; thread-safe (side channel, data plane and engine threads)."""

    def __init__(self, layout: ParallelLayout, tp_rank: int, pp_rank: int, num_blocks: int,
                 regions: dict[int, tuple[int, int]], lease_s: float, abort_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 region_layers: dict[int, tuple[int, int]] | None = None) -> None:
        self.layout = layout
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.num_blocks = num_blocks
        self.regions = regions  # region id -> (block_stride, length)
        self._known = np.array(sorted(regions), dtype=np.int64)
        self._strides = np.array([regions[int(k)][0] for k in self._known], dtype=np.int64)
        self._lengths = np.array([regions[int(k)][1] for k in self._known], dtype=np.int64)
        # each region's global layers [start, stop), for push mode's per-layer readiness
        spans = region_layers or {}
        self._first = np.array([spans.get(int(k), (0, 0))[0] for k in self._known], dtype=np.int64)
        self._stop = np.array([spans.get(int(k), (0, 0))[1] for k in self._known], dtype=np.int64)
        self.first_layer = int(self._first.min()) if len(self._first) and spans else 0
        self.layer_stop = int(self._stop.max()) if len(self._stop) and spans else 0
        self.lease_s = lease_s
        self.abort_s = abort_s
        self.clock = clock
        self._holds: dict[str, Hold] = {}
        self._released: list[str] = []
        self._any_released = threading.Event()  # set while _released is not empty: a waiting poll returns
        self._early_abandons: OrderedDict[str, float] = OrderedDict()  # request id -> forget after (clock)
        self._lock = threading.Lock()
        self.refused_reads = 0
        self.released_by: dict[ReleaseReason, int] = dict.fromkeys(RELEASE_REASONS, 0)
        # told, under the lock, of every pull hold made (its block ids) and every hold ended (None):
        # a one-sided data plane publishes them (kvxfer.transfer.hold_board)
        self.on_change: Callable[[str, np.ndarray | None], None] | None = None
        # told, under the lock, that a hold ended: wakes a poll that waits on the consumer's side too
        self.on_release: Callable[[], None] | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)

    def held_blocks(self) -> int:
        with self._lock:
            return sum(len(h.block_ids) for h in self._holds.values())

    def hold(self, request_id: str, block_ids: Sequence[int] | np.ndarray, num_tokens: int,
             streaming: bool = False) -> Hold:
        """Pin ``block_ids`` for ``request_id``; ``streaming``: no layer is saved yet (push mode)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise ValueError(f"request {request_id}: block_ids must be a non-empty list")
        if ids.min() < 0 or ids.max() >= self.num_blocks:
            raise ValueError(f"request {request_id}: block ids must be in [0, {self.num_blocks}), "
                             f"got min {int(ids.min())} max {int(ids.max())}")
        if num_tokens < 1:
            raise ValueError(f"request {request_id}: num_tokens must be >= 1, got {num_tokens}")
        mask = np.zeros(self.num_blocks + 1, dtype=np.int64)
        mask[ids + 1] = 1
        now = self.clock()
        h = Hold(request_id, ids, num_tokens, np.cumsum(mask), now + self.lease_s, now + self.abort_s)
        if streaming:
            if self.layer_stop <= self.first_layer:
                raise ValueError(f"request {request_id}: a streaming hold needs the regions' layers")
            h.saved = np.zeros(self.layer_stop - self.first_layer, dtype=bool)
            h.ready = np.zeros(len(self._known), dtype=bool)
        with self._lock:
            if request_id in self._holds:
                raise ValueError(f"request {request_id} is already held")
            self._holds[request_id] = h
            if h.saved is None:
                self._changed(request_id, ids)
            forget_after = self._early_abandons.pop(request_id, None)
            if forget_after is not None and forget_after > now:  # its consumer gave up before the hold came
                self._release(request_id, "abandoned", "abandoned by the consumer before the hold was made")
        return h

    def block_ids_of(self, request_id: str) -> np.ndarray | None:
        with self._lock:
            h = self._holds.get(request_id)
            return None if h is None else h.block_ids

    def num_tokens_of(self, request_id: str) -> int | None:
        with self._lock:
            h = self._holds.get(request_id)
            return None if h is None else h.num_tokens

    def save_layer(self, request_id: str, layer: int) -> bool:
        """Layer ``layer`` of a streaming hold is written: its regions may be read once every
        layer they hold is saved. Renews the lease. Returns whether push targets wait for it."""
        if not self.first_layer <= layer < self.layer_stop:
            raise ValueError(f"request {request_id}: layer {layer} is not on this rank (layers "
                             f"{self.first_layer}..{self.layer_stop - 1})")
        now = self.clock()
        with self._lock:
            h = self._holds.get(request_id)
            if h is None:
                raise ValueError(f"request {request_id} is not held (never held, released, or expired)")
            if h.saved is None:
                return False  # a pull hold: every layer counts as saved
            h.saved[layer - self.first_layer] = True
            cs = np.concatenate([[0], np.cumsum(h.saved)])
            a, b = self._first - self.first_layer, self._stop - self.first_layer
            h.ready = (cs[b] - cs[a]) == (b - a)
            h.lease_deadline = min(max(h.lease_deadline, now + self.lease_s), h.abort_deadline)
            self._release_if_unread(h)
            return bool(h.targets)

    def attach(self, request_id: str, target: PushTarget, params: KVTransferParams) -> bool:
        """Push this hold's saved layers (now, and as they are saved) to ``target``. False when no
        rank of ``target`` reads this rank (a replica another rank serves, e.g. MLA's latent from
        TP2 to TP1): nothing is sent to it, and a hold with no other target is released as done
        (its readers, none, are done) once every layer is saved (the engine's ``save_layer`` calls
        still find it), not by a notice race or a lease later."""
        readers = readers_of(self.layout, self.tp_rank, self.pp_rank, target.layout)
        with self._lock:
            h = self._holds.get(request_id)
            if h is None:
                raise ValueError(f"request {request_id} is not held (never held, released, or expired)")
            if any(t.engine_id == target.engine_id and t.request_id == target.request_id for t in h.targets):
                raise ValueError(f"request {request_id}: already pushed to {target.engine_id} "
                                 f"request {target.request_id}")
            if readers == 0:
                if not h.targets:
                    h.unread = True
                    self._release_if_unread(h)
                return False
            h.params = params
            h.targets.append(target)
            h.unread = False
            return True

    def _release_if_unread(self, h: Hold) -> None:
        """Caller holds the lock: release a hold no push target reads once all its layers are saved."""
        if h.unread and (h.saved is None or bool(h.saved.all())):
            self._release(h.request_id, "done", "no rank of its push targets reads this rank")

    def push_state(self, request_id: str) -> tuple[KVTransferParams, list[PushTarget], list[int]] | None:
        """What the pusher sends for a request: its params, targets and saved layers; None when
        it is no longer held (or has no target)."""
        with self._lock:
            h = self._holds.get(request_id)
            if h is None or h.params is None or not h.targets:
                return None
            if h.saved is None:
                layers = list(range(self.first_layer, self.layer_stop))
            else:
                layers = (np.flatnonzero(h.saved) + self.first_layer).tolist()
            return h.params, list(h.targets), layers

    def abandon(self, request_id: str, why: str) -> bool:
        """The consumer will not read this request: release its hold now, or, if it is not made
        yet, as soon as it is (within ``lease_s``). True if a hold was released now."""
        with self._lock:
            if self._release(request_id, "abandoned", why):
                return True
            now = self.clock()
            self._early_abandons[request_id] = now + self.lease_s
            self._early_abandons.move_to_end(request_id)
            while self._early_abandons and (len(self._early_abandons) > MAX_EARLY_ABANDONS
                                            or next(iter(self._early_abandons.values())) <= now):
                self._early_abandons.popitem(last=False)
        return False

    def _release(self, request_id: str, reason: ReleaseReason, why: str) -> bool:
        """Caller holds the lock."""
        if self._holds.pop(request_id, None) is None:
            return False
        self._changed(request_id, None)  # before the engine can learn of it (take_released) and free the blocks
        self._released.append(request_id)
        self._any_released.set()
        if self.on_release is not None:
            try:
                self.on_release()
            except Exception as e:
                report("hold registry: on_release", e, f"request {request_id}")
        self.released_by[reason] += 1
        logger.debug("request %s: hold released (%s: %s)", request_id, reason, why)
        return True

    def _changed(self, request_id: str, ids: np.ndarray | None) -> None:
        """Caller holds the lock: tell ``on_change``; a failure there is reported, never raised."""
        if self.on_change is not None:
            try:
                self.on_change(request_id, ids)
            except Exception as e:
                report("hold registry: on_change", e, f"request {request_id}")

    def release(self, request_id: str, reason: ReleaseReason = "engine", why: str = "") -> bool:
        with self._lock:
            return self._release(request_id, reason, why)

    def on_done(self, request_id: str, consumer_engine: str, consumer_rank: int,
                consumer_layout: ParallelLayout) -> str | None:
        """Count a done notice; release once every expected reader has sent one."""
        with self._lock:
            h = self._holds.get(request_id)
            if h is None:
                return f"request {request_id} is not held"
            if h.expected_readers is None:
                h.expected_readers = readers_of(self.layout, self.tp_rank, self.pp_rank, consumer_layout)
            h.done_from.add((consumer_engine, consumer_rank))
            if len(h.done_from) >= h.expected_readers:
                self._release(request_id, "done", f"{len(h.done_from)} of {h.expected_readers} readers done")
        return None

    def renew(self, request_ids: Sequence[str]) -> int:
        now = self.clock()
        n = 0
        with self._lock:
            for rid in request_ids:
                h = self._holds.get(rid)
                if h is not None:
                    h.lease_deadline = min(max(h.lease_deadline, now + self.lease_s), h.abort_deadline)
                    n += 1
        return n

    def expire(self) -> list[str]:
        """Release holds whose lease (or hard abort limit) passed."""
        now = self.clock()
        with self._lock:
            late = [rid for rid, h in self._holds.items() if min(h.lease_deadline, h.abort_deadline) <= now]
            for rid in late:
                logger.warning("request %s: hold expired before its readers finished; blocks freed", rid)
                self._release(rid, "expired", "lease or abort limit passed")
        return late

    def take_released(self) -> list[str]:
        with self._lock:
            out, self._released = self._released, []
            self._any_released.clear()
        return out

    def wait_released(self, timeout_s: float) -> bool:
        """Wait (GIL released) until a hold has ended that ``take_released`` has not taken, or the timeout."""
        return self._any_released.wait(timeout_s)

    def validate(self, request_id: str, d: Descriptors) -> Refusal | None:
        """Serve a read only inside registered regions and inside blocks held for the request.

        A read for a request with no hold is refused as ``not_held``: consumers read that as "the
        hold may not be made yet" (engines order holds asynchronously) and try again for a while."""
        why = self._check(request_id, d)
        if why is not None:
            self.refused_reads += 1
        return why

    def _check(self, request_id: str, d: Descriptors) -> Refusal | None:
        if len(d) == 0:
            return None
        rids = d.remote_region
        known = self._known
        pos = np.minimum(np.searchsorted(known, rids), len(known) - 1)
        if not (known[pos] == rids).all():
            return Refusal(ErrorCode.OUT_OF_BOUNDS, f"region {int(rids[known[pos] != rids][0])} is not registered")
        strides, lengths = self._strides[pos], self._lengths[pos]
        start, end = d.remote_offset, d.remote_offset + d.length
        if (end > lengths).any():
            return Refusal(ErrorCode.OUT_OF_BOUNDS, "a piece runs past the end of its region")
        first, last = start // strides, (end - 1) // strides
        now = self.clock()
        with self._lock:
            h = self._holds.get(request_id)
            if h is None:
                return Refusal(ErrorCode.NOT_HELD,
                               f"request {request_id} is not held (never held, released, or expired)")
            if min(h.lease_deadline, h.abort_deadline) <= now:
                return Refusal(ErrorCode.EXPIRED, f"request {request_id}: hold expired")
            if h.ready is not None and not h.ready[pos].all():
                i = int(np.flatnonzero(~h.ready[pos])[0])
                return Refusal(ErrorCode.NOT_READY, f"request {request_id}: region {int(rids[i])} holds layers "
                               "not saved yet")
            cs = h.held_mask_cumsum
            held = (cs[last + 1] - cs[first]) == (last - first + 1)
            if not held.all():
                i = int(np.flatnonzero(~held)[0])
                return Refusal(ErrorCode.OUT_OF_BOUNDS, f"request {request_id}: blocks {int(first[i])}.."
                               f"{int(last[i])} of region {int(rids[i])} are not held for it")
            # a read in progress keeps the hold alive
            h.lease_deadline = min(max(h.lease_deadline, now + self.lease_s), h.abort_deadline)
        return None
