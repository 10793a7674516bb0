"""The producer's holds when the engine makes them late: an abandon that arrives first is kept.

vLLM makes the prefill side's hold one engine step after it answered the request, so the decode
side can give up (its load refused, the request aborted, a full local prefix hit) before the
hold exists. The hold must then be freed the moment it is made, not a lease later.
"""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
from test_transfer import make_cfg

from kvxfer.cache import allocate_kv_cache, spec_from_config
from kvxfer.connector import Connector
from kvxfer.protocol import KVTransferParams, PushTarget, RemoteRank
from kvxfer.topology import ParallelLayout, readers_of
from kvxfer.transfer.producer import HoldRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def registry(clock: Clock, lease_s: float = 10.0) -> HoldRegistry:
    layout = ParallelLayout(tp_size=1, pp_size=1, num_layers=2, num_kv_heads=2)
    return HoldRegistry(layout, 0, 0, 64, {0: (1024, 64 * 1024)}, lease_s, 600.0, clock)


def test_an_abandon_before_the_hold_frees_it_as_soon_as_it_is_made() -> None:
    clock = Clock()
    h = registry(clock)
    assert h.abandon("r1", "load refused") is False  # nothing held yet
    h.hold("r1", [1, 2, 3], 40)
    assert h.take_released() == ["r1"] and len(h) == 0
    assert h.released_by["abandoned"] == 1 and h.released_by["expired"] == 0
    h.hold("r1", [1, 2, 3], 40)  # remembered once: a later hold of the same id stays
    assert len(h) == 1


def test_an_early_abandon_is_forgotten_after_a_lease() -> None:
    clock = Clock()
    h = registry(clock, lease_s=10.0)
    h.abandon("r1", "gone")
    clock.now += 10.5
    h.hold("r1", [4], 1)
    assert h.take_released() == [] and len(h) == 1


def test_an_abandon_of_a_held_request_releases_it_at_once() -> None:
    clock = Clock()
    h = registry(clock)
    h.hold("r1", [5, 6], 20)
    assert h.abandon("r1", "gone") is True
    assert h.take_released() == ["r1"] and h.released_by["abandoned"] == 1


def test_an_abandon_over_the_side_channel_before_the_hold() -> None:
    """Real side channel: the consumer's Abandon reaches the producer before its engine holds."""
    pcfg, dcfg = make_cfg("prefill", "P"), make_cfg("decode", "D")
    prod, cons = Connector.in_process(pcfg, 0), Connector.in_process(dcfg, 0)
    try:
        prod.register_kv_caches(allocate_kv_cache(spec_from_config(pcfg), pcfg.cache.num_blocks))
        cons.register_kv_caches(allocate_kv_cache(spec_from_config(dcfg), dcfg.cache.num_blocks))
        params = prod.hold("template", [1, 2], 20)
        prod.release("template")
        prod.poll()
        late = msgspec.structs.replace(params, request_id="late")
        cons.abandon("late", late, "request aborted")
        deadline = time.monotonic() + 10
        while prod.holds is not None and "late" not in prod.holds._early_abandons:
            assert time.monotonic() < deadline, "the abandon never reached the producer"
            time.sleep(0.01)
        prod.hold("late", np.array([7, 8]), 20)
        assert prod.poll().sending == ["late"], "freed when made, not a lease later"
        assert prod.stats()["holds_abandoned"] == 1
    finally:
        cons.close()
        prod.close()


def _mla_push(tp_rank: int) -> tuple[HoldRegistry, PushTarget, KVTransferParams]:
    """Producer rank ``tp_rank`` of an MLA TP2 instance (layers 0-1 saved one by one), pushing to TP1."""
    mine = ParallelLayout(tp_size=2, pp_size=1, num_layers=2, num_kv_heads=1, mla=True)
    theirs = ParallelLayout(tp_size=1, pp_size=1, num_layers=2, num_kv_heads=1, mla=True)
    reg = HoldRegistry(mine, tp_rank, 0, 64, {0: (1024, 64 * 1024)}, 10.0, 600.0, Clock(),
                       region_layers={0: (0, 2)})
    rank = RemoteRank(rank=0, host="127.0.0.1", port=1, generation=1)
    target = PushTarget(request_id="d", engine_id="D", num_tokens=20, num_cached_tokens=0, layout=theirs,
                        ranks=[rank], lease_s=10.0)
    params = KVTransferParams(request_id="r1", engine_id="P", num_tokens=20, block_ids=[5, 6], block_size=16,
                              layout=mine, ranks=[rank], lease_s=10.0)
    return reg, target, params


def test_a_push_hold_no_target_rank_reads_is_released_as_done_once_saved() -> None:
    """MLA TP2 -> TP1: the decode rank reads the latent from one prefill rank; the other's hold is
    released as done when its last layer is saved, never sent a notice (which raced the load's
    end and was sometimes refused, releasing it as abandoned)."""
    readers = [readers_of(_mla_push(r)[0].layout, r, 0, _mla_push(r)[1].layout) for r in (0, 1)]
    assert sorted(readers) == [0, 1]
    unread = readers.index(0)
    reg, target, params = _mla_push(unread)
    reg.hold("r1", [5, 6], 20, streaming=True)
    assert reg.attach("r1", target, params) is False
    assert reg.push_state("r1") is None, "nothing to send to a target that reads nothing here"
    assert reg.save_layer("r1", 0) is False and len(reg) == 1, "held until the engine saved every layer"
    reg.save_layer("r1", 1)
    assert reg.take_released() == ["r1"] and reg.released_by["done"] == 1 and len(reg) == 0

    reg, target, params = _mla_push(1 - unread)  # the rank that is read keeps its target and its hold
    reg.hold("r1", [5, 6], 20, streaming=True)
    assert reg.attach("r1", target, params) is True
    reg.save_layer("r1", 0)
    reg.save_layer("r1", 1)
    assert reg.take_released() == [] and reg.push_state("r1") is not None


def test_a_saved_hold_attached_to_a_target_that_reads_nothing_is_released_at_once() -> None:
    reg, target, params = _mla_push(0)
    if readers_of(reg.layout, 0, 0, target.layout):
        reg, target, params = _mla_push(1)
    reg.hold("r1", [5, 6], 20)  # a pull hold: every layer counts as saved
    assert reg.attach("r1", target, params) is False
    assert reg.take_released() == ["r1"] and reg.released_by["done"] == 1


def test_a_wait_for_a_release_returns_at_the_release_and_take_released_rearms_it() -> None:
    """What an engine's poll(timeout_s) waits on when it only holds blocks (vLLM steps on while they wait)."""
    h = registry(Clock())
    woken: list[int] = []
    h.on_release = lambda: woken.append(1)
    h.hold("r1", [1, 2], 20)
    assert h.wait_released(0.0) is False and woken == []  # nothing ended
    threading.Timer(0.05, h.release, args=("r1",)).start()
    t0 = time.monotonic()
    assert h.wait_released(60.0) is True and time.monotonic() - t0 < 30, "woken by the release, not the timeout"
    assert woken == [1] and h.wait_released(0.0) is True, "set until taken"
    assert h.take_released() == ["r1"] and h.wait_released(0.0) is False


def test_a_poll_with_a_timeout_returns_when_a_hold_ends() -> None:
    """An in-process connector: a producer-only rank's poll waits on its holds; a rank that loads too
    is woken by a hold that ends as by a load that lands."""
    for role in ("prefill", "both"):
        c = Connector.in_process(make_cfg(role, f"E-{role}"), 0)
        try:
            spec = spec_from_config(c.config, 0)
            c.register_kv_caches(allocate_kv_cache(spec, c.config.cache.num_blocks))
            c.hold("r1", [1, 2], 20)
            assert c.poll(0.0).sending == []
            threading.Timer(0.05, c.release, args=("r1",)).start()
            t0 = time.monotonic()
            out = c.poll(60.0)
            assert out.sending == ["r1"] and time.monotonic() - t0 < 30, f"{role}: woken by the release"
        finally:
            c.close()
