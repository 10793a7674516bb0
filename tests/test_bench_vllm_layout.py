"""kvxfer bench vllm's agent_cpus for its servers' layout (docs/vllm.md: ``engine`` for servers on
cores of their own, the connector's ``any`` otherwise)."""

from __future__ import annotations

import pytest

from kvxfer.bench.vllm import bound_cpus, default_agent_cpus


@pytest.mark.parametrize(("bind", "cpus"), [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0,2", {0, 2}), ("1-2,5", {1, 2, 5}),
                                            ("none", None), ("auto", None), ("", None), ("0-", None), ("a-b", None)])
def test_a_bind_value_names_its_cpus_or_none(bind: str, cpus: set[int] | None) -> None:
    assert bound_cpus(bind) == cpus


def test_servers_on_cores_of_their_own_keep_their_agents_there_and_others_use_the_connector_default() -> None:
    assert default_agent_cpus(["0", "1"]) == "engine"  # the bench's default --cpus
    assert default_agent_cpus(["0-1", "2-3"]) == "engine"
    assert default_agent_cpus(["0", "0"]) == "any"  # two servers' workers on one core
    assert default_agent_cpus(["0-1", "1-2"]) == "any"
    assert default_agent_cpus(["none", "1"]) == "any"  # an unbound server may run anywhere
