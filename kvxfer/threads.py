"""Threads that carry their name into the kernel, so `top -H`, `perf sched` and `/proc` show it.

Why: every kvxfer thread is "python3" to the kernel otherwise, and a scheduling trace of a
vLLM pair (two engines, two agents, a dozen threads each) cannot say which one waited. Linux
keeps 15 bytes of a thread's name; a longer name is cut, and a platform without the call keeps
the process's name (naming is a diagnostic, never a failure).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from typing import Any

logger = logging.getLogger(__name__)

_PR_SET_NAME = 15
_PR_SET_TIMERSLACK = 29
_libc: Any = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # a libc ctypes cannot open: threads keep the process's name
        _libc = None


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` (its first 15 bytes) in the kernel."""
    if _libc is not None:
        _libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def set_timer_slack(ns: int) -> None:
    """Let the calling thread's timed sleeps end at most ``ns`` late (Linux's default: 50 us),
    for a thread that naps for tens of microseconds between polls."""
    if _libc is not None:
        _libc.prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0)


def name_native_thread(tid: int, name: str) -> None:
    """Name a thread this process did not start from Python (a native library's, by its tid)."""
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(name[:15])
    except OSError as e:
        logger.debug("naming thread %d %r: %s", tid, name, e)


def task_ids() -> set[int]:
    """The kernel ids of this process's threads (to find one a native library just started)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


class NamedThread(threading.Thread):
    """A ``threading.Thread`` whose name the kernel also knows (set as it starts running)."""

    def run(self) -> None:
        name_this_thread(self.name)
        super().run()
