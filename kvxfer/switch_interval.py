"""A shorter interpreter switch interval while a rank's loads are in flight, and a shorter one
still while ``poll(timeout_s)`` waits for one of them.

With a transfer agent no byte needs the engine's GIL, but seeing a load finish does: the engine's
thread that reads the agent's event, woken in ``select`` with the GIL released (``poll(timeout_s)``)
or taking turns with the engine's other busy Python threads (``poll()`` in a loop), waits for
CPython to hand it the GIL. CPython asks a running thread to let the GIL go only after a waiting
one has waited a whole switch interval (``sys.getswitchinterval()``, 5 ms by default): beside one
spinning Python thread, a 3 ms load reached ``poll`` 4-7 ms after the agent sent it. While a connector has
loads in flight, kvxfer sets the interval to ``connector.gil_switch_interval_s`` (0.5 ms by
default). While a ``poll(timeout_s)`` of such a connector waits in ``select`` it is
``connector.gil_wait_switch_interval_s`` (50 us by default): the waiting thread runs no Python
meanwhile, so only the engine's other threads switch that often, and only for the wait, and the
woken thread has the GIL 50 us after it asks, not 0.5 ms (session 37: a busy consumer's hand-off
of a tcp load 540-670 us against 950-1400). The engine's own value comes back when no connector of
the process claims either.

The interval is one value per process: kvxfer counts the claims (loads in flight; waits), sets the
shortest claimed (never longer than the engine's own value) and puts the engine's value back after
the last; if the engine set another value meanwhile, that one is the engine's value from then on:
the next change of claims shortens it again if a claim is shorter, and after the last claim it is
left as it is (kvxfer never puts back over a value it did not set; a value the engine sets equal
to kvxfer's cannot be told apart from it). A shorter interval costs only when two or
more Python threads want to run at once (each of them then runs at most that long before the next
has its turn).

Threads: any; one lock guards the counts and the values.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_holders = 0  # connectors with loads in flight (want(True))
_short: float | None = None  # the interval the first of them claimed
_waiters = 0  # polls waiting for a load in flight (waiting())
_wait: float | None = None  # the interval the first of them claimed
_saved: float | None = None  # the engine's own value, while kvxfer has set another
_ours: float | None = None  # the value kvxfer set, while it is set


def _apply_locked() -> None:
    """Set the shortest claimed interval, or the engine's own value when nothing claims one."""
    global _saved, _ours
    current = sys.getswitchinterval()
    if _ours is None or current != _ours:  # not kvxfer's: the engine's own value, from now on
        if _ours is not None:
            logger.debug("the engine set the switch interval to %g s meanwhile: its own from now on", current)
        _saved, _ours = current, None
    assert _saved is not None
    claims = [v for n, v in ((_holders, _short), (_waiters, _wait)) if n and v]
    target = min(claims, default=_saved)
    if target >= _saved:  # nothing claimed, or nothing shorter than the engine's own
        if _ours is not None:
            sys.setswitchinterval(_saved)
        _saved = _ours = None
        return
    if target != current:
        sys.setswitchinterval(target)
    _ours = sys.getswitchinterval()  # as CPython rounded it


class SwitchInterval:
    """One connector's claims on a short switch interval: ``want(True)`` while it has loads in
    flight, ``want(False)`` when it has none (idempotent); ``waiting()`` around a ``poll`` that
    waits for one of them; ``close()`` gives them up for good (a ``want(True)`` from a late
    ``poll`` then changes nothing). The first claim's interval of each kind serves every connector
    of the process until the last one of that kind lets go."""

    def __init__(self, interval_s: float, wait_s: float = 0.0) -> None:
        if interval_s < 0:
            raise ValueError(f"gil_switch_interval_s: expected 0 (off) or a positive number, got {interval_s}")
        if wait_s < 0:
            raise ValueError(f"gil_wait_switch_interval_s: expected 0 (off) or a positive number, got {wait_s}")
        self.interval_s = interval_s
        self.wait_s = wait_s
        self.held = False
        self.closed = False

    def close(self) -> None:
        with _lock:
            self.closed = True
        self.want(False)

    def want(self, short: bool) -> None:
        global _holders, _short
        if not self.interval_s:
            return
        with _lock:
            short = short and not self.closed
            if short == self.held:
                return
            self.held = short
            _holders += 1 if short else -1
            if short and _holders == 1:
                _short = self.interval_s
            _apply_locked()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait (GIL released) for this connector's loads in flight: the wait's interval
        meanwhile. Without loads in flight (a prefill waiting for its holds to end), or off
        (``wait_s`` 0, or ``interval_s`` 0: kvxfer never touches the interval), it changes nothing."""
        global _waiters, _wait
        with _lock:
            claim = bool(self.wait_s) and self.held and not self.closed
            if claim:
                _waiters += 1
                if _waiters == 1:
                    _wait = self.wait_s
                _apply_locked()
        try:
            yield
        finally:
            if claim:
                with _lock:
                    _waiters -= 1
                    _apply_locked()
