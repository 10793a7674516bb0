"""The consumer side: one rank pulling a request's blocks from the producer ranks it needs.

Work happens on the connector's own thread, never the engine's: handshakes (cached per
remote engine, rank and registration generation), planning, issuing reads, finishing
staged repacks, and the done or abandon notices. The engine only calls ``start_load`` and
``poll``. Every load has a deadline; a load that fails for any reason (peer gone,
refused read, timeout, incompatible peer) reports its local block ids as invalid.

Push mode uses the same loads: ``reserve`` makes one with no params yet, and each
``LayersReady`` from a producer rank (through the side channel) issues reads for the layers it
says are saved. The reads are this side's, checked against the live reservation, so a push
can never write into blocks this rank has released.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from kvxfer.cache.tensors import KVCache
from kvxfer.dataplane import BatchResult, DataPlane
from kvxfer.handshake import HandshakeError, SideChannelClient
from kvxfer.metrics import ConnectorMetrics
from kvxfer.protocol import (
    ErrorCode,
    KVTransferParams,
    RemoteRank,
)
from kvxfer.supervise import code_of, describe, report
from kvxfer.threads import NamedThread
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.aggregator import Finished
from kvxfer.transfer.fast_path import FastPath
from kvxfer.transfer.load import (
    AbandonRequest,
    AlreadyLoading,
    Batch,
    BeginLoad,
    EndReservation,
    EngineCopied,
    Job,
    Load,
    LoadFailed,
    Peer,
    PushNotice,
    RenewNow,
    Stop,
    Wake,
    checked_load_ids,
)
from kvxfer.transfer.load_planner import LoadPlanner
from kvxfer.transfer.notifier import Notifier
from kvxfer.transfer.peers import PeerTable
from kvxfer.transfer.planner import SideLayout, finish_staged
from kvxfer.transfer.producer_notices import ProducerNotices
from kvxfer.transfer.push_receiver import PushReceiver

__all__ = ["AlreadyLoading", "Consumer", "LoadFailed"]

logger = logging.getLogger(__name__)

READ_AGAIN_AFTER_S = 0.02  # a read refused as "not held" is sent again this soon (within hold_wait_s)
BROKEN_AFTER_POLL_ERRORS = 20  # the plane's poll raising on this many turns in a row (about a second): broken
JOB_WAIT_S = 0.05  # the worker wakes at least this often (deadlines, renewals, retries)
MAX_OUTCOMES = 4096  # finished requests whose outcome wait_layer still answers


class Consumer(FastPath, PushReceiver, ProducerNotices):
    """Loads requests into this rank's cache: thread-safe entry points, one worker thread.

    Threads and what each owns:
    - the engine's thread calls ``start_load``, ``reserve``, ``wait``, ``wait_layer``,
      ``abandon``, ``poll`` and ``close``; the side-channel thread calls ``layers_ready``;
    - the worker's state, ``peers``, ``planner``, ``_in_flight``, ``_read_again``, every
      ``Load``'s mutable fields and every ``Batch``, belongs to whoever holds ``_turn_lock``: the
      worker thread (``_run``) for each turn, or the thread in ``start_load`` on the fast path
      (:mod:`kvxfer.transfer.fast_path`: a small load from producer ranks already handshaken is
      begun on the caller's thread, which takes the plane's finished reads at once). Only the
      holder calls the data plane (but for the completion callback, which only queues a ``Wake``);
    - what a worker turn finished goes to ``worker_takes_done`` (the agent sends it from there)
      or wakes the threads waiting in ``poll``;
    - the notifier's thread (:class:`Notifier`) sends ``Notice``s; it owns nothing of the consumer's.
    ``_loads``, ``_waiting``, ``_done``, ``_outcomes``, ``_broken`` and every push load's
    ``landed`` are shared: read and written under ``_lock`` (``_layer_cv`` is its condition).

    Supervision: an exception in one step of the worker fails only the loads it touched
    (reported with their block ids and the exception named) and the worker goes on. A plane
    that says it is ``broken`` (or whose ``poll`` keeps raising) fails every pending and later
    load at once; if the worker thread itself ever stops, ``poll`` does the same.
    """

    def __init__(self, engine_id: str, rank: int, layout: ParallelLayout, tp_rank: int, pp_rank: int,
                 cache: KVCache, plane: DataPlane, client: SideChannelClient, secret: bytes | None,
                 model: str, transfer_s: float, lease_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 on_loaded: Callable[[list[int]], None] | None = None,
                 metrics: ConnectorMetrics | None = None, hold_wait_s: float = 1.0,
                 reservation_s: float = 60.0, inline_load_bytes: int = 0) -> None:
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
        self.reservation_s = reservation_s
        self.inline_load_bytes = inline_load_bytes
        self.clock = clock
        self.on_loaded = on_loaded  # e.g. copy the loaded blocks from a host mirror to the device
        self.local_side = SideLayout.from_cache(cache)
        self.stats = metrics or ConnectorMetrics(engine_id, rank, plane.name)
        self.planner = LoadPlanner(layout, tp_rank, pp_rank, self.local_side, plane, self.stats)  # turn-lock holder's
        self._bytes_per_block = cache.spec.bytes_per_block  # the fast path's size test (a chain of properties)
        self.peers = PeerTable(engine_id, rank, layout, cache.spec, model, secret, client, plane, self.stats)
        self._in_flight: dict[int, Batch] = {}  # the plane's batch id -> the read
        self._read_again: list[Batch] = []
        self._poll_errors = 0  # the plane's poll raised this many turns in a row
        self._loads: dict[str, Load] = {}
        self._waiting: dict[str, KVTransferParams] = {}
        self._done = Finished()
        self._done_at: list[float] = []  # when each load in _done.receiving was finished (handoff stage)
        self._broken: str | None = None  # why loading cannot go on on this rank
        self._ready = threading.Event()  # set whenever _done gains something
        self._jobs: queue.Queue[Job] = queue.Queue()
        self._lock = threading.Lock()
        self._layer_cv = threading.Condition(self._lock)  # push: a layer landed, or a load finished
        self._outcomes: OrderedDict[str, bool] = OrderedDict()  # finished loads: ok or not (wait_layer)
        self._stop = threading.Event()
        self._turn_lock = threading.Lock()  # who holds it owns the worker's state (see the class doc)
        self._here = threading.local()  # .on: this thread is on the fast path (it takes what finishes)
        self._deferred: list[Batch] | None = None  # the turn-lock holder's: a group's reads, not yet issued
        # True: whoever calls start_load takes what the fast path finished itself (the agent's
        # command thread sends it at once), so no waiter is woken for it
        self.caller_takes_done = False
        # Called on the worker thread after a turn that finished something: True if it took it
        # (the agent sends its event from here), so no waiter is woken: a thread hand-off less
        # per load. False or raising: waiters are woken as usual.
        self.worker_takes_done: Callable[[], bool] | None = None
        plane.set_completion_callback(self._wake)
        self._worker = NamedThread(target=self._run, name=f"kvxfer-consumer-{rank}", daemon=True)
        self._worker.start()
        self.notifier = Notifier(client, rank)

    # ------------------------------------------------------------------ engine-facing
    def start_load(self, request_id: str, params: KVTransferParams, local_block_ids: Sequence[int] | np.ndarray,
                   num_cached_tokens: int = 0) -> None:
        """Check the arguments (raising, with no state change), then load in the background."""
        load = self._admit(request_id, params, local_block_ids, num_cached_tokens)
        if not self._begin_here([load]):
            self._jobs.put(BeginLoad(load))
        self._check_worker()  # a stopped worker would never begin it: fail it now

    def start_loads(self, loads: Sequence[tuple[str, KVTransferParams, Sequence[int] | np.ndarray, int]]
                    ) -> list[Exception | None]:
        """``start_load`` for each (request id, params, local block ids, cached tokens): a burst
        the caller already has (the agent: the loads queued on its channel). The ones the fast
        path takes are begun together, their reads handed to the plane in one ``read_many``
        (cma copies them in one cut). Each is checked alone: what a refused one raised is at its
        place in the returned list, None for the others."""
        refused: list[Exception | None] = []
        admitted: list[Load] = []
        for request_id, params, local_block_ids, num_cached_tokens in loads:
            try:
                admitted.append(self._admit(request_id, params, local_block_ids, num_cached_tokens))
            except Exception as e:
                refused.append(e)
            else:
                refused.append(None)
        small = [ld for ld in admitted if self._small(ld)]
        if len(small) > 1:
            self._begin_here(small)
        for ld in admitted:  # what the group did not begin: alone here if it can, else by the worker
            if not ld.began_at and not self._begin_here([ld]):
                self._jobs.put(BeginLoad(ld))
        self._check_worker()
        return refused

    def _admit(self, request_id: str, params: KVTransferParams, local_block_ids: Sequence[int] | np.ndarray,
               num_cached_tokens: int) -> Load:
        """A checked load, counted and registered (raises, with no state change, if refused)."""
        L = self.cache.spec.block_size
        ids = checked_load_ids(request_id, params, local_block_ids, num_cached_tokens, L, self.cache.num_blocks,
                               self.layout)
        with self._lock:
            if request_id in self._loads:
                raise AlreadyLoading(f"request {request_id} is already loading")
            self._waiting.pop(request_id, None)
            load = Load(request_id, params, ids, num_cached_tokens, self.clock() + self.transfer_s,
                        local_block_size=L)
            self._loads[request_id] = load
            self.stats.load_started()
        return load

    def wait(self, request_id: str, params: KVTransferParams) -> None:
        """The request waits in the decode queue: keep its producer holds alive until loaded."""
        with self._lock:
            self._waiting[request_id] = params
        self._jobs.put(RenewNow())

    def abandon(self, request_id: str, params: KVTransferParams | None, reason: str = "dropped") -> None:
        """The request will not be loaded: tell the producers to free it now. A push reservation
        ends (reported failed, its blocks invalid); its producers' next notices are refused."""
        with self._lock:
            self._waiting.pop(request_id, None)
            load = self._loads.get(request_id)
        if load is not None and load.push is not None:
            self._jobs.put(EndReservation(load, reason))
        elif params is not None:
            self._jobs.put(AbandonRequest(request_id, params, reason))  # the worker knows the peers' tokens

    def poll(self, timeout_s: float = 0.0) -> Finished:
        """What finished since the last call; with a timeout, wait (GIL released) for something."""
        self._check_worker()
        if timeout_s > 0 and not self._done:  # the fast path leaves what it finished unsignalled
            self._ready.wait(timeout_s)
        with self._lock:
            out, self._done = self._done, Finished()
            done_at, self._done_at = self._done_at, []
            self._ready.clear()
        if done_at:
            self.stats.handed_off(len(done_at), len(done_at) * time.monotonic() - math.fsum(done_at))
        return out

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait (GIL released) until something finished for ``poll`` to take, or the timeout."""
        return bool(self._done) or self._ready.wait(timeout_s)

    def wake_waiters(self) -> None:
        """Wake threads in ``wait_ready``/``poll``: the fast path's caller leaves what it finished
        unsignalled (its own thread takes it) and calls this when it cannot."""
        self._ready.set()

    @property
    def loading(self) -> bool:
        """Whether any load (or push reservation) is in flight: started, not yet finished or failed."""
        with self._lock:
            return bool(self._loads)

    @property
    def broken(self) -> str | None:
        """Why this rank cannot load any more (every load fails at once), or None."""
        with self._lock:
            return self._broken

    def close(self) -> None:
        self._stop.set()
        self._jobs.put(Stop())
        self._worker.join(timeout=10)
        self.notifier.close()

    def _wake(self) -> None:
        """The plane finished a read: wake the worker, unless this thread takes it itself."""
        if not getattr(self._here, "on", False):
            self._jobs.put(Wake())

    def _check_worker(self) -> None:
        """The engine's own guarantee that nothing hangs: if the worker thread has stopped
        (it should not: every step is supervised), fail every load it would have finished."""
        if self._worker.is_alive() or self._stop.is_set():
            return
        with self._lock:
            loads = list(self._loads.values())
            if self._broken is None:
                self._broken = "the consumer's worker thread stopped"
                logger.error("rank %d: %s; every load on this rank fails from now on", self.rank, self._broken)
        for load in loads:  # no other thread touches them now
            self._report_failed(load, ErrorCode.PLANE_BROKEN, f"cannot load: {self._broken}")

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        next_renew = self.clock() + self.lease_s / 3
        while not self._stop.is_set():
            try:
                job: Job | None = self._jobs.get(timeout=JOB_WAIT_S)
            except queue.Empty:
                job = None
            if isinstance(job, Stop):
                break
            try:
                with self._turn_lock:
                    next_renew = self._turn(job, next_renew)
            except Exception as e:  # a bug outside the guarded steps: logged, and the worker goes on
                report("consumer worker", e)
            if self.worker_takes_done is not None and self._done and not self._ready.is_set():
                self._hand_over_done()  # finished this turn, no waiter woken yet
        self.client.close_thread()

    def _hand_over_done(self) -> None:
        """Worker thread: give what this turn finished to ``worker_takes_done``, or wake the waiters."""
        taken = False
        if self.worker_takes_done is not None:
            try:
                taken = self.worker_takes_done()
            except Exception as e:
                report("consumer worker: handing over what finished", e, "(the waiters are woken instead)")
        if not taken and self._done:
            self._ready.set()

    def _turn(self, job: Job | None, next_renew: float) -> float:
        """One turn of the worker: the job, the plane's finished batches, retries, deadlines, renewals."""
        if isinstance(job, BeginLoad):
            self._begin(job.load)
        elif isinstance(job, AbandonRequest):
            self._send_abandon(job.params, job.reason)
        elif isinstance(job, PushNotice):
            self._guarded(job.load, self._on_layers_ready, job.msg)
        elif isinstance(job, EndReservation):
            if self._live(job.load):
                self._fail(job.load, ErrorCode.CANCELLED, f"reservation ended by the engine: {job.reason}")
        elif isinstance(job, RenewNow):
            next_renew = self.clock()
        elif isinstance(job, EngineCopied):
            self._engine_copied(job)
        self._poll_plane()
        self._check_broken()
        now = self.clock()
        self._issue_read_again(now)
        self._check_deadlines(now)
        if now >= next_renew:
            self._renew_waiting()
            next_renew = now + self._renew_interval()
        return next_renew

    def _poll_plane(self) -> None:
        try:
            results = self.plane.poll()
        except Exception as e:
            # what the plane finished may be lost with the exception: fail every load with a read
            # in flight (their peers are dropped first, so nothing more lands in their blocks)
            self._poll_errors += 1
            report("consumer worker: data plane poll", e)
            loads = {b.load for b in self._in_flight.values()}
            for load in loads:
                self._fail(load, code_of(e), f"the data plane's poll failed: {describe(e)} (the results of "
                           "reads in flight may be lost)")
            if self._poll_errors >= BROKEN_AFTER_POLL_ERRORS:
                self._set_broken(f"the {self.plane.name} data plane's poll raised {self._poll_errors} times in a "
                                 f"row (last: {describe(e)})")
            return
        self._poll_errors = 0
        for res in results:
            batch = self._in_flight.pop(res.batch_id, None)
            if batch is None:
                continue  # a batch of a load that already failed
            try:
                self._on_batch(batch, res)
            except Exception as e:
                report("consumer worker: batch result", e, f"request {batch.load.request_id}")
                self._fail(batch.load, code_of(e), f"handling a finished read failed: {describe(e)}")

    def _check_broken(self) -> None:
        if self.broken is None:
            try:
                why = self.plane.broken()
            except Exception as e:
                why = f"its broken() check raised {describe(e)}"
            if why is not None:
                self._set_broken(f"the {self.plane.name} data plane cannot go on: {why}")
        if self.broken is not None:
            with self._lock:
                loads = list(self._loads.values())
            for load in loads:
                self._fail(load, ErrorCode.PLANE_BROKEN, f"cannot load: {self._broken}")

    def _set_broken(self, why: str) -> None:
        with self._lock:
            if self._broken is not None:
                return
            self._broken = why
        self.stats.set_broken(why)
        logger.error("rank %d: %s; every pending and later load on this rank fails at once", self.rank, why)

    def _peer(self, engine_id: str, r: RemoteRank, params: KVTransferParams) -> Peer:
        return self.peers.get(engine_id, r)

    def _begin(self, load: Load) -> None:
        load.began_at = time.monotonic()
        if self._broken is not None:
            self._fail(load, ErrorCode.PLANE_BROKEN, f"cannot load: {self._broken}")
            return
        if self._guarded(load, self._plan_and_issue) and not load.batches:
            self._complete(load)

    def _live(self, load: Load) -> bool:
        with self._lock:
            return self._loads.get(load.request_id) is load

    def _guarded(self, load: Load, step: Callable[..., None], *args: object) -> bool:
        """Run one step of a load; an exception fails the load (with its code) and returns False.
        Handshake, plan, or the plane's connect/register/read may raise."""
        try:
            step(load, *args)
        except Exception as e:
            if isinstance(e, HandshakeError | LoadFailed):
                self._fail(load, e.code, str(e))
            elif isinstance(e, ValueError):  # the planner's refusals: shapes that do not map
                self._fail(load, ErrorCode.INCOMPATIBLE, str(e))
            else:
                report(f"consumer worker: {step.__name__}", e, f"request {load.request_id}")
                self._fail(load, code_of(e), describe(e))
            return False
        return True

    def _plan_and_issue(self, load: Load) -> None:
        params = load.source
        ranks = {r.rank: r for r in params.ranks}
        for rr, sls in self.planner.slices_by_rank(params).items():
            if rr not in ranks:
                raise LoadFailed(f"params name no address for producer rank {rr}")
            peer = self._peer(params.engine_id, ranks[rr], params)
            load.peers[rr] = peer
            batch = Batch(load, peer.peer_id, self.planner.plan_rank(load, peer, sls))
            load.batches.append(batch)
            self._issue(batch)

    def _issue(self, batch: Batch) -> None:
        """Hand a read to the data plane (raises what the plane raises; the caller fails the load)."""
        # the producer knows the request by its own id, which may differ from ours
        batch.read_again_at = None
        if not batch.load.issued_at:
            batch.load.issued_at = time.monotonic()
        if self._deferred is not None:  # a group on the fast path: read together (_issue_deferred)
            self._deferred.append(batch)
            return
        batch.batch_id = self.plane.read(batch.peer_id, batch.load.source.request_id, batch.descs)
        self._in_flight[batch.batch_id] = batch

    def _issue_read_again(self, now: float) -> None:
        if not self._read_again:
            return
        due = [b for b in self._read_again if b.read_again_at is not None and b.read_again_at <= now]
        if not due:
            return
        self._read_again = [b for b in self._read_again if b.read_again_at is not None and b.read_again_at > now]
        for batch in due:
            try:
                self._issue(batch)
            except Exception as e:
                report("consumer worker: read again", e, f"request {batch.load.request_id}")
                self._fail(batch.load, code_of(e), f"reading again failed: {describe(e)}")

    def _on_batch(self, batch: Batch, res: BatchResult) -> None:
        load = batch.load
        batch.batch_id = None
        now = self.clock()
        if not res.ok and res.code is ErrorCode.NOT_HELD and load.failure is None:
            if not load.hold_wait_until:
                load.hold_wait_until = now + self.hold_wait_s
            if now < load.hold_wait_until:  # the producer's hold may not be made yet: read again soon
                logger.debug("request %s: %s; reading again", load.request_id, res.error)
                batch.read_again_at = now + READ_AGAIN_AFTER_S
                self._read_again.append(batch)
                return
        load.batches.remove(batch)
        if not load.batches:
            load.read_at = time.monotonic()
        if not res.ok:
            if load.failure is None:
                load.failure = (res.code or ErrorCode.INTERNAL, res.error or "read failed")
            self.peers.forget(res.peer_id)  # the next load handshakes again, on a fresh connection
        elif load.failure is None:
            self._landed(load, batch)
        if not load.batches:
            if load.failure is not None:
                self._fail(load, *load.failure)
            elif load.push is None or load.push.all_issued():
                self._complete(load)

    def _check_deadlines(self, now: float) -> None:
        with self._lock:
            late = [ld for ld in self._loads.values() if ld.deadline <= now]
        for load in late:
            if load.push is None:
                why = f"not loaded within {self.transfer_s:g}s"
            elif load.params is None:
                why = f"nothing pushed within the reservation's {self.reservation_s:g}s"
            else:
                why = (f"push not finished within {self.transfer_s:g}s of the last notice (or the reservation's "
                       f"{self.reservation_s:g}s)")
            waiting = sorted({b.peer_id for b in load.batches if b.batch_id is not None})
            if waiting:  # who did not answer (their connections are dropped with the load)
                why += f"; no reply from peer {', '.join(waiting)}"
            self._fail(load, ErrorCode.TIMEOUT, why, timed_out=True)

    def _drop_batches(self, load: Load) -> None:
        """Forget a load's outstanding reads; the peers of those still in flight are dropped
        first, so that the data plane writes nothing more into blocks about to be called invalid."""
        for peer_id in {b.peer_id for b in load.batches if b.batch_id is not None}:
            self.peers.forget(peer_id)
        for b in load.batches:
            if b.batch_id is not None:
                self._in_flight.pop(b.batch_id, None)
        if any(b.read_again_at is not None for b in load.batches):
            self._read_again = [b for b in self._read_again if b.load is not load]
        load.batches.clear()

    def _complete(self, load: Load) -> None:
        params = load.source
        try:
            for plan, peer in load.staged:
                finish_staged(plan, peer.side, self.cache, load.local_blocks_full, load.skip_tokens,
                              params.num_tokens)
            if self.on_loaded is not None:
                self.on_loaded(load.invalid_blocks)
        except Exception as e:
            self._fail(load, ErrorCode.INTERNAL, f"repack failed: {describe(e)}")
            return
        self._release_staging(load)
        # reported before the done notices are queued: the notifier's wake-up would otherwise take
        # the GIL from the engine thread waiting in poll (about 0.2 ms of a 1-block load)
        finished = time.monotonic()
        with self._lock:
            # not ours to report when the engine already failed it (the worker had stopped)
            reported = self._loads.pop(load.request_id, None) is load
            if reported:
                self._done.receiving.append(load.request_id)
                self._done_at.append(finished)
                self._outcome(load.request_id, True)
                self._signal_done()
        self._notify_done(params, load.peers)
        if not reported:
            return
        # stages: queue (start_load -> worker), plan (-> first read issued), transfer (-> last read
        # back), complete (-> reported: repack, on_loaded, notices queued); a load that read
        # nothing (all prefix hits) has empty plan-to-transfer stages
        issued = load.issued_at or finished
        read = load.read_at or issued
        self.stats.load_finished(finished - load.started, load.nbytes,
                                 stages=(load.began_at - load.started, issued - load.began_at, read - issued,
                                         finished - read))
        logger.debug("request %s: loaded %d bytes in %.1f ms (started at %.6f, finished at %.6f)", load.request_id,
                     load.nbytes, (finished - load.started) * 1e3, load.started, finished)

    def _fail(self, load: Load, code: ErrorCode, why: str, timed_out: bool = False) -> None:
        """Report a load failed with its block ids (worker thread): its reads are stopped first."""
        self._drop_batches(load)
        self._release_staging(load)
        logger.warning("request %s: %s from %s failed (%s): %s", load.request_id,
                       "load" if load.push is None else "push", load.params.engine_id if load.params else "-",
                       code.value, why)
        if load.params is not None:
            self._send_abandon(load.params, why)
        self._report_failed(load, code, why, timed_out)

    def _report_failed(self, load: Load, code: ErrorCode, why: str, timed_out: bool = False) -> None:
        with self._lock:
            if self._loads.pop(load.request_id, None) is not load:
                return  # reported already
            self._done.failed[load.request_id] = load.invalid_blocks
            self._done.errors[load.request_id] = why
            self._done.codes[load.request_id] = code
            self._outcome(load.request_id, False)
            self._signal_done()
        self.stats.load_finished(time.monotonic() - load.started, error=why, timed_out=timed_out, code=code)

    def _signal_done(self) -> None:
        """Caller holds the lock: ``_done`` gained something. Waiters are woken, but not from the
        fast path: ``_begin_here`` wakes them when it ends, unless ``caller_takes_done`` (waking
        the agent's event thread would cost a hand-off of the GIL for nothing); nor from the
        worker when ``worker_takes_done`` is set: ``_run`` hands it over at the end of the turn."""
        if getattr(self._here, "on", False):
            return
        if self.worker_takes_done is not None and threading.current_thread() is self._worker:
            return
        self._ready.set()

    def _outcome(self, request_id: str, ok: bool) -> None:
        """Caller holds the lock: remember how a load ended, for ``wait_layer``."""
        self._outcomes[request_id] = ok
        while len(self._outcomes) > MAX_OUTCOMES:
            self._outcomes.popitem(last=False)
        self._layer_cv.notify_all()

    def _release_staging(self, load: Load) -> None:
        if load.staged:
            ids = [plan.region_id for plan, _ in load.staged]
            load.staged = []
            try:
                self.plane.unregister(ids)
            except Exception as e:
                report("consumer worker: unregister staging", e, f"request {load.request_id}")
