"""Supervision of kvxfer's loops: an exception fails what it touched, is logged once, and the loop goes on.

Every thread kvxfer starts (consumer worker, notifier, side-channel server, each data plane's
loops, the ucx event loop) catches what escapes one iteration and hands it to :func:`report`,
which logs it with its traceback the first time that kind of error is seen in that loop (later
ones at debug level, so a loop that meets the same error on every turn cannot flood the log)
and counts it. The counts are process-wide and appear in every connector's stats as
``loop_errors``.

:func:`code_of` turns an exception into the :class:`~kvxfer.protocol.ErrorCode` a failed
load or read carries, so nothing downstream parses exception text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from kvxfer.protocol import ErrorCode

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_seen: set[tuple[str, str, str]] = set()
_counts: Counter[str] = Counter()
_MAX_SEEN = 4096  # distinct (loop, type, message) keys remembered for "log once"


def report(loop: str, exc: BaseException, touched: str = "") -> None:
    """An exception escaped one iteration of ``loop``: count it, log it once with its traceback."""
    key = (loop, type(exc).__name__, str(exc)[:200])
    with _lock:
        _counts[loop] += 1
        first = key not in _seen
        if first and len(_seen) < _MAX_SEEN:
            _seen.add(key)
    what = f" ({touched})" if touched else ""
    if first:
        logger.error("kvxfer loop %s: %s: %s%s; the loop goes on", loop, type(exc).__name__, exc, what,
                     exc_info=(type(exc), exc, exc.__traceback__))
    else:
        logger.debug("kvxfer loop %s: %s again: %s%s", loop, type(exc).__name__, exc, what)


def supervised_loop(loop: str, step: Callable[[], None], stopped: Callable[[], bool], pause_s: float = 0.01) -> None:
    """Run ``step`` until ``stopped()``: an exception from one step is reported (see :func:`report`)
    and, after ``pause_s`` (so that a step failing at once cannot spin a core), the loop goes on."""
    while not stopped():
        try:
            step()
        except Exception as e:
            if stopped():
                break
            report(loop, e)
            time.sleep(pause_s)


def loop_errors() -> int:
    """Exceptions caught at the top of kvxfer's loops in this process so far."""
    with _lock:
        return sum(_counts.values())


def loop_error_counts() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def describe(exc: BaseException) -> str:
    """``TypeName: message``, the way failures name the exception that caused them."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def code_of(exc: BaseException) -> ErrorCode:
    """The error code a load or read failed by ``exc`` reports."""
    code = getattr(exc, "code", None)
    if isinstance(code, ErrorCode):
        return code
    if isinstance(exc, TimeoutError | asyncio.TimeoutError | concurrent.futures.TimeoutError):  # three types on 3.10
        return ErrorCode.TIMEOUT
    if isinstance(exc, asyncio.CancelledError):
        return ErrorCode.CANCELLED
    if isinstance(exc, OSError):  # ConnectionError included
        return ErrorCode.PEER_LOST
    return ErrorCode.INTERNAL
