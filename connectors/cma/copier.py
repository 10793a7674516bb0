"""Copy threads for the cma plane's one-sided reads larger than a block.

A read copied on the thread that issued it keeps that thread (the consumer's fast path, or its
worker) for the whole copy: many loads in flight then copy one after another, each waiting for
the planning of the next, and one large load uses one core's copy speed. Here a read is a
``CopyJob`` handed to a few threads: the issuing thread goes on planning the next load while
this one copies, and a large read is cut into parts copied at once (one ``process_vm_readv``
per part; a single thread copies at 3.5-6 GB/s on the 2-core test machine, two at 7.5). The
GIL is released for each part's copy; a job's last part runs its ``done`` callback (the cma
plane reads the hold board's row again there and reports the batch).

``PeerCopies`` is what lets ``disconnect`` keep its promise: it returns only once no job of
that peer copies or is still to copy; a job not begun when its peer is stopped is skipped and
fails, so nothing lands in a failed load's blocks after the engine was told.

Threads: ``submit`` from any thread; jobs run on the pool's threads (``kvxfer-cma-copy-<i>``).
A job's fields after ``submit`` belong to the pool (``left`` and ``error`` under its lock).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvxfer.supervise import report

logger = logging.getLogger(__name__)

CopyFn = Callable[[int, np.ndarray, np.ndarray, int], None]  # (pid, local [n, 2], remote [n, 2], nbytes)


class PeerCopies:
    """The jobs of one peer submitted and not yet done; ``stop`` refuses more and waits for them."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._active = 0
        self.stopped = False

    def enter(self) -> bool:
        with self._cv:
            if self.stopped:
                return False
            self._active += 1
            return True

    def leave(self) -> None:
        with self._cv:
            self._active -= 1
            if self._active == 0:
                self._cv.notify_all()

    def stop(self, timeout_s: float) -> bool:
        """No job of this peer starts copying after this; True once none is in progress (False:
        ``timeout_s`` passed first, which a copy of memory does not take)."""
        with self._cv:
            self.stopped = True
            return self._cv.wait_for(lambda: self._active == 0, timeout_s)


@dataclass(eq=False)
class CopyJob:
    """One read: pieces ``local[i]`` <- ``remote[i]`` of process ``pid``, cut into ``bounds``
    (piece index ranges, one per part); ``done(error)`` runs once, on the thread of the last part."""

    pid: int
    local: np.ndarray  # [n, 2] int64: address, length
    remote: np.ndarray
    sizes: np.ndarray  # bytes of each part
    bounds: list[tuple[int, int]]
    peer: PeerCopies
    done: Callable[[BaseException | None], None]
    left: int = 0
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


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


class CopyPool:
    """A few threads that copy jobs' parts (see the module docstring)."""

    def __init__(self, threads: int, copy: CopyFn, name: str = "kvxfer-cma-copy") -> None:
        if threads < 1:
            raise ValueError(f"a copy pool needs at least one thread, got {threads}")
        self.threads = threads
        self._copy = copy
        self._parts: queue.SimpleQueue[tuple[CopyJob, int] | None] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._workers = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._workers:
            t.start()

    def submit(self, job: CopyJob) -> None:
        """Queue a job's parts; ConnectionError (nothing queued) if its peer is stopped or the pool closed."""
        with self._lock:  # not between close's check and its stop markers: every part queued is taken
            if self._closed:
                raise ConnectionError("the plane is closed")
            if not job.peer.enter():
                raise ConnectionError("disconnected")
            job.left = len(job.bounds)
            for i in range(len(job.bounds)):
                self._parts.put((job, i))

    def alive(self) -> bool:
        return all(t.is_alive() for t in self._workers)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the threads; parts still queued fail (the plane is closed) instead of copying."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._workers:
                self._parts.put(None)
        for t in self._workers:
            t.join(timeout_s)

    def _run(self) -> None:
        while (item := self._parts.get()) is not None:
            job, i = item
            error: BaseException | None = None
            try:
                if self._closed:
                    raise ConnectionError("the plane is closed")
                if job.peer.stopped:
                    raise ConnectionError("disconnected")
                if job.error is None:  # a part that failed already fails the job: copy no more of it
                    a, b = job.bounds[i]
                    self._copy(job.pid, job.local[a:b], job.remote[a:b], int(job.sizes[i]))
            except Exception as e:
                error = e
            self._part_done(job, error)

    @staticmethod
    def _part_done(job: CopyJob, error: BaseException | None) -> None:
        with job.lock:
            if error is not None and job.error is None:
                job.error = error
            job.left -= 1
            last = job.left == 0
        if not last:
            return
        try:
            job.done(job.error)
        except Exception as e:  # a bug in the callback: logged; the peer's count still drops
            report("cma copies", e, "a finished copy's report")
        finally:
            job.peer.leave()
