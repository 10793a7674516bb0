"""The counters of a rank whose data path runs in a transfer agent: the agent's, fetched when
read, with the hand-off to the engine's ``poll`` and the engine's own copies added here.

Threads: any (``ConnectorMetrics``' lock guards the engine-side sums).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from kvxfer.agent.engine_copies import ENGINE_COUNTERS
from kvxfer.metrics import ConnectorMetrics

if TYPE_CHECKING:
    from kvxfer.agent.client import AgentConnector


class AgentMetrics(ConnectorMetrics):
    """The agent's counters, fetched when read (for ``stats()`` and the Prometheus endpoint)."""

    def __init__(self, owner: AgentConnector, engine_id: str, rank: int, plane: str) -> None:
        super().__init__(engine_id, rank, plane)
        self.owner = weakref.ref(owner)  # no cycle: a closed connector and its cache go at once
        self.last: dict[str, float] = {}
        self.handoff_s = 0.0  # event sent by the agent until poll handed it to the engine
        self.handoffs = 0
        self.copied_handoff_s = 0.0  # a load the engine copied, until poll handed it over
        self.copied_handoffs = 0

    def copied_handed_over(self, loads: int, seconds: float) -> None:
        """``loads`` loads the engine copied itself reached ``poll``, ``seconds`` after their copies (summed)."""
        with self._lock:
            self.copied_handoffs += loads
            self.copied_handoff_s += seconds

    def handed_over(self, loads: int, seconds: float) -> None:
        """``loads`` finished loads reached the engine's ``poll``, ``seconds`` after the agent sent them (summed)."""
        with self._lock:
            self.handoffs += loads
            self.handoff_s += seconds

    def snapshot(self) -> dict[str, float]:
        owner = self.owner()
        stats = owner._fetch_stats() if owner is not None else None
        if stats is not None:
            with self._lock:
                self.last = dict(stats.snapshot)
                self.failed_by_code.clear()
                self.failed_by_code.update(stats.failed_by_code)
                for h, s in ((self.handshake_latency, stats.handshake), (self.transfer_latency, stats.transfer)):
                    h.counts, h.sum, h.count = list(s.counts), s.sum, s.count
        with self._lock:
            out = dict(self.last)
            # the handoff stage ends when the engine's poll has it: the agent's event hop counts too
            out["stage_handoff_s"] = out.get("stage_handoff_s", 0.0) + self.handoff_s + self.copied_handoff_s
            out["stage_handoffs"] = out.get("stage_handoffs", 0.0) + self.copied_handoffs  # the agent's count the rest
            out["agent_handoff_s"] = self.handoff_s
            out["agent_handoffs"] = float(self.handoffs)
        copies = owner._engine_copies if owner is not None else None
        out.update(copies.counters() if copies is not None else dict.fromkeys(ENGINE_COUNTERS, 0.0))
        if owner is None or owner.broken is not None:
            out["broken"] = 1.0
        return out
