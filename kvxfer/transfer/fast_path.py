"""The consumer's fast path: a small load begun on the caller's thread, no thread hand-off.

A load of at most ``inline_load_bytes`` whose producer ranks are all handshaken already is
planned and issued on the thread that calls ``start_load`` (with an agent, its command thread),
if the worker is not in a turn; that thread then takes what the plane finished at once (cma copies
one-sided inside ``read``, so such a load is done when ``start_load`` returns). Several such loads
started together (``start_loads``) hand their reads to the plane in one ``read_many``. Anything
else is queued for the worker, which also does every first load (its handshake).

Threads: whoever holds the consumer's ``_turn_lock`` owns the worker's state; the fast path takes
the lock only if it is free (see :class:`kvxfer.transfer.consumer.Consumer`).
"""

from __future__ import annotations

import threading

from kvxfer.dataplane import DataPlane
from kvxfer.protocol import ErrorCode
from kvxfer.supervise import code_of, describe, report
from kvxfer.transfer.aggregator import Finished
from kvxfer.transfer.load import Batch, Load
from kvxfer.transfer.load_planner import LoadPlanner
from kvxfer.transfer.peers import PeerTable


class FastPath:
    """The fast path of the consumer (mixed into it)."""

    # the consumer's, declared for the methods here
    inline_load_bytes: int
    caller_takes_done: bool
    plane: DataPlane
    peers: PeerTable
    planner: LoadPlanner
    _bytes_per_block: int
    _turn_lock: threading.Lock
    _here: threading.local
    _deferred: list[Batch] | None
    _in_flight: dict[int, Batch]
    _broken: str | None
    _worker: threading.Thread
    _ready: threading.Event
    _done: Finished

    def _begin(self, load: Load) -> None:
        raise NotImplementedError  # the consumer's
    def _live(self, load: Load) -> bool:
        raise NotImplementedError  # the consumer's
    def _fail(self, load: Load, code: ErrorCode, why: str, timed_out: bool = False) -> None:
        raise NotImplementedError  # the consumer's
    def _poll_plane(self) -> None:
        raise NotImplementedError  # the consumer's

    def _small(self, load: Load) -> bool:
        return len(load.local_blocks_full) * self._bytes_per_block <= self.inline_load_bytes

    def _begin_here(self, loads: list[Load]) -> bool:
        """The fast path (class doc): begin small loads on this thread if the worker is not in a
        turn and every producer rank they read is known (no handshake here); all or none: False
        leaves every one for the caller to queue."""
        if not all(self._small(ld) for ld in loads):
            return False
        if not self._turn_lock.acquire(blocking=False):
            return False
        try:
            return self._begin_locked(loads)
        except Exception as e:  # a bug before a load began: the worker begins it (and reports what fails)
            report("consumer fast path", e, f"request {loads[0].request_id}"
                   + (f" and {len(loads) - 1} more" if len(loads) > 1 else " (queued for the worker)"))
            unissued = {id(b.load): b.load for b in self._deferred or []}
            for load in unissued.values():  # begun, their reads never issued: failed now, not at their deadline
                if self._live(load):
                    self._fail(load, ErrorCode.INTERNAL, f"starting the load failed: {describe(e)}")
            return all(ld.began_at != 0.0 for ld in loads)
        finally:
            self._here.on = False
            self._deferred = None
            self._turn_lock.release()
            if not self.caller_takes_done and self._done:
                self._ready.set()  # another thread may wait in poll for what the fast path finished

    def _begin_locked(self, loads: list[Load]) -> bool:
        """``_begin_here`` with the turn lock held. Several loads: their reads are collected as
        they are planned and handed to the plane together (``_issue_deferred``)."""
        for load in loads:
            params = load.source
            ranks = {r.rank: r for r in params.ranks}
            for rr in self.planner.slices_by_rank(params):
                if rr not in ranks or self.peers.known(params.engine_id, ranks[rr]) is None:
                    return False
        if self._broken is not None or not self._worker.is_alive():
            return False
        self._here.on = True
        if len(loads) == 1:
            self._begin(loads[0])
        else:
            self._deferred = []
            for load in loads:
                self._begin(load)
            self._issue_deferred()
        self._poll_plane()  # what the plane finished (cma: these loads) is reported now
        return True

    def _issue_deferred(self) -> None:
        """Hand the reads collected by ``_issue`` to the plane in one ``read_many``; those of a load
        that failed meanwhile are left out. If the plane raises, every load with a read in it fails."""
        batches, self._deferred = self._deferred or [], None
        batches = [b for b in batches if any(b is x for x in b.load.batches)]
        if not batches:
            return
        try:
            ids = self.plane.read_many([(b.peer_id, b.load.source.request_id, b.descs) for b in batches])
        except Exception as e:
            report("consumer: read_many", e, f"{len(batches)} reads")
            for peer_id in {b.peer_id for b in batches}:  # reads it began may still copy: stopped first
                self.peers.forget(peer_id)
            for load in {id(b.load): b.load for b in batches}.values():
                self._fail(load, code_of(e), describe(e))
            return
        for b, batch_id in zip(batches, ids, strict=True):
            b.batch_id = batch_id
            self._in_flight[batch_id] = b
