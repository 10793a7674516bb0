"""Small cma loads copied by the engine's own thread beside its transfer agent (``engine_copy_bytes``).

Real agent processes, real cma reads; faults injected through the public API (a released hold, a
killed producer agent) or by killing the agent process."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
from test_agent import NB, cfg, make, released, wait_for

from kvxfer.agent import engine_copies
from kvxfer.agent.client import AgentConnector
from kvxfer.cache import allocate_kv_cache, spec_from_config
from kvxfer.config import (
    CacheConfig,
    ConnectorConfig,
    InstanceConfig,
    ModelConfig,
    ParallelConfig,
    SideChannelConfig,
    TimeoutsConfig,
)
from kvxfer.connector import Connector, EngineConnector
from kvxfer.protocol import ErrorCode, merge_params
from kvxfer.transfer.aggregator import Finished

Pair = tuple[EngineConnector, list[torch.Tensor], EngineConnector, list[torch.Tensor]]


def with_connector(c: InstanceConfig, **changes: object) -> InstanceConfig:
    return msgspec.structs.replace(c, connector=msgspec.structs.replace(c.connector, **changes))


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    consumer_changes, producer_changes = getattr(request, "param", ({}, {}))
    p, pt = make(with_connector(cfg("prefill", "cma", hold_wait_s=0.3), **producer_changes), fill=1)
    c, ct = make(with_connector(cfg("decode", "cma", transfer_s=5.0, hold_wait_s=0.3), **consumer_changes))
    yield p, pt, c, ct
    c.close()
    p.close()


def same(pt: list[torch.Tensor], src: list[int], ct: list[torch.Tensor], dst: list[int]) -> bool:
    return all(torch.equal(a[src].view(torch.uint8), b[dst].view(torch.uint8)) for a, b in zip(pt, ct, strict=True))


def first_load(p: EngineConnector, c: EngineConnector) -> None:
    """A load through the agent: its handshake tells the engine the producer."""
    c.start_load("first", p.hold("first", [0], 16), [0])
    assert wait_for(c, "first").receiving == ["first"]


def test_a_small_load_is_copied_in_start_load_bit_exact_and_its_hold_released(pair: Pair) -> None:
    p, pt, c, ct = pair
    assert isinstance(c, AgentConnector)
    first_load(p, c)
    rids = [f"r{i}" for i in range(4)]
    for i, rid in enumerate(rids):
        src, dst = [10 + i, 30 + i], [50 + i, 5 + i]
        c.start_load(rid, p.hold(rid, src, 32), dst)
        out = c.poll()  # no wait: the bytes are here when start_load returns
        assert out.receiving == [rid] and not out.failed
        assert same(pt, src, ct, dst)
    # block ids consecutive on both sides (copied a run at a time), in part, and a partial last block
    for rid, src, dst, tokens in (("run", [40, 41, 42, 43], [40, 41, 42, 43], 64),
                                  ("part-run", [44, 45, 47, 48], [44, 45, 46, 49], 60)):
        c.start_load(rid, p.hold(rid, src, tokens), dst)
        assert c.poll().receiving == [rid]
        rows = tokens % 16 or 16  # the last block's tokens ([block, token, head, dim] tensors)
        assert same(pt, src[:-1], ct, dst[:-1])
        assert all(torch.equal(a[src[-1], :rows].view(torch.uint8), b[dst[-1], :rows].view(torch.uint8))
                   and not b[dst[-1], rows:].view(torch.uint8).any() for a, b in zip(pt, ct, strict=True))
    # a prefix hit: only the blocks after it are written
    before = [t[[60, 61]].clone() for t in ct]
    c.wait("hit", params := p.hold("hit", [20, 21], 32))  # waiting first: its renewals end with the load
    c.start_load("hit", params, [60, 61], num_cached_tokens=16)
    assert c.poll().receiving == ["hit"]
    assert same(pt, [21], ct, [61]) and all(torch.equal(b[0], t[60]) for b, t in zip(before, ct, strict=True))
    s = c.stats()  # the agent counts the engine's copies too, by the time stats() answers
    assert s["engine_copied_loads"] == 7 and s["loads_ok"] == 8 and s["loads_failed"] == 0
    assert s["stage_loads"] == s["stage_handoffs"] == 8  # the bench's stages count every load once
    block = ct[0][0].numel() * ct[0].element_size() * len(ct)
    assert s["bytes_received"] == 10 * block + 4 * block + 3 * block + block * 12 // 16
    done = ["first", "hit", "run", "part-run", *rids]
    assert released(p, done) == sorted(done)  # the agent sent the done notices
    assert c.poll(0.1).receiving == []  # each reported once


def test_a_ucx_plane_with_same_host_cma_has_its_small_loads_copied_by_the_engine() -> None:
    """``same_host: cma``: the ucx plane reads this host's producer with CMA, and the engine's
    thread copies small loads from it as on the cma plane (the producer's ucx address carries
    its cma address)."""
    plane = {"same_host": "cma"}
    p, pt = make(with_connector(cfg("prefill", "ucx", hold_wait_s=0.3), data_plane=plane), fill=1)
    c, ct = make(with_connector(cfg("decode", "ucx", transfer_s=5.0, hold_wait_s=0.3), data_plane=plane))
    try:
        first_load(p, c)
        c.start_load("small", p.hold("small", [3, 9], 32), [7, 8])
        assert c.poll().receiving == ["small"], "copied in start_load: nothing to wait for"
        assert same(pt, [3, 9], ct, [7, 8])
        s = c.stats()
        assert s["engine_copied_loads"] == 1 and s["plane_cma_peers"] == 1, s
        assert released(p, ["first", "small"]) == ["first", "small"]
    finally:
        c.close()
        p.close()


def test_a_copy_with_the_gil_kept_has_the_short_switch_interval_until_the_poll_that_reports_it(
        pair: Pair) -> None:
    """The engine's thread copying a load (GIL kept) may still lose the GIL to a busy thread of the
    engine between its steps, and then waits an interval to go on: the interval is the short one
    from start_load on, and the engine's own again once poll has handed the load over."""
    p, pt, c, ct = pair
    first_load(p, c)
    assert c.poll().receiving == [] and sys.getswitchinterval() != pytest.approx(0.0005)
    c.start_load("kept", p.hold("kept", [3, 4], 32), [13, 14])
    assert sys.getswitchinterval() == pytest.approx(0.0005), "copied, not yet handed to poll"
    assert c.poll().receiving == ["kept"] and c.stats()["engine_copied_loads"] == 1
    assert same(pt, [3, 4], ct, [13, 14])
    assert sys.getswitchinterval() != pytest.approx(0.0005)


@pytest.mark.parametrize("pair", [({"engine_copy_release_gil_bytes": 1}, {})], indirect=True)
def test_a_large_load_is_copied_with_the_gil_released_and_the_short_switch_interval(pair: Pair) -> None:
    """A load of engine_copy_release_gil_bytes or more: copied in start_load bit-exact, the
    engine's switch interval short from the copy until the poll that reports it."""
    p, pt, c, ct = pair
    first_load(p, c)
    assert c.poll().receiving == [] and sys.getswitchinterval() != pytest.approx(0.0005)
    src, dst = [20, 21, 22, 30, 31], [20, 21, 22, 40, 41]
    c.start_load("large", p.hold("large", src, 80), dst)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert c.poll().receiving == ["large"]
    assert same(pt, src, ct, dst) and c.stats()["engine_copied_loads"] == 1
    assert sys.getswitchinterval() != pytest.approx(0.0005)


@pytest.mark.parametrize("pair", [({"engine_copy_bytes": 0}, {}), ({}, {"data_plane": {"one_sided": False}})],
                         ids=["engine_copy_bytes 0", "producer without a board"], indirect=True)
def test_the_agent_loads_what_the_engine_may_not_copy(pair: Pair) -> None:
    p, pt, c, ct = pair
    first_load(p, c)
    for i in range(3):
        rid = f"r{i}"
        c.start_load(rid, p.hold(rid, [10 + i], 16), [20 + i])
        assert wait_for(c, rid).receiving == [rid]
        assert same(pt, [10 + i], ct, [20 + i])
    assert c.stats()["engine_copied_loads"] == 0


@pytest.mark.parametrize("pair", [({"engine_copy_bytes": 1}, {})], indirect=True)
def test_a_load_larger_than_engine_copy_bytes_goes_to_the_agent(pair: Pair) -> None:
    p, pt, c, ct = pair
    first_load(p, c)
    c.start_load("big", p.hold("big", [3, 4], 32), [40, 41])
    assert wait_for(c, "big").receiving == ["big"]
    assert same(pt, [3, 4], ct, [40, 41])
    assert c.stats()["engine_copied_loads"] == 0


def test_a_released_hold_is_not_copied_by_the_engine_and_fails_as_not_held(pair: Pair) -> None:
    p, _, c, _ = pair
    first_load(p, c)
    params = p.hold("gone", [7], 16)
    assert p.release("gone")
    passed = c.stats()["engine_passed_loads"]
    c.start_load("gone", params, [9])
    out = wait_for(c, "gone")
    assert out.failed == {"gone": [9]} and out.codes["gone"] is ErrorCode.NOT_HELD
    s = c.stats()
    assert s["engine_copied_loads"] == 0 and s["engine_passed_loads"] == passed + 1  # tried, and left to the agent


def test_a_dead_producer_agent_fails_the_load_through_the_agent_with_its_blocks(pair: Pair) -> None:
    p, _, c, _ = pair
    assert isinstance(p, AgentConnector) and p.process is not None
    first_load(p, c)
    assert c.stats()["engine_producers"] == 1
    params = p.hold("r1", [7], 16)
    os.kill(p.process.pid, signal.SIGKILL)
    p.process.wait(10)
    t0 = time.monotonic()
    c.start_load("r1", params, [9])
    out = wait_for(c, "r1", timeout_s=30)
    assert out.failed == {"r1": [9]} and out.codes["r1"] is not None
    assert time.monotonic() - t0 < 5.0 + 1.0  # within transfer_s
    s = c.stats()
    assert s["engine_copied_loads"] == 0 and s["engine_producers"] == 0  # forgotten: its files unmapped
    c.start_load("r2", params, [10])  # not tried again: straight to the agent, which fails it
    assert wait_for(c, "r2", timeout_s=30).failed == {"r2": [10]}
    assert c.stats()["engine_passed_loads"] == s["engine_passed_loads"] + 1


def received(c: EngineConnector, rids: list[str], timeout_s: float = 30.0) -> Finished:
    """What ``c``'s polls report until every one of ``rids`` finished or failed (or ``timeout_s``)."""
    out = Finished()
    deadline = time.monotonic() + timeout_s
    while set(rids) - set(out.receiving) - set(out.failed) and time.monotonic() < deadline:
        out.extend(c.poll(0.05))
    return out


def test_a_burst_of_copied_loads_tells_every_producer_hold_without_a_poll_between(pair: Pair) -> None:
    """More copied loads than the agent reads between two of its event turns: none is lost (their
    holds all come back), and each is reported once. Their bytes stay under SHARE_AFTER_BYTES: the
    engine copies every one (the next test shares a burst)."""
    p, pt, c, ct = pair
    first_load(p, c)
    rids = [f"b{i}" for i in range(300)]
    for i, rid in enumerate(rids):
        c.start_load(rid, p.hold(rid, [1 + i % 60], 16), [1 + (i * 7) % 60])
    out = received(c, rids)
    assert sorted(out.receiving) == sorted(rids) and not out.failed
    assert same(pt, [1 + 299 % 60], ct, [1 + (299 * 7) % 60])
    assert released(p, ["first", *rids], timeout_s=30) == sorted(["first", *rids])
    s = c.stats()
    assert s["engine_copied_loads"] == 300 and s["engine_shared_loads"] == 0 and s["loads_ok"] == 301


def test_in_a_burst_every_other_load_is_the_agents_the_rest_copied_at_the_next_poll(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads started with no poll between, once the engine has copied SHARE_AFTER_BYTES in them
    (here: its first load): the agent takes the second, the third waits for the next poll, and so
    on (the agent has its share at once and copies it while poll copies the rest); all bit-exact,
    each reported once. After a poll the next load is copied in ``start_load`` again."""
    p, pt, c, ct = pair
    first_load(p, c)
    rids = [f"t{i}" for i in range(6)]
    for i, rid in enumerate(rids):  # the default: a few small loads in a burst stay the engine's
        c.start_load(rid, p.hold(rid, [10 + i], 16), [30 + i])
    assert sorted(c.poll().receiving) == sorted(rids)  # copied in start_load: no wait
    assert c.stats()["engine_shared_loads"] == 0
    monkeypatch.setattr(engine_copies, "SHARE_AFTER_BYTES", 1)
    for t in ct:
        t[30:42].zero_()
    rids = [f"s{i}" for i in range(6)]
    for i, rid in enumerate(rids):
        c.start_load(rid, p.hold(rid, [10 + 2 * i, 11 + 2 * i], 32), [30 + 2 * i, 31 + 2 * i])
    assert same(pt, [10, 11], ct, [30, 31]), "the first: copied in start_load"
    assert not any(t[[34, 35, 38, 39]].view(torch.uint8).any() for t in ct), "the third and fifth: not yet"
    out = c.poll()  # the engine's own are copied by now; the agent's come as they finish
    assert set(rids[0::2]) <= set(out.receiving), out
    out.extend(received(c, [r for r in rids if r not in out.receiving]))
    assert sorted(out.receiving) == sorted(rids) and not out.failed
    assert same(pt, list(range(10, 22)), ct, list(range(30, 42)))
    s = c.stats()
    assert s["engine_copied_loads"] == 6 + 3 and s["engine_shared_loads"] == 3 and s["engine_later_loads"] == 2
    c.start_load("alone", p.hold("alone", [50], 16), [55])
    assert c.poll().receiving == ["alone"]  # copied in start_load: no wait
    assert same(pt, [50], ct, [55]) and c.stats()["engine_copied_loads"] == 10
    assert c.poll(0.1).receiving == []  # each reported once
    assert released(p, ["first", *[f"t{i}" for i in range(6)], *rids, "alone"], timeout_s=30) == sorted(
        ["first", *[f"t{i}" for i in range(6)], *rids, "alone"])


def test_a_load_left_for_the_poll_that_cannot_be_copied_then_goes_to_the_agent(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load of a shared burst whose copy at poll is refused (its hold was released meanwhile:
    not on the board) is sent to the agent then, which fails it as not held, with its blocks."""
    p, _, c, _ = pair
    first_load(p, c)
    monkeypatch.setattr(engine_copies, "SHARE_AFTER_BYTES", 1)
    for i, rid in enumerate(["a", "b", "c"]):
        c.start_load(rid, p.hold(rid, [10 + i], 16), [20 + i])
    assert p.release("c")  # "c" waits for the poll (a: now, b: the agent's, c: later)
    out = received(c, ["a", "b", "c"])
    assert sorted(out.receiving) == ["a", "b"] and out.failed == {"c": [22]}, out
    assert out.codes["c"] == ErrorCode.NOT_HELD
    s = c.stats()
    assert s["engine_later_loads"] == 1 and s["engine_passed_loads"] >= 1


def test_a_load_left_for_a_poll_fails_with_its_blocks_if_the_connector_closes_first(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() before the poll that would copy a deferred load: the next poll reports it failed
    with its block ids (nothing is copied after close), never silently dropped."""
    p, _, c, ct = pair
    first_load(p, c)
    monkeypatch.setattr(engine_copies, "SHARE_AFTER_BYTES", 1)
    for i, rid in enumerate(["a", "b", "c"]):  # a: now, b: the agent's, c: left for the poll
        c.start_load(rid, p.hold(rid, [10 + i], 16), [20 + i])
    c.close()
    out = c.poll()
    assert out.failed.get("c") == [22] and "c" not in out.receiving, out
    assert "a" in out.receiving
    assert not any(t[22].view(torch.uint8).any() for t in ct)


def shaped(role: str, engine: str, tp: int = 1, pp: int = 1, layout: str = "NHD", bs: int = 16, mla: bool = False,
           kv_fused: bool = False, **connector: object) -> InstanceConfig:
    heads = 1 if mla else 4
    c = InstanceConfig(
        role=role, engine_id=engine,
        model=ModelConfig(num_layers=4, num_kv_heads=heads, num_heads=8, head_size=16, mla=mla),
        cache=CacheConfig(block_size=bs, num_blocks=NB, layout=layout, kv_fused=kv_fused),
        parallel=ParallelConfig(tp=tp, pp=pp),
        connector=ConnectorConfig(name="cma", side_channel=SideChannelConfig(host="127.0.0.1", port=0),
                                  timeouts=TimeoutsConfig(handshake_s=5.0, handshake_retries=1, transfer_s=10.0,
                                                          hold_wait_s=0.3)))
    return with_connector(c, **connector)


SHAPES = {  # producer, consumer: topologies and cache layouts whose loads the engine copies (or passes on)
    "prefill TP2 -> decode TP1": ({"tp": 2}, {}),
    "prefill TP1 -> decode TP2": ({}, {"tp": 2}),
    "prefill PP2 -> decode PP1": ({"pp": 2}, {}),
    "block 16 -> 64": ({}, {"bs": 64}),
    "MLA, prefill TP2 -> decode TP1": ({"mla": True, "tp": 2}, {"mla": True}),
    "fused K|V HND, prefill TP1 -> decode TP2": ({"kv_fused": True, "layout": "HND"},
                                                 {"kv_fused": True, "layout": "HND", "tp": 2}),
    "HND -> NHD (a repack: the agent's)": ({"layout": "HND"}, {}),
}


@pytest.mark.parametrize("case", list(SHAPES))
def test_loads_the_engine_copies_equal_the_agents_on_other_topologies_and_layouts(case: str) -> None:
    """Two consumer instances load the same held blocks into the same local blocks, one with the
    engine's copies, one through its agents only (bit-exact against the topology's oracle in
    test_transfer.py): every rank's bytes are equal, and the engine copied (or, for a repack,
    passed every load on)."""
    pkw, dkw = SHAPES[case]
    pcfg = shaped("prefill", "P", **pkw)
    conns: list[EngineConnector] = []
    try:
        producers = []
        for rank in range(pcfg.world_size):
            p = Connector.from_config(pcfg, rank)
            conns.append(p)
            cache = allocate_kv_cache(spec_from_config(pcfg, rank // pcfg.parallel.tp), NB)
            for i, t in enumerate(cache.tensors):
                t.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),),
                                                                 generator=torch.Generator().manual_seed(rank * 97 + i),
                                                                 dtype=torch.uint8))
            p.register_kv_caches(cache)
            producers.append(p)
        sides = {}
        for name, changes in (("engine", {}), ("agent", {"engine_copy_bytes": 0})):
            dcfg = shaped("decode", f"D-{name}", **dkw, **changes)
            ranks = []
            for rank in range(dcfg.world_size):
                c = Connector.from_config(dcfg, rank)
                conns.append(c)
                cache = allocate_kv_cache(spec_from_config(dcfg, rank // dcfg.parallel.tp), NB)
                c.register_kv_caches(cache)
                ranks.append((c, cache.tensors))
            sides[name] = ranks
        src, tokens = [[5, 9, 2], [11, 4, 30]], [40, 20]  # the second: a block short of full
        for step, rid in enumerate(["warm", "load"]):
            for name, ranks in sides.items():
                params = merge_params([p.hold(f"{rid}-{name}", src[step], tokens[step]) for p in producers])
                dst = [[40, 7, 60], [61, 3, 8]][step][: -(-tokens[step] // ranks[0][0].config.cache.block_size)]
                for c, _ in ranks:
                    c.start_load(f"{rid}-{name}", params, dst)
                for c, _ in ranks:
                    assert wait_for(c, f"{rid}-{name}").receiving == [f"{rid}-{name}"]
        for (ce, te), (ca, ta) in zip(sides["engine"], sides["agent"], strict=True):
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(te, ta, strict=True))
            s = ce.stats()
            if "repack" in case:
                assert s["engine_copied_loads"] == 0 and s["engine_producers"] == 0  # not learnt: not direct
            else:
                assert s["engine_copied_loads"] == 1, s  # the first load handshook through the agent
            assert ca.stats()["engine_copied_loads"] == 0
    finally:
        for c in reversed(conns):
            c.close()
