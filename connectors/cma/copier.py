"""Helper threads that copy parts of one cma read beside the thread that reads.

One ``process_vm_readv`` copies at one core's speed: 3.5-6 GB/s on the 2-core test machine,
against about 7.5 with two threads on two halves. So a read larger than ``inline_copy_bytes``
is cut into parts (``cut``) and the reading thread offers them to a few helper threads. It
does not hand the read over: it takes parts itself, one at a time, until none is left, and
then waits only for the parts a helper is copying at that moment. A helper that does not get
a core in time (the engine's cores are busy) finds nothing left to take, and the read costs
what it cost on one thread; the read is still done when ``copy`` returns, on the reading
thread, so a plane's promises (a load done when ``read`` returns, ``disconnect`` waiting for
the copy under the plane's lock) hold as before. Handing whole reads to other threads measured
faster on an idle machine and 1.5-2x slower in a vLLM pair whose servers keep both cores busy:
every hand-off then waits for a core.

Threads: ``copy`` on the reading thread (several may call it); helpers ``kvxfer-cma-copy-<i>``
take parts of the reads offered. A ``SplitCopy``'s counters are under its lock.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable

import numpy as np

from kvxfer.threads import NamedThread

logger = logging.getLogger(__name__)

CopyFn = Callable[[int, np.ndarray, np.ndarray, int], None]  # (pid, local [n, 2], remote [n, 2], nbytes)


def cut(lengths: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """Piece index ranges of about equal bytes, at most ``parts`` of them, none empty."""
    n = len(lengths)
    parts = max(1, min(parts, n))
    if parts == 1:
        return [(0, n)]
    ends = np.cumsum(lengths)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, parts) / parts, side="left") + 1
    edges = np.unique(np.concatenate(([0], np.minimum(cuts, n), [n])))
    return [(int(a), int(b)) for a, b in itertools.pairwise(edges)]


class SplitCopy:
    """One read's parts: pieces ``local[i]`` <- ``remote[i]`` of process ``pid`` in ranges
    ``bounds``; taken one at a time by the reading thread and any helper."""

    def __init__(self, pid: int, local: np.ndarray, remote: np.ndarray, bounds: list[tuple[int, int]],
                 copy: CopyFn) -> None:
        self.pid = pid
        self.local = local
        self.remote = remote
        self.bounds = bounds
        self.sizes = [int(local[a:b, 1].sum()) for a, b in bounds]
        self._copy = copy
        self._cv = threading.Condition()
        self._next = 0  # the next part to take
        self._running = 0  # parts being copied now
        self.error: BaseException | None = None  # the first part that failed; no part is taken after it

    def work(self) -> None:
        """Copy parts until none is left to take (or one failed)."""
        while True:
            with self._cv:
                if self.error is not None or self._next == len(self.bounds):
                    return
                i = self._next
                self._next += 1
                self._running += 1
            error: BaseException | None = None
            try:
                a, b = self.bounds[i]
                self._copy(self.pid, self.local[a:b], self.remote[a:b], self.sizes[i])
            except BaseException as e:
                error = e
            with self._cv:
                self._running -= 1
                if error is not None and self.error is None:
                    self.error = error
                self._cv.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """True once every part taken is copied (call after ``work``); False: ``timeout_s`` passed."""
        with self._cv:
            return self._cv.wait_for(lambda: self._running == 0, timeout_s)


class CopyHelpers:
    """``threads`` helper threads for ``SplitCopy`` reads (see the module docstring)."""

    def __init__(self, threads: int, copy: CopyFn, name: str = "kvxfer-cma-copy") -> None:
        if threads < 1:
            raise ValueError(f"copy helpers need at least one thread, got {threads}")
        self.threads = threads
        self._copy = copy
        self._offers: queue.SimpleQueue[SplitCopy | None] = queue.SimpleQueue()
        self._closed = False
        self._workers = [NamedThread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._workers:
            t.start()

    def copy(self, pid: int, local: np.ndarray, remote: np.ndarray, bounds: list[tuple[int, int]],
             timeout_s: float) -> None:
        """Copy every part, here and on idle helpers; returns once all are copied. Raises the
        first part's error (after every part taken is done), or TimeoutError."""
        job = SplitCopy(pid, local, remote, bounds, self._copy)
        if not self._closed:
            for _ in range(min(self.threads, len(bounds) - 1)):
                self._offers.put(job)
        job.work()
        if not job.wait(timeout_s):  # a memory copy does not take this long: a helper stopped (SIGSTOP, swap)
            logger.error("cma: a copy helper still copies %g s after its read began; the read fails", timeout_s)
            raise TimeoutError(f"a copy helper did not finish its part within {timeout_s:g} s")
        if job.error is not None:
            raise job.error

    def close(self, timeout_s: float = 5.0) -> None:
        self._closed = True
        for _ in self._workers:
            self._offers.put(None)
        for t in self._workers:
            t.join(timeout_s)

    def _run(self) -> None:
        while (job := self._offers.get()) is not None:
            job.work()  # errors are the job's: its reading thread raises them
