"""kvxfer.bench.rounds: a ratio's conditions measured in turns, trials and stages pooled."""

from __future__ import annotations

import pytest

from kvxfer.bench.rounds import in_rounds, pool_stages


def test_conditions_take_turns_in_rotating_order_each_with_its_share_of_the_budget() -> None:
    calls: list[tuple[str, float]] = []

    def measure(condition: str, budget_s: float) -> tuple[list[float], dict[str, float] | None]:
        calls.append((condition, budget_s))
        return [float(len(calls))], {"loads": 2.0, "transfer_us": 10.0 * len(calls)}

    got = in_rounds(("idle", "consumer", "producer"), measure, 0.9, 3)
    assert [c for c, _ in calls] == ["idle", "consumer", "producer", "consumer", "producer", "idle",
                                     "producer", "idle", "consumer"]
    assert all(b == pytest.approx(0.3) for _, b in calls)
    # each condition's trials from every round, in the order measured
    assert got["idle"][0] == [1.0, 6.0, 8.0] and got["consumer"][0] == [2.0, 4.0, 9.0]
    stages = got["producer"][1]
    assert stages == {"loads": 6.0, "transfer_us": pytest.approx((30 + 50 + 70) / 3)}


def test_one_round_is_one_measurement_each_and_zero_is_refused() -> None:
    calls: list[str] = []

    def measure(condition: str, budget_s: float) -> tuple[list[float], None]:
        calls.append(condition)
        assert budget_s == 0.5
        return [1.0], None

    got = in_rounds(("one", "many"), measure, 0.5, 1)
    assert calls == ["one", "many"] and got == {"one": ([1.0], None), "many": ([1.0], None)}
    with pytest.raises(ValueError, match="rounds: expected at least 1, got 0"):
        in_rounds(("one",), measure, 0.5, 0)
    assert calls == ["one", "many"]


def test_stages_pool_weighted_by_loads_and_a_stage_only_some_rounds_have() -> None:
    pooled = pool_stages([{"loads": 1.0, "plan_us": 10.0, "queue_us": 4.0},
                          {"loads": 3.0, "plan_us": 30.0},
                          {"loads": 0.0, "plan_us": 999.0}])  # no load: not counted
    assert pooled == {"loads": 4.0, "plan_us": pytest.approx(25.0), "queue_us": 4.0}
    assert pool_stages([]) is None and pool_stages([{"loads": 0.0}]) is None


def test_the_handoff_pools_over_its_handoffs_not_its_loads() -> None:
    """stage_breakdown averages the handoff over the handoffs counted, which a burst's loads need
    not equal: pooled, each measurement's handoff weighs by its handoffs."""
    pooled = pool_stages([{"loads": 4.0, "handoff_us": 100.0, "handoffs": 1.0},
                          {"loads": 1.0, "handoff_us": 10.0, "handoffs": 3.0}])
    assert pooled == {"loads": 5.0, "handoff_us": pytest.approx((100 + 30) / 4), "handoffs": 4.0}
