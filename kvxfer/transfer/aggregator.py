"""Aggregation of finished requests across the TP/PP workers of one instance.

Each worker's connector reports what it finished; the scheduler may treat a request as
finished only when every worker has reported it. A request that failed on any worker is
reported failed, with the union of the invalid block ids every worker gave.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvxfer.protocol import ErrorCode


@dataclass
class Finished:
    """What one ``poll`` found: holds released, loads completed, and loads failed."""

    sending: list[str] = field(default_factory=list)
    receiving: list[str] = field(default_factory=list)
    failed: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # why each failed request failed, for people
    codes: dict[str, ErrorCode] = field(default_factory=dict)  # why each failed request failed, for code
    layers: dict[str, list[int]] = field(default_factory=dict)  # push: layers of a request newly landed

    def __bool__(self) -> bool:
        return bool(self.sending or self.receiving or self.failed or self.layers)

    def extend(self, other: Finished) -> None:
        self.sending.extend(other.sending)
        self.receiving.extend(other.receiving)
        for rid, ids in other.failed.items():
            self.failed.setdefault(rid, []).extend(ids)
        self.errors.update(other.errors)
        self.codes.update(other.codes)
        for rid, layers in other.layers.items():
            self.layers.setdefault(rid, []).extend(layers)


class FinishedAggregator:
    """Reports a request once all ``world_size`` workers have reported it."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {world_size}")
        self.world_size = world_size
        self._sending: dict[str, set[int]] = {}
        self._receiving: dict[str, set[int]] = {}
        self._failed: dict[str, list[int]] = {}
        self._errors: dict[str, tuple[str, ErrorCode]] = {}  # the first worker's reason for a failed request

    def add(self, worker: int, finished: Finished) -> Finished:
        if not 0 <= worker < self.world_size:
            raise ValueError(f"worker: expected 0 <= worker < {self.world_size}, got {worker}")
        out = Finished()
        for rid in finished.sending:
            seen = self._sending.setdefault(rid, set())
            seen.add(worker)
            if len(seen) == self.world_size:
                del self._sending[rid]
                out.sending.append(rid)
        for rid in [*finished.receiving, *finished.failed]:
            seen = self._receiving.setdefault(rid, set())
            seen.add(worker)
            if rid in finished.failed:
                self._failed.setdefault(rid, []).extend(finished.failed[rid])
                if rid in finished.errors:
                    self._errors.setdefault(rid, (finished.errors[rid],
                                                  finished.codes.get(rid, ErrorCode.INTERNAL)))
            if len(seen) == self.world_size:
                del self._receiving[rid]
                if rid in self._failed:
                    out.failed[rid] = sorted(set(self._failed.pop(rid)))
                    out.errors[rid], out.codes[rid] = self._errors.pop(rid, ("", ErrorCode.INTERNAL))
                else:
                    out.receiving.append(rid)
        return out
