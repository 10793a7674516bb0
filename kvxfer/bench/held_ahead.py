"""Holds on the producer process asked for ahead of the loads that use them (``kvxfer bench transfer``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxfer.protocol import KVTransferParams

if TYPE_CHECKING:
    from kvxfer.bench.transfer import Bench

HELD_AHEAD = 16  # holds made per request to the producer (see HeldAhead)


@dataclass
class HeldAhead:
    """Holds on the producer made ahead of one measurement's loads, HELD_AHEAD per request to the
    producer process, the next request sent when half are left: its answer comes while loads run,
    so no load waits for it (a busy producer's engine answers after its GIL's switch intervals, ms),
    and loads run back to back. The bench's pipe has at most one such request out (``collect``
    takes its answer before any other message)."""

    name: str
    src_ids: list[int]
    tokens: int
    ready: list[KVTransferParams] = field(default_factory=list)
    asked: bool = False

    def next(self, bench: Bench) -> KVTransferParams:
        if self.asked and (not self.ready or bench.pipe.poll(0)):
            self.collect(bench)
        if not self.ready:
            self._ask(bench)
            self.collect(bench)
        if len(self.ready) <= HELD_AHEAD // 2 and not self.asked:
            self._ask(bench)
        return self.ready.pop(0)

    def _ask(self, bench: Bench) -> None:
        bench.pipe.send(("holds", self.name, [self.src_ids] * HELD_AHEAD, self.tokens))
        self.asked = True

    def collect(self, bench: Bench) -> None:
        """The answer to the request out, if any (waits for it)."""
        if self.asked:
            self.asked = False
            self.ready.extend(KVTransferParams.from_bytes(b) for b in bench._recv())
