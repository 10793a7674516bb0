"""The interpreter's switch interval is short while a rank's loads are in flight, and the engine's
own value comes back after (kvxfer/switch_interval.py)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
from test_agent import cfg, make, wait_for

from kvxfer import switch_interval
from kvxfer.agent.client import AgentConnector
from kvxfer.cache import allocate_kv_cache, spec_from_config
from kvxfer.config import ConfigError, InstanceConfig, convert
from kvxfer.connector import Connector
from kvxfer.switch_interval import SwitchInterval


@pytest.fixture(autouse=True)
def cpython_default() -> Iterator[float]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(old)
    assert switch_interval._holders == 0 and switch_interval._waiters == 0, "a test left a claim on the interval"
    switch_interval._holders, switch_interval._saved, switch_interval._ours = 0, None, None
    switch_interval._waiters = 0


def test_the_interval_is_short_while_any_connector_wants_it_and_comes_back_after_the_last() -> None:
    a, b = SwitchInterval(0.0005), SwitchInterval(0.0005)
    a.want(True)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    a.want(True)  # idempotent: still one claim
    b.want(True)
    a.want(False)
    assert sys.getswitchinterval() == pytest.approx(0.0005), "b still has loads in flight"
    b.want(False)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    b.want(False)  # a second release changes nothing
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_value_the_engine_sets_meanwhile_is_left_as_it_is() -> None:
    s = SwitchInterval(0.0005)
    s.want(True)
    sys.setswitchinterval(0.002)  # the engine's own choice, made while loads were in flight
    s.want(False)
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_zero_never_touches_it_and_an_interval_already_shorter_is_not_raised() -> None:
    off = SwitchInterval(0.0)
    off.want(True)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    off.want(False)
    sys.setswitchinterval(0.0001)
    s = SwitchInterval(0.0005)
    s.want(True)
    assert sys.getswitchinterval() == pytest.approx(0.0001)
    s.want(False)
    assert sys.getswitchinterval() == pytest.approx(0.0001)
    with pytest.raises(ValueError, match="gil_switch_interval_s"):
        SwitchInterval(-1.0)


def test_a_wait_for_loads_in_flight_is_shorter_still_and_each_claim_comes_back_in_turn() -> None:
    s = SwitchInterval(0.0005, wait_s=0.00005)
    with s.waiting():  # nothing in flight (a prefill waiting for its holds): nothing changes
        assert sys.getswitchinterval() == pytest.approx(0.005)
    s.want(True)
    with s.waiting():
        assert sys.getswitchinterval() == pytest.approx(0.00005)
        other = SwitchInterval(0.0005, wait_s=0.00005)
        other.want(True)
        with other.waiting():  # two waits at once (two ranks in one process)
            assert sys.getswitchinterval() == pytest.approx(0.00005)
        assert sys.getswitchinterval() == pytest.approx(0.00005), "s still waits"
        other.want(False)
    assert sys.getswitchinterval() == pytest.approx(0.0005), "after the wait: loads still in flight"
    s.want(False)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_wait_ends_with_the_engines_value_if_it_set_one_and_off_switches_change_nothing() -> None:
    s = SwitchInterval(0.0005, wait_s=0.00005)
    s.want(True)
    with s.waiting():
        sys.setswitchinterval(0.002)  # the engine's own choice (another thread), made during the wait
    assert sys.getswitchinterval() == pytest.approx(0.0005), "the engine's 2 ms is its own; loads in flight"
    s.want(False)
    assert sys.getswitchinterval() == pytest.approx(0.002), "the engine's value, not the one found before"
    for off in (SwitchInterval(0.0005, wait_s=0.0), SwitchInterval(0.0, wait_s=0.00005)):
        off.want(True)
        with off.waiting():
            assert sys.getswitchinterval() == pytest.approx(0.0005 if off.interval_s else 0.002)
        off.want(False)
    assert sys.getswitchinterval() == pytest.approx(0.002)
    with pytest.raises(ValueError, match="gil_wait_switch_interval_s"):
        SwitchInterval(0.0005, wait_s=-1.0)


def test_a_closed_claim_is_given_up_for_good() -> None:
    s = SwitchInterval(0.0005)
    s.want(True)
    s.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    s.want(True)  # a poll racing the close, or after it
    assert sys.getswitchinterval() == pytest.approx(0.005) and not s.held


def test_an_interval_out_of_range_is_refused_by_its_path() -> None:
    data = {"role": "decode", "engine_id": "d", "connector": {"gil_switch_interval_s": 1.0}}
    with pytest.raises(ConfigError, match=r"connector\.gil_switch_interval_s"):
        convert(data, InstanceConfig, "test.yaml")


@pytest.mark.parametrize("interval", [0.0005, 0.0])
def test_a_load_through_the_agent_shortens_the_interval_until_a_poll_reports_it(interval: float) -> None:
    p, _ = make(cfg("prefill"), fill=1)
    c_cfg = cfg("decode")
    c_cfg = msgspec.structs.replace(c_cfg, connector=msgspec.structs.replace(c_cfg.connector,
                                                                             gil_switch_interval_s=interval))
    c, _ = make(c_cfg)
    try:
        assert isinstance(c, AgentConnector)
        assert sys.getswitchinterval() == pytest.approx(0.005), "no load in flight yet"
        params = p.hold("r1", [1, 2, 3], 40)
        c.start_load("r1", params, [7, 8, 9])
        assert sys.getswitchinterval() == pytest.approx(interval or 0.005)  # until a poll reports it
        assert wait_for(c, "r1").receiving == ["r1"]
        assert sys.getswitchinterval() == pytest.approx(0.005), "no load in flight: the engine's own value"
        c.start_load("r2", p.hold("r2", [4], 16), [10])
    finally:
        c.close()  # with r2 perhaps still in flight: closing gives the interval back too
        p.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    c.poll()  # a poll after close, r2 perhaps still recorded: the interval stays the engine's
    assert sys.getswitchinterval() == pytest.approx(0.005)


@pytest.mark.parametrize("interval", [0.0005, 0.0])
def test_a_load_in_the_engines_process_shortens_the_interval_but_a_transfer_agents_connector_never_does(
        interval: float) -> None:
    """data_path: engine, the transfer threads in the engine's process: the same claim as through an
    agent. A transfer agent builds its connector with Connector.in_process: the interval stays."""
    p, _ = make(cfg("prefill", data_path="engine", gil_switch_interval_s=0.0), fill=1)  # the consumer's claim alone
    c, _ = make(cfg("decode", data_path="engine", gil_switch_interval_s=interval))
    try:
        assert isinstance(c, Connector) and not isinstance(c, AgentConnector)
        c.start_load("r1", p.hold("r1", [1, 2, 3], 40), [7, 8, 9])
        assert sys.getswitchinterval() == pytest.approx(interval or 0.005)  # until a poll reports it
        assert wait_for(c, "r1").receiving == ["r1"]
        assert sys.getswitchinterval() == pytest.approx(0.005), "no load in flight: the engine's own value"
        c.start_load("r2", p.hold("r2", [4], 16), [10])
    finally:
        c.close()
        p.close()
    assert sys.getswitchinterval() == pytest.approx(0.005), "closed with r2 perhaps in flight: given back"
    agent_side = Connector.in_process(cfg("decode", data_path="engine"), 0)  # what a transfer agent runs
    try:
        agent_side.register_kv_caches(allocate_kv_cache(spec_from_config(agent_side.config), 64))
        p, _ = make(cfg("prefill", data_path="engine", gil_switch_interval_s=0.0), fill=2)
        try:
            agent_side.start_load("r3", p.hold("r3", [1], 16), [5])
            assert sys.getswitchinterval() == pytest.approx(0.005), "an agent's own threads keep the interval"
            assert wait_for(agent_side, "r3").receiving == ["r3"]
        finally:
            p.close()
    finally:
        agent_side.close()


def test_a_hold_in_the_engines_process_shortens_the_interval_until_a_poll_finds_none_left() -> None:
    """data_path: engine on the prefill side: the engine's process serves the reads, so a hold claims it."""
    p, _ = make(cfg("prefill", data_path="engine"), fill=1)
    c, _ = make(cfg("decode", data_path="engine", gil_switch_interval_s=0.0))
    try:
        params = p.hold("r1", [1, 2, 3], 40)
        assert sys.getswitchinterval() == pytest.approx(0.0005), "held: the reads it serves need the GIL"
        c.start_load("r1", params, [7, 8, 9])
        assert wait_for(c, "r1").receiving == ["r1"]
        sent: list[str] = []
        deadline = time.monotonic() + 30
        while not sent and time.monotonic() < deadline:
            sent = p.poll(0.05).sending
        assert sent == ["r1"] and sys.getswitchinterval() == pytest.approx(0.005), "released: given back"
    finally:
        c.close()
        p.close()


def test_a_poll_that_waits_for_a_load_through_the_agent_has_the_wait_interval_meanwhile() -> None:
    """Sampled from another thread while the engine's thread waits in ``poll(timeout_s)``: the wait's
    interval (50 us by default), the in-flight one after the wait, the engine's once nothing is in flight."""
    p, _ = make(cfg("prefill"), fill=1)
    c, _ = make(cfg("decode", hold_wait_s=2.0))
    seen: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(sys.getswitchinterval())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    try:
        assert isinstance(c, AgentConnector)
        params = p.hold("r1", [1, 2], 20)
        p.release("r1")  # not held: the consumer retries for hold_wait_s, so the load stays in flight
        c.start_load("r1", params, [7, 8])
        sampler.start()
        assert c.poll(0.3).receiving == []
        stop.set()
        sampler.join()
        assert seen and min(seen) == pytest.approx(0.00005), f"the wait's interval, sampled: {sorted(set(seen))}"
        assert sys.getswitchinterval() == pytest.approx(0.0005), "after the wait, r1 still in flight"
        assert wait_for(c, "r1").failed, "r1 was never held: it fails"
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        stop.set()
        c.close()
        p.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)
