"""A shorter interpreter switch interval while a rank's loads are in flight.

With a transfer agent no byte needs the engine's GIL, but seeing a load finish does: the engine's
thread that reads the agent's event, woken in ``select`` with the GIL released (``poll(timeout_s)``)
or taking turns with the engine's other busy Python threads (``poll()`` in a loop), waits for
CPython to hand it the GIL. CPython asks a running thread to let the GIL go only after a waiting
one has waited a whole switch interval (``sys.getswitchinterval()``, 5 ms by default): beside one
spinning Python thread, a 3 ms load reached ``poll`` 4-7 ms after the agent sent it. While a connector has
loads in flight, kvxfer sets the interval to ``connector.gil_switch_interval_s`` (0.5 ms by
default), and puts the engine's own value back when no connector of the process has any left.

The interval is one value per process: kvxfer counts the connectors that want it short, saves the
value it found when the first one does and restores it after the last; if the engine set another
value meanwhile, that one is left as it is (kvxfer never overrides a value it did not set). A
shorter interval costs only when two or more Python threads want to run at once (each of them
then runs at most that long before the next has its turn).

Threads: any; one lock guards the count.
"""

from __future__ import annotations

import logging
import sys
import threading

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_holders = 0
_saved: float | None = None  # the interval found when the first holder came
_ours: float | None = None  # the interval kvxfer set, while it is set


class SwitchInterval:
    """One connector's claim on a short switch interval: ``want(True)`` while it has loads in
    flight, ``want(False)`` when it has none (idempotent); ``close()`` gives it up for good (a
    ``want(True)`` from a late ``poll`` then changes nothing). The first claim's interval serves
    every connector of the process until the last one lets go."""

    def __init__(self, interval_s: float) -> None:
        if interval_s < 0:
            raise ValueError(f"gil_switch_interval_s: expected 0 (off) or a positive number, got {interval_s}")
        self.interval_s = interval_s
        self.held = False
        self.closed = False

    def close(self) -> None:
        with _lock:
            self.closed = True
        self.want(False)

    def want(self, short: bool) -> None:
        global _holders, _saved, _ours
        if not self.interval_s:
            return
        with _lock:
            short = short and not self.closed
            if short == self.held:
                return
            self.held = short
            if short:
                _holders += 1
                if _holders == 1:
                    _saved = sys.getswitchinterval()
                    _ours = None
                    if self.interval_s < _saved:
                        sys.setswitchinterval(self.interval_s)
                        _ours = sys.getswitchinterval()  # as CPython rounded it
                return
            _holders -= 1
            if _holders == 0:
                if _ours is not None and _saved is not None and sys.getswitchinterval() == _ours:
                    sys.setswitchinterval(_saved)
                elif _ours is not None:
                    logger.debug("the engine set the switch interval to %g s meanwhile: left as it is",
                                 sys.getswitchinterval())
                _saved = _ours = None
