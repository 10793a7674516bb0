"""Ratios measured in alternating rounds (``kvxfer bench transfer --rounds``).

A ratio's conditions (idle and each busy side; one request and many in flight) each run
``budget / rounds`` at a time, in turn, and each condition's trials are pooled. On a VM whose
speed drifts over seconds (a neighbour's load, the host), measuring one condition after the
other puts the drift into the ratio, in whichever direction it went; in turns it falls on both.
The order rotates each round, so no condition always runs first (after a warm-up) or last.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Stages = dict[str, float]
Measurement = tuple[list[float], Stages | None]


def in_rounds(conditions: Sequence[str], measure: Callable[[str, float], Measurement], budget_s: float,
              rounds: int) -> dict[str, Measurement]:
    """``measure(condition, budget)`` for every condition, ``rounds`` times in rotating order with
    ``budget_s / rounds`` each: each condition's trial times pooled, its stages pooled
    (:func:`pool_stages`)."""
    if rounds < 1:
        raise ValueError(f"rounds: expected at least 1, got {rounds}")
    times: dict[str, list[float]] = {c: [] for c in conditions}
    stages: dict[str, list[Stages]] = {c: [] for c in conditions}
    n = len(conditions)
    for r in range(rounds):
        for c in (*conditions[r % n:], *conditions[:r % n]):
            t, s = measure(c, budget_s / rounds)
            times[c].extend(t)
            if s is not None:
                stages[c].append(s)
    return {c: (times[c], pool_stages(stages[c])) for c in conditions}


COUNTS = {"handoff_us": "handoffs"}  # a stage averaged over a count of its own (stage_breakdown), not loads


def pool_stages(parts: Sequence[Stages]) -> Stages | None:
    """Stage means (``stage_breakdown``'s) of several measurements as one: each stage weighted by
    what it was averaged over in the measurements that have it (its loads; the handoff, its
    handoffs); the counts summed. None: none had a load."""
    parts = [p for p in parts if p.get("loads", 0) > 0]
    if not parts:
        return None
    counts = {"loads", *COUNTS.values()}
    out: Stages = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        having = [p for p in parts if key in p]
        if key in counts:
            out[key] = sum(p[key] for p in having)
            continue
        weight = COUNTS.get(key, "loads")  # stage_breakdown gives a stage's count wherever it gives the stage
        out[key] = sum(p[key] * p[weight] for p in having) / sum(p[weight] for p in having)
    return out
