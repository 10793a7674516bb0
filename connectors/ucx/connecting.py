"""The ucx plane's consumer side of a connection: its steps, timed, so a slow or stuck connect
says where it is (a connect is an endpoint, a hello on the control socket, the producer's
answer, and, one-sided, wiring up an endpoint to the RMA worker it made)."""

from __future__ import annotations

import time

SLOW_CONNECT_S = 2.0  # a connect slower than this is logged with its steps


class ConnectSteps:
    """The step a connect is in and how long each one before it took (loop thread writes,
    the calling thread reads after the connect ended or timed out)."""

    def __init__(self, first: str = "making an endpoint to the producer") -> None:
        self.began = self._since = time.monotonic()
        self.step = first
        self.took: list[tuple[str, float]] = []

    def at(self, step: str) -> None:
        now = time.monotonic()
        self.took.append((self.step, now - self._since))
        self.step, self._since = step, now

    def total_s(self) -> float:
        return time.monotonic() - self.began

    def describe(self) -> str:
        before = "; ".join(f"{s}: {t * 1000:.0f} ms" for s, t in self.took)
        now = f"{self.step} for {time.monotonic() - self._since:.2f}s"
        return f"{now} (before: {before})" if before else now
