"""The process's UCX runtime: one ucxx worker, its event loop and thread, and its progress.

Kept apart from the plane because it is shared: every ucx plane of a process submits its
coroutines to this one loop, and the loop progresses the main worker and every plane's
receive worker (see the package docstring for why kvxfer progresses them itself).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from kvxfer.supervise import report
from kvxfer.threads import NamedThread, name_native_thread, set_timer_slack, task_ids

from .rma_progress import AdaptiveRmaProgress

logger = logging.getLogger(__name__)


def close_now(ep: Any) -> None:
    """Close a ucxx endpoint without waiting for its peer (loop thread).

    ucxx's ``Endpoint.abort()``, with error handling off, closes in flush mode and, with no
    progress thread, progresses the worker until the flush completes, whatever its time
    limit: to a stopped (SIGSTOP) peer that is forever, on the thread that runs every
    transfer (seen in the stall test). The low-level close submits the close and returns, and
    marks the endpoint closing, so ucxx's finalizer does not wait either.
    """
    raw, ep._ep, ep._ctx = ep._ep, None, None
    if raw is None:
        return
    try:
        raw.close()
        raw.remove_close_callback()
    except Exception as e:  # already closed by UCX
        logger.debug("ucx endpoint close: %s", e)


IDLE_TICK_S = 0.005
# While a transfer is in flight and a pass over the workers found nothing, the loop thread naps
# this long (its timer slack SPIN_SLACK_NS) instead of calling sched_yield: on an EEVDF kernel
# (Linux 6.6+) each yield pushes the thread's deadline back by a slice, and a thread that yields
# in a loop then runs after every other runnable thread (a probe beside two busy processes on its
# core: one turn per 4 ms yielding, one per 115 us napping 50 us; docs/benchmarks.md, session 19).
SPIN_NAP_S = 20e-6
SPIN_SLACK_NS = 5000
# An RMA worker's native progress thread sleeps in epoll at most this long. ucxx's blocking
# progress can miss a wakeup, then sleep until UCX's keepalive round (20 s here) wakes it
# (rapidsai/ucxx#15 "Wakeup may hang for 20 seconds", #68: ucxx's own async default is 1 ms).
# Once in CI a consumer's first connect waited out its 20 s deadline wiring up to a fresh RMA
# worker. Idle, 5 ms costs 0.008 of a core per consumer here (0.18 with 64); it bounds a
# missed wakeup at 5 ms, the main worker's idle tick.
RMA_EPOLL_TIMEOUT_MS = 5


def _own_progress(loop: asyncio.AbstractEventLoop) -> bool:
    """Keep ucxx from starting its own progress task on ``loop`` (it would on the first
    endpoint): kvxfer progresses the worker itself. False where this ucxx has no such hook."""
    try:
        from ucxx._lib_async import application_context
        from ucxx._lib_async.continuous_ucx_progress import ProgressTask

        tasks = application_context.ProgressTasks
    except (ImportError, AttributeError):
        logger.warning("ucx: this ucxx has no ProgressTasks; using its blocking progress (an idle worker with "
                       "shared-memory endpoints may spin a core)")
        return False
    tasks[loop] = ProgressTask(None, loop)
    return True


class UcxRuntime:
    """The process's UCX worker, progressed on one event loop in one thread."""

    _instance: UcxRuntime | None = None
    _lock = threading.Lock()

    def __init__(self, progress_mode: str, tls: str | None) -> None:
        if tls:
            os.environ.setdefault("UCX_TLS", tls)
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        import ucxx  # the optional extra: imported only when a ucx plane is made

        self.ucxx = ucxx
        self.progress_mode = progress_mode
        self.transfers = 0  # in flight; set before the loop thread's idle tick reads it
        self._spinner: asyncio.Future[None] | None = None
        self.own_progress = False  # whether kvxfer progresses the main worker (else ucxx's own task does)
        self._main_worker: Any = None  # ucxx's worker for this process, set by the loop thread at start
        self.receive_workers: set[Any] = set()  # the planes' receive workers, progressed by _tick and _spin
        self._retired: list[Any] = []  # receive workers no longer progressed, kept until their reads unwound
        # serving other processes' one-sided reads: worker -> progressed adaptively (new_rma_worker; _lock)
        self._rma_workers: dict[Any, bool] = {}
        self._adaptive: AdaptiveRmaProgress | None = None  # made for the first adaptive RMA worker (_lock)
        atexit.register(self._stop_rma_workers)
        self.loop = asyncio.new_event_loop()
        ready: Future[None] = Future()
        self.thread = NamedThread(target=self._run, args=(ready,), name="kvxfer-ucx", daemon=True)
        self.thread.start()
        ready.result(timeout=30)
        self.plane_ids = itertools.count(1)

    def _run(self, ready: Future[None]) -> None:
        asyncio.set_event_loop(self.loop)
        set_timer_slack(SPIN_SLACK_NS)
        try:
            self.ucxx.init(progress_mode=self.progress_mode)
            self._main_worker = self.ucxx.core._get_ctx().worker  # sends, two-sided reads' control
            self.own_progress = self.progress_mode == "blocking" and _own_progress(self.loop)
            if not self.own_progress:
                self.ucxx.continuous_ucx_progress(event_loop=self.loop)
            self.loop.create_task(self._tick())
            self.address = bytes(self.ucxx.get_worker_address())
        except Exception as e:
            ready.set_exception(e)
            return
        ready.set_result(None)
        self.loop.run_forever()

    @classmethod
    def get(cls, progress_mode: str, tls: str | None) -> UcxRuntime:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls(progress_mode, tls)
            elif cls._instance.progress_mode != progress_mode:
                raise ValueError(f"connector.data_plane.progress_mode: this process already runs UCX in "
                                 f"{cls._instance.progress_mode!r} mode, got {progress_mode!r}")
            return cls._instance

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def new_receive_worker(self) -> Any:
        """A UCX worker of its own, on the process's UCX context, for one plane's reads (loop thread).

        Why: a producer killed while writing into a worker's shared-memory FIFO can leave a
        slot claimed and never filled, and every later sender to that worker then waits
        behind it. A plane that loses a peer mid-read swaps its receive worker for a fresh
        one (UcxDataPlane._renew_receiver); the process's main worker, which sends,
        is not touched. It is an ApplicationContext without its own UCX context, notifier
        thread or progress task, because ucxx's endpoints insist on one; kvxfer progresses it.
        """
        from ucxx._lib import libucxx
        from ucxx._lib_async.application_context import ApplicationContext

        main = self.ucxx.core._get_ctx()
        ctx = ApplicationContext.__new__(ApplicationContext)
        ctx.notifier_thread_q = ctx.notifier_thread = None
        ctx.progress_mode = self.progress_mode
        ctx.enable_delayed_submission = False
        ctx.enable_python_future = False
        ctx.connect_timeout = main.connect_timeout
        ctx.context = main.context
        ctx.worker = libucxx.UCXWorker(main.context, enable_delayed_submission=False, enable_python_future=False)
        self.receive_workers.add(ctx.worker)
        return ctx

    def _context(self) -> Any:
        return self.ucxx.core._get_ctx().context  # the process's UCXContext, which ucxx made at init

    @property
    def context_handle(self) -> int:
        """The process's ``ucp_context_h`` (regions are mapped for one-sided reads on it)."""
        return int(self._context().handle)

    def new_rma_worker(self, adaptive: bool = False) -> Any:
        """A worker that serves one consumer's one-sided reads of this process's memory: its own,
        so a get that UCX emulates (no RDMA, no CMA) is answered without the plane's loop. One per
        consumer, because a consumer killed while writing a get into a worker's shared-memory FIFO
        leaves a slot claimed and never filled, and every later get to that worker waits behind
        it (tests/test_faults.py's kill case).

        Progressed by ucxx's native thread in blocking mode (no GIL needed: for an engine's own
        process), waking every RMA_EPOLL_TIMEOUT_MS at rest; or, ``adaptive`` (a transfer agent,
        whose Python is kvxfer's), by the process's AdaptiveRmaProgress thread, which polls for
        RMA_HOT_S after each event instead of sleeping between FIFO refills (rma_progress.py says
        why). tests/test_ucx_rma.py measures both at rest."""
        from ucxx._lib import libucxx

        worker = libucxx.UCXWorker(self._context(), enable_delayed_submission=False, enable_python_future=False)
        if adaptive:
            with self._lock:
                if self._adaptive is None:
                    self._adaptive = AdaptiveRmaProgress(wake_s=RMA_EPOLL_TIMEOUT_MS / 1000)
                progress = self._adaptive
            progress.add(worker)
        else:
            before = task_ids()
            worker.start_progress_thread(polling_mode=False, epoll_timeout=RMA_EPOLL_TIMEOUT_MS)
            started = task_ids() - before
            if len(started) == 1:  # ucxx's thread, named for traces (another thread starting meanwhile: left)
                name_native_thread(started.pop(), "kvxfer-rma-nat")
        with self._lock:
            self._rma_workers[worker] = adaptive
        return worker

    def stop_rma_worker(self, worker: Any) -> None:
        """Stop serving gets on ``worker`` (its consumer is gone or has a new one); UCX frees it
        once the last reference goes. A get its consumer sends later is never answered: that
        consumer's flush fails at its deadline, and it says hello again."""
        with self._lock:
            if worker not in self._rma_workers:
                return
            adaptive = self._rma_workers.pop(worker)
            progress = self._adaptive
        try:
            if adaptive:
                if progress is not None:
                    progress.remove(worker)
            else:
                worker.stop_progress_thread()
        except Exception as e:
            logger.debug("ucx: stopping an RMA worker: %s", e)

    def _stop_rma_workers(self) -> None:  # at exit: no progress thread may outlive the interpreter's UCX
        with self._lock:
            workers = list(self._rma_workers)
        for worker in workers:
            self.stop_rma_worker(worker)
        with self._lock:
            progress, self._adaptive = self._adaptive, None
        if progress is not None:
            progress.stop()

    def retire_receive_worker(self, ctx: Any, endpoints: list[Any], keep_s: float,
                              on_free: Callable[[], None] | None = None) -> None:
        """Stop progressing a receive worker for good and close its endpoints (loop thread).

        Why stop at once: with shared memory and tcp a reply's bytes land only while the
        receiving worker is progressed, so once this returns nothing a late or half-dead
        producer still sends can reach blocks given back afterwards (RDMA puts from the
        sender are the exception: docs/security.md). The worker is freed ``keep_s`` later, once
        the reads cancelled on it have unwound (``on_free`` runs then: what those reads still used).
        """
        self.receive_workers.discard(ctx.worker)
        for ep in endpoints:
            close_now(ep)
        try:
            ctx.worker.cancel_inflight_requests(period=0, max_attempts=1)
        except Exception as e:
            logger.debug("ucx: cancelling requests on a retired receive worker: %s", e)
        self._retired.append(ctx)
        self.loop.call_later(keep_s, self._free_retired, ctx, on_free)

    def _free_retired(self, ctx: Any, on_free: Callable[[], None] | None) -> None:
        try:
            if on_free is not None:  # before the worker goes: a remote key returns to its worker's pool
                on_free()
        finally:
            self._retired.remove(ctx)

    @contextlib.asynccontextmanager
    async def active(self) -> AsyncIterator[None]:
        """Progress the worker continuously while a transfer is in flight (loop thread only).

        Blocking progress waits for worker events between calls; large shared-memory
        rendezvous transfers then crawl (512 MiB: 3.3 GB/s against 9.6 with continuous
        progress). Idle, the worker is progressed every IDLE_TICK_S (see _tick). While bytes
        come in, the loop polls without pause; a pass that finds nothing naps SPIN_NAP_S, so a
        busy engine's thread and the other side's loop get the core on a host with few cores.
        """
        self.transfers += 1
        if self.transfers == 1:
            self._spinner = asyncio.ensure_future(self._spin())
        try:
            yield
        finally:
            self.transfers -= 1

    async def _tick(self) -> None:
        """Idle progress: every IDLE_TICK_S, for what arrives outside a transfer (endpoint
        wire-up). ucxx's own blocking mode re-arms the worker's event fd, but once a
        shared-memory endpoint exists the arm keeps failing and its loop spins a core for as
        long as the process lives (measured: 100% of a core on both sides after one load)."""
        while True:
            if self.transfers == 0:
                self._progress()
            await asyncio.sleep(IDLE_TICK_S)

    async def _spin(self) -> None:
        while self.transfers > 0:
            if not self._progress():
                time.sleep(SPIN_NAP_S)  # nothing came: the core to others for a moment
            await asyncio.sleep(0)

    def _progress(self) -> bool:
        """Progress every worker; whether any had anything. Supervised: a worker
        whose progress raises is reported and progressed again on the next turn (the transfers
        on it fail at their deadlines)."""
        busy = False
        try:
            if self.own_progress:
                main = self._main_worker
                if main.progress_once():
                    busy = True
                    main.progress()
        except Exception as e:
            report("ucx progress", e, "the main worker")
        for worker in tuple(self.receive_workers):
            try:
                if worker.progress_once():
                    busy = True
                    worker.progress()
            except Exception as e:
                report("ucx progress", e, "a receive worker")
        return busy

    def broken(self) -> str | None:
        """Why the runtime cannot go on: its event-loop thread stopped (or the loop closed)."""
        if not self.thread.is_alive() or self.loop.is_closed():
            return "the UCX event-loop thread stopped"
        return None
