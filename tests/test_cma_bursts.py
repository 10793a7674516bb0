"""A burst of loads copied together: ``read_many`` on the cma plane, ``start_loads`` on the connector.

Real cma planes in this process (real process_vm_readv, the producer's real hold registry and
board); the only hook is a spy on the plane's copy function, which copies for real and counts
(or, where a test says so, fails a copy or ends a hold in the middle of one).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest
import torch
from kvxfer.connectors.cma import copy_from
from test_hold_board import STRIDE, Pair

from kvxfer.connector import Connector
from kvxfer.dataplane import BatchResult, Descriptors
from kvxfer.protocol import ErrorCode
from kvxfer.supervise import code_of
from kvxfer.transfer.aggregator import Finished
from kvxfer.transfer.consumer import AlreadyLoading


def descs(remote: list[int], local: list[int]) -> Descriptors:
    n = len(remote)
    return Descriptors(np.zeros(n, np.int64), np.array(remote, np.int64) * STRIDE, np.zeros(n, np.int64),
                       np.array(local, np.int64) * STRIDE, np.full(n, STRIDE, np.int64))


def read_many(p: Pair, reads: list[tuple[str, list[int], list[int]]]) -> list[BatchResult]:
    ids = p.consumer.read_many([("p", rid, descs(r, loc)) for rid, r, loc in reads])
    got: dict[int, BatchResult] = {}
    deadline = time.monotonic() + 10
    while len(got) < len(ids) and time.monotonic() < deadline:
        for res in p.consumer.poll():
            got[res.batch_id] = res
        time.sleep(0.001)
    assert len(got) == len(ids), "not every read finished within 10 s"
    return [got[i] for i in ids]


class CopySpy:
    """The plane's copy_from, for real, counting calls by their pieces; ``during`` runs after a
    joint copy (more than one read's pieces), ``fail_if`` makes a call raise instead."""

    def __init__(self, during: Callable[[], None] | None = None,
                 fail_if: Callable[[np.ndarray], bool] | None = None) -> None:
        self.calls: list[int] = []  # pieces per call
        self.during = during
        self.fail_if = fail_if
        self.error: type[Exception] = OSError

    def __call__(self, pid: int, local: np.ndarray, remote: np.ndarray, keep_gil: bool = False,
                 nbytes: int | None = None) -> None:
        self.calls.append(len(local))
        if self.fail_if is not None and self.fail_if(local):
            raise self.error("process_vm_readv: injected")
        copy_from(pid, local, remote, keep_gil=keep_gil, nbytes=nbytes)
        if self.during is not None and len(local) > 2:
            self.during()


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[Pair, CopySpy]]]:
    import kvxfer.connectors.cma as cma

    made: list[Pair] = []

    def make(**kw: Callable[..., object]) -> tuple[Pair, CopySpy]:
        spy = CopySpy(**kw)  # type: ignore[arg-type]
        monkeypatch.setattr(cma, "copy_from", spy)
        p = Pair()
        spy.calls.clear()  # the probe connect() reads
        made.append(p)
        return p, spy

    yield make
    for p in made:
        p.close()


def test_reads_the_board_allows_are_copied_in_one_call_and_reported_each(spied) -> None:
    p, spy = spied()
    p.holds.hold("a", [1, 2], 32)
    p.holds.hold("b", [3], 16)
    res = read_many(p, [("a", [2, 1], [10, 11]), ("b", [3], [12]), ("c", [4], [13]), ("a", [5], [14])])
    assert [r.ok for r in res] == [True, True, False, False]
    assert res[0].nbytes == 2 * STRIDE and res[1].nbytes == STRIDE
    assert res[2].code is ErrorCode.NOT_HELD  # no hold: asked the producer, which refused it
    assert res[3].code is ErrorCode.OUT_OF_BOUNDS and "not held for it" in (res[3].error or "")
    assert p.arrived([2, 1, 3], [10, 11, 12])
    assert not p.dst[13 * STRIDE:15 * STRIDE].any(), "a refused read wrote nothing"
    assert spy.calls == [3], "the two allowed reads were not copied in one call"
    assert (p.consumer.one_sided_reads, p.consumer.granted_reads) == (2, 2)


def test_a_failed_joint_copy_is_done_again_read_by_read(spied) -> None:
    """The joint copy fails; each read is then copied alone and fails (or not) for itself."""
    bad: list[int] = []
    p, spy = spied(fail_if=lambda local: bool(np.isin(bad, local[:, 0]).any()))
    bad.append(p.dst.ctypes.data + 12 * STRIDE)  # the local address read "b" writes
    p.holds.hold("a", [1, 2], 32)
    p.holds.hold("b", [3], 16)
    p.holds.hold("c", [4], 16)
    res = read_many(p, [("a", [1, 2], [10, 11]), ("b", [3], [12]), ("c", [4], [13])])
    assert [r.ok for r in res] == [True, False, True]
    assert "injected" in (res[1].error or "")
    assert p.arrived([1, 2, 4], [10, 11, 13])
    assert spy.calls == [4, 2, 1, 1]  # the joint copy, then one per read


def test_a_joint_copy_that_times_out_fails_every_read_of_it(spied) -> None:
    """A helper past the time limit may still be copying: no read of that copy is done again
    (and so reported ok) while it might still write."""
    p, spy = spied(fail_if=lambda local: len(local) > 2)
    spy.error = TimeoutError
    p.holds.hold("a", [1, 2], 32)
    p.holds.hold("b", [3], 16)
    res = read_many(p, [("a", [1, 2], [10, 11]), ("b", [3], [12])])
    assert [r.ok for r in res] == [False, False] and all("injected" in (r.error or "") for r in res)
    assert spy.calls == [3]


def test_a_hold_ended_during_a_joint_copy_fails_only_its_read(spied) -> None:
    holder: list[Pair] = []

    def end_b() -> None:
        holder[0].holds.release("b")

    p, spy = spied(during=end_b)
    holder.append(p)
    p.holds.hold("a", [1, 2], 32)
    p.holds.hold("b", [3, 4], 32)
    res = read_many(p, [("a", [1, 2], [10, 11]), ("b", [3, 4], [12, 13])])
    assert res[0].ok and p.arrived([1, 2], [10, 11])
    assert not res[1].ok and res[1].code is ErrorCode.NOT_HELD and "ended while it was read" in (res[1].error or "")
    assert spy.calls == [4]


def test_start_loads_begins_a_burst_together_and_refuses_each_bad_load_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In the engine's process: the valid loads of a burst are read in one copy and arrive
    bit-exact; a bad one and a duplicate are refused at their places, changing nothing.

    The fast path yields to a worker turn in progress (it never waits for one), and the
    worker wakes on its own every 50 ms, so a burst may meet one and be begun load by load;
    such a burst is checked the same and made again (at most 3 bursts)."""
    import kvxfer.connectors.cma as cma
    from test_agent import NB, cfg, make, wait_for

    p, pt = make(cfg("prefill", "cma", data_path="engine"), fill=5)
    c, ct = make(cfg("decode", "cma", data_path="engine"))
    assert isinstance(c, Connector)
    try:
        params = p.hold("warm", [1], 16)  # the handshake, so the burst takes the fast path
        c.start_load("warm", params, [2])
        assert "warm" in wait_for(c, "warm").receiving
        copies = []
        for attempt in range(3):
            spy = CopySpy()
            monkeypatch.setattr(cma, "copy_from", spy)
            loads = {f"r{attempt}-{i}": ([3 + 2 * i, 4 + 2 * i], [30 + 2 * i, 31 + 2 * i]) for i in range(3)}
            for b in ct:
                b.zero_()
            burst = [(rid, p.hold(rid, src, 32), dst, 0) for rid, (src, dst) in loads.items()]
            bad = f"bad{attempt}"
            burst.insert(1, (bad, p.hold(bad, [20], 16), [NB + 5], 0))  # no such local block
            burst.append((burst[0][0], burst[0][1], [40, 41], 0))  # already loading
            errors = c.start_loads(burst)
            assert [type(e) for e in errors] == [type(None), ValueError, type(None), type(None), AlreadyLoading]
            assert "block" in str(errors[1])
            p.release(bad)
            out = Finished()
            for rid in loads:
                if rid not in out.receiving:
                    out.extend(wait_for(c, rid))
            assert set(loads) <= set(out.receiving) and not out.failed, out.errors
            for src, dst in loads.values():
                for a, b in zip(pt, ct, strict=True):
                    assert torch.equal(a[src].view(torch.uint8), b[dst].view(torch.uint8))
            assert not any(b[40:42].view(torch.uint8).any() for b in ct), "the duplicate wrote nothing"
            copies.append(len(spy.calls))
            if copies[-1] == 1:
                break
        assert copies[-1] == 1, f"no burst was copied in one call: {copies} calls"
    finally:
        c.close()
        p.close()


@pytest.mark.parametrize("data_path", ["engine", "agent"])
def test_a_burst_of_loads_arrives_bit_exact(data_path: str) -> None:
    """Loads started back to back (the agent starts what queued on its channel as one burst),
    with parts cut across helpers: every block arrives bit-exact."""
    from test_agent import cfg, make

    dcfg = cfg("decode", "cma", data_path=data_path)
    dcfg = msgspec.structs.replace(dcfg, connector=msgspec.structs.replace(
        dcfg.connector, data_plane={"inline_copy_bytes": 0, "copy_threads": 1}))
    p, pt = make(cfg("prefill", "cma", data_path=data_path), fill=7)
    c, ct = make(dcfg)
    try:
        for rnd in range(3):
            loads = {f"r{rnd}-{i}": ([1 + 3 * i, 2 + 3 * i], [40 + 2 * i, 41 + 2 * i]) for i in range(8)}
            for a in ct:
                a.zero_()
            burst = [(rid, p.hold(rid, src, 32), dst, 0) for rid, (src, dst) in loads.items()]
            if isinstance(c, Connector):  # in the engine's process: the burst handed over as one
                assert c.start_loads(burst) == [None] * len(burst)
            else:  # the agent starts what queued on its channel as one burst
                for rid, params, dst, _ in burst:
                    c.start_load(rid, params, dst)
            done: set[str] = set()
            deadline = time.monotonic() + 30
            while len(done) < len(loads) and time.monotonic() < deadline:
                out = c.poll(0.05)
                assert not out.failed, out.errors
                done.update(out.receiving)
            assert done == set(loads)
            for src, dst in loads.values():
                for a, b in zip(pt, ct, strict=True):
                    assert torch.equal(a[src].view(torch.uint8), b[dst].view(torch.uint8))
    finally:
        c.close()
        p.close()


def test_a_plane_whose_read_many_raises_fails_every_load_of_the_burst_with_its_blocks() -> None:
    """The plane raises for the whole burst: each load fails at once with its own block ids
    and the plane's code (not at its deadline), and the next burst loads."""
    from faultplane import FaultyCmaPlane
    from test_agent import NB, cfg, make, wait_for

    from kvxfer.cache import allocate_kv_cache, spec_from_config

    p, pt = make(cfg("prefill", "cma", data_path="engine"), fill=9)
    dcfg = cfg("decode", "cma", data_path="engine")
    plane = FaultyCmaPlane({"fault_at": "read", "fault_exc": "OSError"})
    c = Connector(dcfg, 0, plane)
    cache = allocate_kv_cache(spec_from_config(dcfg), NB)
    c.register_kv_caches(cache)
    try:
        plane.pending = []  # the warm-up load (the handshake) reads without a fault
        params = p.hold("warm", [1], 16)
        c.start_load("warm", params, [2])
        assert "warm" in wait_for(c, "warm").receiving
        for attempt in range(3):  # a burst the fast path yielded to the worker reads one by one
            plane.pending = [OSError]
            loads = {f"f{attempt}-{i}": ([3 + 2 * i, 4 + 2 * i], [20 + 2 * i, 21 + 2 * i]) for i in range(3)}
            assert c.start_loads([(rid, p.hold(rid, src, 32), dst, 0) for rid, (src, dst) in loads.items()]) \
                == [None] * 3
            out = Finished()
            for rid in loads:
                if rid not in out.failed and rid not in out.receiving:
                    out.extend(wait_for(c, rid))
            if plane.fired and len(out.failed) == 3:
                break
        assert set(out.failed) == set(loads), (out.receiving, out.errors)
        for rid, (_, dst) in loads.items():
            assert out.failed[rid] == dst and "injected OSError" in out.errors[rid]
            assert out.codes[rid] is code_of(OSError())
        assert c.stats()["load_timeouts"] == 0
        params = p.hold("after", [5, 6], 32)
        c.start_loads([("after", params, [50, 51], 0), ("after2", p.hold("after2", [7], 16), [52], 0)])
        out = wait_for(c, "after")
        if "after2" not in out.receiving:
            out.extend(wait_for(c, "after2"))
        assert {"after", "after2"} <= set(out.receiving), out.errors
        for a, b in zip(pt, cache.tensors, strict=True):
            assert torch.equal(a[[5, 6, 7]].view(torch.uint8), b[[50, 51, 52]].view(torch.uint8))
    finally:
        c.close()
        p.close()
