"""Progress for RMA workers in a process whose Python is kvxfer's own (a transfer agent).

Why not ucxx's native progress thread there: in blocking mode it sleeps in epoll as soon as a
worker has nothing to do, and a get that UCX emulates over shared memory (no RDMA, no CMA)
goes through a bounded FIFO: the producer's worker fills it, waits for the consumer to drain
it, and sleeps. Each refill is then a thread wake-up, and on a virtual machine whose other
vCPU is idle (halted) a wake-up costs a VM exit: 16 MiB took 10-13 ms p50 with both CPUs
idle, 2 ms with both busy (docs/benchmarks.md, session 18). Polling mode would fix that at
a core per worker for ever (what NixlConnector's progress thread costs: 1.6-1.7 cores for a
vLLM pair at rest). Here one thread serves every RMA worker of the process: it polls while
they make progress and for ``hot_s`` after the last event, then arms them and sleeps in
``select`` on their event fds, at most ``wake_s`` (ucxx's blocking progress can miss a wake-up;
see runtime.RMA_EPOLL_TIMEOUT_MS); at rest the thread wakes every ``wake_s``. Measured
(benchmarks/rma_progress.py, reads spaced 50 ms): beside busy CPUs 16 MiB took 2.5 ms p50
against 4.9 native; with the CPUs idle 13 ms either way (not cured: see docs/benchmarks.md).

It needs this process's GIL for each pass, so it is for agents, whose only Python is kvxfer's.
In an engine's process (``data_path: engine``) the plane keeps ucxx's native thread, which
needs no GIL. Threads: ``add`` and ``remove`` from any thread; the worker set is under
``_lock``, which a pass holds, so a removed worker is never progressed after ``remove`` returns.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import Any

from kvxfer.supervise import report
from kvxfer.threads import NamedThread

logger = logging.getLogger(__name__)

RMA_HOT_S = 0.001  # polling after the last event: a FIFO refill within it costs no wake-up


class AdaptiveRmaProgress:
    """One thread progressing a process's RMA workers: poll while hot, sleep in epoll when not."""

    def __init__(self, hot_s: float = RMA_HOT_S, wake_s: float = 0.005) -> None:
        self.hot_s = hot_s
        self.wake_s = wake_s
        self._lock = threading.Lock()
        self._workers: dict[Any, int] = {}  # worker -> its epoll fd (_lock)
        self._stop = False
        self._wake_r, self._wake_w = os.pipe()  # add/remove/stop end a sleep at once
        os.set_blocking(self._wake_w, False)
        self.thread = NamedThread(target=self._run, name="kvxfer-ucx-rma", daemon=True)
        self.thread.start()
        logger.debug("ucx: RMA workers progressed by thread %s, polling %g ms after each event", self.thread.name,
                     hot_s * 1e3)

    def add(self, worker: Any) -> None:
        worker.init_blocking_progress_mode()
        with self._lock:
            self._workers[worker] = worker.epoll_file_descriptor
        self._wake()

    def remove(self, worker: Any) -> None:
        with self._lock:  # a pass in progress ends first
            self._workers.pop(worker, None)
        self._wake()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._workers.clear()
        self._wake()
        self.thread.join(timeout=5)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:  # a wake-up is pending already
            pass

    def _run(self) -> None:
        last = time.monotonic()
        unarmed = 0  # passes in a row that found a worker it could not arm, and nothing to progress
        while True:
            try:
                with self._lock:
                    if self._stop:
                        return
                    busy = sum(bool(w.progress_once()) for w in self._workers)
                now = time.monotonic()
                if busy:
                    last, unarmed = now, 0
                    continue
                if now - last < self.hot_s:
                    continue
                with self._lock:  # armed: an event after this wakes the select
                    armed = all([w.arm() for w in self._workers])
                    fds = list(self._workers.values())
                unarmed = 0 if armed else unarmed + 1
                if unarmed == 1:
                    continue  # events came since the pass: progress them at once
                # a worker that stays unarmable (a FIFO slot a killed consumer claimed and never
                # filled) gets short naps, not a spin; with no worker, sleep until one comes
                timeout = (self.wake_s if fds else None) if armed else self.hot_s
                try:
                    ready, _, _ = select.select([self._wake_r, *fds], [], [], timeout)
                except OSError:  # a worker removed meanwhile closed its fd: the next pass goes without it
                    continue
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                if ready:  # an event: poll hot again (a timed-out sleep stays cold)
                    last = time.monotonic()
            except Exception as e:  # supervised: reported, and the next pass goes on
                report("ucx rma progress", e, "the RMA workers' progress thread")
                time.sleep(self.wake_s)


__all__ = ["RMA_HOT_S", "AdaptiveRmaProgress"]
