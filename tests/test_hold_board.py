"""The hold board: holds a producer publishes so that a one-sided reader (cma) checks a read itself.

The board's rows and the reader's checks are read through real process_vm_readv (the cma
plane's copy_from, on this process); the planes at the end are two real cma planes in one
process, the producer's holds kept by a real HoldRegistry.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import msgspec
import numpy as np
import pytest
import torch
from kvxfer.connectors.cma import CmaDataPlane, copy_from
from kvxfer.connectors.cma.copier import cut

from kvxfer.cache.tensors import MemoryRegion
from kvxfer.dataplane import BatchResult, Descriptors
from kvxfer.protocol import ErrorCode
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.hold_board import (
    WINDOW,
    HoldBoard,
    blocks_held,
    check_blocks,
    check_one_sided,
    key_of,
    row_unchanged,
)
from kvxfer.transfer.producer import HoldRegistry

STRIDE = 4096
NB = 32


def read_at(address: int, nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    copy_from(os.getpid(), np.array([[buf.ctypes.data, nbytes]], dtype=np.uint64),
              np.array([[address, nbytes]], dtype=np.uint64))
    return buf


def ranges(blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
    b = np.array(blocks, dtype=np.int64)
    return b, b


def test_a_published_hold_allows_reads_of_its_blocks_only() -> None:
    board = HoldBoard(slots=64)
    at = (board.address, board.rows)
    assert board.publish("r1", np.array([3, 4, 9]))
    row = check_one_sided(read_at, at, "r1", *ranges([3, 9]))
    assert row is not None and row[0] == key_of("r1")
    assert check_one_sided(read_at, at, "r1", np.array([3]), np.array([5])) is None  # 5 is not held
    assert check_one_sided(read_at, at, "r1", *ranges([10])) is None
    assert check_one_sided(read_at, at, "r2", *ranges([3])) is None  # not published
    assert check_one_sided(read_at, at, "r1", np.array([3]), np.array([4])) is not None  # a run of 3..4
    assert row_unchanged(read_at, at, row)


def test_a_row_changed_after_the_check_voids_the_copy() -> None:
    """Withdrawn, or withdrawn and published again for the same id (a new ticket): the reader's
    second look fails either way."""
    board = HoldBoard(slots=64)
    at = (board.address, board.rows)
    board.publish("r", np.array([1, 2]))
    row = check_one_sided(read_at, at, "r", *ranges([1, 2]))
    assert row is not None
    board.withdraw("r")
    assert not row_unchanged(read_at, at, row)
    assert check_one_sided(read_at, at, "r", *ranges([1])) is None
    board.publish("r", np.array([1, 2]))
    assert not row_unchanged(read_at, at, row)
    again = check_one_sided(read_at, at, "r", *ranges([1]))
    assert again is not None and again[1] != row[1]


BOARD_PROC = """
import json, sys
import numpy as np
from kvxfer.transfer.hold_board import HoldBoard
b = HoldBoard(slots=64)
b.publish("short", np.array([3, 9, 4]))            # its ids inline, in the board's file
b.publish("long", np.arange(100, 160))              # its ids in the producer's heap
print(json.dumps([b.fd, b.address, b.rows]), flush=True)
for line in sys.stdin:
    if line.strip() == "withdraw":
        b.withdraw("short")
        print("ok", flush=True)
"""


def test_a_mapped_board_answers_as_process_vm_readv_and_refuses_once_its_producer_exited() -> None:
    """A board in another process, mapped here (its file), read the way the cma plane reads it:
    the same rows and answers as process_vm_readv; a withdrawn row fails the recheck; and once the
    producer was killed, the recheck (process_vm_readv, as the planes make it) refuses though the
    mapping still shows its rows (its engine may reuse the blocks)."""
    import json
    import subprocess
    import sys

    from kvxfer.connectors.cma.mapped import RegionFile, map_board
    from kvxfer.connectors.cma.memory import Peeker

    from kvxfer.transfer.hold_board import board_bytes

    proc = subprocess.Popen([sys.executable, "-c", BOARD_PROC], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        fd, address, rows = json.loads(proc.stdout.readline())
        st = os.stat(f"/proc/{proc.pid}/fd/{fd}")
        peek = Peeker(proc.pid)
        fm, mapped = map_board(proc.pid, RegionFile(fd=fd, dev=st.st_dev, ino=st.st_ino, offset=0), address,
                               board_bytes(rows), peek)
        at = (address, rows)
        for rid, ok, bad in (("short", [3, 4, 9], [5]), ("long", [100, 159], [160])):
            for reader in (peek, mapped):
                row = check_one_sided(reader, at, rid, *ranges(ok))
                assert row is not None and row_unchanged(reader, at, row)
                assert check_one_sided(reader, at, rid, *ranges(bad)) is None
                assert check_blocks(reader, at, rid, set(ok)) is not None
                assert check_blocks(reader, at, rid, set(ok + bad)) is None
        assert np.array_equal(mapped(address, rows * 32), peek(address, rows * 32))
        row = check_blocks(mapped, at, "short", {3})
        assert row is not None
        proc.stdin.write("withdraw\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ok"
        assert not row_unchanged(mapped, at, row) and check_blocks(mapped, at, "short", {3}) is None
        row = check_blocks(mapped, at, "long", {100})
        assert row is not None
        proc.kill()  # SIGKILL: no exit handler clears its board
        proc.wait(timeout=30)
        # the mapping still shows the row (a check through it may pass); the producer is gone: the
        # recheck, a read of its own memory, fails, so no read may stand
        assert mapped._bytes is not None and int(mapped._bytes[: rows * 32].view(np.int64).reshape(rows, 4)[
            int(row[4]), 1]) == int(row[1])
        assert check_blocks(mapped, at, "long", {100}) is None or not row_unchanged(peek, at, row)
        assert not row_unchanged(peek, at, row)
        mapped.close()
        fm.unmap()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_hold_withdrawn_while_a_mapped_reader_looks_at_its_row_never_passes_the_recheck() -> None:
    """A mapped reader's reads are views of live memory: the row it keeps must be the one it
    checked. Here the hold is withdrawn just after the reader's snapshot of the window (the ticket
    it saw cleared, the ids left beside the row): the read may be allowed, but never stand."""
    from kvxfer.dataplane import address_view

    board = HoldBoard(slots=64)
    at = (board.address, board.rows)
    board.publish("r", np.array([3, 4]))
    withdrawn: list[bool] = []

    class Racing(np.ndarray):
        def tolist(self):  # type: ignore[no-untyped-def,override]
            out = super().tolist()
            if not withdrawn:
                board.withdraw("r")
                withdrawn.append(True)
            return out

    def live(address: int, nbytes: int) -> np.ndarray:
        return np.frombuffer(address_view(address, nbytes), dtype=np.uint8).view(Racing)

    for check in (lambda: check_blocks(live, at, "r", {3}), lambda: check_one_sided(live, at, "r", *ranges([3]))):
        withdrawn.clear()
        board.publish("r", np.array([3, 4]))
        row = check()
        assert withdrawn and (row is None or not row_unchanged(live, at, row))
    board.close()


def test_check_blocks_answers_as_check_one_sided_for_pieces_inside_one_block() -> None:
    rng = np.random.default_rng(5)
    board = HoldBoard(slots=64)
    at = (board.address, board.rows)
    for i in range(200):
        held = rng.integers(0, 60, int(rng.integers(1, 50)))  # short and long holds, unsorted, repeats
        board.publish(f"r{i}", held)
        blocks = rng.integers(0, 60, int(rng.integers(1, 6)))
        one_sided = check_one_sided(read_at, at, f"r{i}", blocks, blocks)
        by_blocks = check_blocks(read_at, at, f"r{i}", set(blocks.tolist()))
        assert (one_sided is None) == (by_blocks is None)
        assert one_sided is None or np.array_equal(one_sided, by_blocks)
        board.withdraw(f"r{i}")
    board.close()


def test_a_full_window_leaves_the_hold_unpublished() -> None:
    board = HoldBoard(slots=1)  # every id hashes to row 0: WINDOW rows in all
    for i in range(WINDOW):
        assert board.publish(f"r{i}", np.array([i]))
    assert not board.publish("late", np.array([1]))
    assert board.full == 1 and len(board) == WINDOW
    assert check_one_sided(read_at, (board.address, board.rows), "late", *ranges([1])) is None
    board.withdraw("r0")
    assert board.publish("late", np.array([1]))


def test_garbage_block_ids_are_refused_without_allocating_by_their_values() -> None:
    """A reader racing a release may read freed memory as block ids: the check says no (and the
    read asks for a grant), whatever the values, with no allocation sized by them."""
    huge = np.array([2**62, -5, 2**40], dtype=np.int64)  # unsorted garbage: an answer, no crash
    assert not blocks_held(np.array([3]), np.array([3]), huge)
    blocks_held(np.array([-(2**62)]), np.array([2**62]), huge)
    assert blocks_held(np.array([2**40]), np.array([2**40]), np.sort(huge))
    assert blocks_held(np.array([4]), np.array([6]), np.array([4, 5, 6]))
    assert not blocks_held(np.array([4]), np.array([7]), np.array([4, 5, 6]))
    board = HoldBoard(slots=64)
    ids = np.array([6, 4, 5, 5], dtype=np.int64)
    board.publish("r", ids)
    ids[:] = [7, 8, 9, 10]  # the caller's array changes: the board kept its own (sorted, unique)
    assert check_one_sided(read_at, (board.address, board.rows), "r", *ranges([4, 5, 6])) is not None
    assert check_one_sided(read_at, (board.address, board.rows), "r", *ranges([7])) is None


def registry(clock: list[float]) -> HoldRegistry:
    layout = ParallelLayout(tp_size=1, pp_size=1, num_layers=1, num_kv_heads=1)
    return HoldRegistry(layout, 0, 0, NB, {0: (STRIDE, NB * STRIDE)}, 1.0, 600.0, lambda: clock[0],
                        region_layers={0: (0, 1)})


def test_the_registry_publishes_pull_holds_and_withdraws_every_ended_one_before_the_engine_hears() -> None:
    clock = [0.0]
    holds = registry(clock)
    board = HoldBoard(slots=64)
    seen: list[tuple[str, bool]] = []

    def on_change(rid: str, ids: np.ndarray | None) -> None:
        seen.append((rid, ids is not None))
        if ids is None:
            board.withdraw(rid)
            assert rid not in holds._released, "withdrawn after the engine could free the blocks"
        else:
            board.publish(rid, ids)

    holds.on_change = on_change
    holds.hold("pull", [1, 2], 20)
    holds.hold("push", [3], 10, streaming=True)  # a push hold's layers are not all saved: not published
    holds.hold("gone", [4], 10)
    assert seen == [("pull", True), ("gone", True)] and len(board) == 2
    holds.abandon("gone", "test")
    holds.release("push")
    clock[0] = 5.0
    holds.expire()
    assert sorted(seen[2:]) == [("gone", False), ("pull", False), ("push", False)]
    assert len(board) == 0 and sorted(holds.take_released()) == ["gone", "pull", "push"]


def test_a_failing_on_change_neither_raises_nor_loses_a_release() -> None:
    holds = registry([0.0])

    def broken(rid: str, ids: np.ndarray | None) -> None:
        raise RuntimeError("a bug in a plane's hook")

    holds.on_change = broken
    holds.hold("r", [1], 10)
    assert holds.release("r")
    assert holds.take_released() == ["r"]


class Pair:
    """A producer and a consumer cma plane in this process; the producer's holds in a registry."""

    def __init__(self, one_sided: bool = True, consumer_options: dict[str, object] | None = None,
                 src: np.ndarray | None = None) -> None:
        self.src = np.random.default_rng(0).integers(0, 255, NB * STRIDE, dtype=np.uint8) if src is None else src
        self.dst = np.zeros(NB * STRIDE, dtype=np.uint8)
        self.producer = CmaDataPlane({"one_sided": one_sided})
        self.consumer = CmaDataPlane(consumer_options)  # type: ignore[arg-type]
        self.producer.register([region(0, self.src)])
        self.consumer.register([region(0, self.dst)])
        self.holds = registry([0.0])
        self.holds.on_change = self.producer.hold_changed
        self.producer.set_read_validator(self.holds.validate)
        self.consumer.connect("p", self.producer.address())

    def read(self, request_id: str, remote: list[int], local: list[int]) -> BatchResult:
        n = len(remote)
        d = Descriptors(np.zeros(n, np.int64), np.array(remote, np.int64) * STRIDE, np.zeros(n, np.int64),
                        np.array(local, np.int64) * STRIDE, np.full(n, STRIDE, np.int64))
        batch = self.consumer.read("p", request_id, d)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for r in self.consumer.poll():
                assert r.batch_id == batch
                return r
            time.sleep(0.001)
        raise AssertionError("no result within 10 s")

    def arrived(self, remote: list[int], local: list[int]) -> bool:
        return all(np.array_equal(self.src[r * STRIDE:(r + 1) * STRIDE], self.dst[i * STRIDE:(i + 1) * STRIDE])
                   for r, i in zip(remote, local, strict=True))

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()


def region(rid: int, a: np.ndarray) -> MemoryRegion:
    return MemoryRegion(region_id=rid, address=a.ctypes.data, length=a.nbytes, block_stride=STRIDE, num_blocks=NB,
                        layers=(0, 1), kind="KV")


@pytest.fixture
def pair() -> Pair:
    p = Pair()
    yield p
    p.close()


def test_cma_reads_a_published_hold_one_sided_and_asks_for_anything_else(pair: Pair) -> None:
    pair.holds.hold("r", [5, 6, 7], 48)
    res = pair.read("r", [7, 5], [1, 2])
    assert res.ok and res.nbytes == 2 * STRIDE and pair.arrived([7, 5], [1, 2])
    assert (pair.consumer.one_sided_reads, pair.consumer.granted_reads) == (1, 0)
    assert pair.holds.refused_reads == 0  # the producer was not asked

    res = pair.read("r", [5, 8], [3, 4])  # block 8 is not held: the producer refuses it, by name
    assert not res.ok and res.code is ErrorCode.OUT_OF_BOUNDS and "not held for it" in (res.error or "")
    res = pair.read("other", [5], [3])
    assert not res.ok and res.code is ErrorCode.NOT_HELD
    assert pair.consumer.granted_reads == 2 and pair.holds.refused_reads == 2
    assert not pair.dst[3 * STRIDE:5 * STRIDE].any(), "a refused read wrote nothing"

    pair.holds.release("r")
    res = pair.read("r", [7], [6])
    assert not res.ok and res.code is ErrorCode.NOT_HELD and not pair.dst[6 * STRIDE:7 * STRIDE].any()


def test_a_closed_producer_allows_no_one_sided_read(pair: Pair) -> None:
    pair.holds.hold("r", [5], 16)
    pair.producer.close()
    one = np.ones(1, np.int64)
    pair.consumer.read("p", "r", Descriptors(0 * one, 5 * STRIDE * one, 0 * one, STRIDE * one, STRIDE * one))
    # a one-sided read would have copied inside read(); this one waits for a grant nobody sends
    assert pair.consumer.one_sided_reads == 0 and pair.consumer.granted_reads == 1
    assert not pair.dst[STRIDE:2 * STRIDE].any()


def test_a_producer_without_the_board_grants_every_read() -> None:
    p = Pair(one_sided=False)
    try:
        p.holds.hold("r", [1, 2], 32)
        res = p.read("r", [1, 2], [9, 10])
        assert res.ok and p.arrived([1, 2], [9, 10])
        assert (p.consumer.one_sided_reads, p.consumer.granted_reads) == (0, 1)
    finally:
        p.close()


def test_one_sided_option_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="one_sided: expected true or false"):
        CmaDataPlane({"one_sided": "yes"})


@pytest.mark.parametrize("inline", [True, False])
def test_a_small_cma_load_from_a_known_producer_is_done_when_start_load_returns(inline: bool) -> None:
    """The consumer's fast path: a load of at most inline_load_bytes, from a producer rank it has
    handshaken, begins on the caller's thread, and cma copies one-sided there. So it is done, bit
    for bit, by the time start_load returns. With inline_load_bytes 0 the worker thread does it."""
    from test_agent import cfg, make

    dcfg = cfg("decode", "cma", data_path="engine")
    dcfg = msgspec.structs.replace(dcfg, connector=msgspec.structs.replace(
        dcfg.connector, inline_load_bytes=(16 << 20) if inline else 0))
    p, pt = make(cfg("prefill", "cma", data_path="engine"), fill=1)
    c, ct = make(dcfg)
    consumer = c.consumer
    assert consumer is not None
    began_on: list[str] = []
    real_begin = consumer._begin

    def begin(load: object) -> None:
        began_on.append(threading.current_thread().name)
        real_begin(load)  # type: ignore[arg-type]

    consumer._begin = begin  # type: ignore[method-assign]
    try:
        first = p.hold("first", [1], 16)  # the first load from a producer handshakes: on the worker
        c.start_load("first", first, [2])
        deadline = time.monotonic() + 10
        while "first" not in c.poll(0.05).receiving:
            assert time.monotonic() < deadline, "the first load did not finish"
        assert began_on == [f"kvxfer-consumer-{c.rank}"]
        done_at_once = 0
        for i in range(5):
            params = p.hold(f"r{i}", [5 + i, 20 + i], 32)
            c.start_load(f"r{i}", params, [40 + i, 30 + i])
            done_at_once += c.poll().receiving == [f"r{i}"]
            deadline = time.monotonic() + 10
            while not consumer._outcomes.get(f"r{i}"):
                c.poll(0.05)
                assert time.monotonic() < deadline, f"r{i} did not finish"
            for a, b in zip(pt, ct, strict=True):
                assert torch.equal(a[[5 + i, 20 + i]].view(torch.uint8), b[[40 + i, 30 + i]].view(torch.uint8))
        here = sum(name == threading.current_thread().name for name in began_on[1:])
        if inline:  # the worker's turn (every 50 ms, microseconds long) may hold its lock once in a while
            assert here >= 4 and done_at_once >= 4, began_on
        else:
            assert here == 0 and done_at_once == 0, began_on
    finally:
        c.close()
        p.close()


# ---------------------------------------------------------------- copy threads (connectors/cma/copier.py)
def test_cut_gives_parts_of_about_equal_bytes_covering_every_piece_once() -> None:
    lengths = np.array([4, 4, 4, 4, 4, 4, 4, 4], np.int64)
    assert cut(lengths, 2) == [(0, 4), (4, 8)]
    assert cut(lengths, 1) == [(0, 8)]
    assert cut(lengths[:1], 4) == [(0, 1)]  # never more parts than pieces, none empty
    uneven = np.array([100, 1, 1, 1, 1, 100], np.int64)
    parts = cut(uneven, 3)
    assert parts[0][0] == 0 and parts[-1][1] == 6 and all(a < b for a, b in parts)
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(parts))  # contiguous, no gap or overlap
    assert len(parts) <= 3


class Gate:
    """A copy function that waits for the test before copying (the helpers' collaborator)."""

    def __init__(self, open_: bool = False) -> None:
        self.go = threading.Event()
        if open_:
            self.go.set()
        self.started = threading.Event()
        self.calls: list[tuple[str, int]] = []  # (thread, bytes) of each part

    def __call__(self, pid: int, local: np.ndarray, remote: np.ndarray, nbytes: int) -> None:
        self.calls.append((threading.current_thread().name, nbytes))
        self.started.set()
        assert self.go.wait(10), "the test never let the copy go"
        copy_from(pid, local, remote, nbytes=nbytes)


def helper_pair(monkeypatch: pytest.MonkeyPatch, gate: Gate | None, threads: int = 1) -> Pair:
    """A Pair whose consumer cuts every copy into one part per copying thread (inline_copy_bytes
    0), with ``threads`` copy helpers beside the reading thread."""
    import kvxfer.connectors.cma as cma

    if gate is not None:
        monkeypatch.setattr(cma, "_copy_part", gate)
    return Pair(consumer_options={"copy_threads": threads, "inline_copy_bytes": 0})


def test_a_copy_larger_than_inline_copy_bytes_is_cut_into_parts_and_arrives_bit_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(open_=True)
    p = helper_pair(monkeypatch, gate, threads=2)
    try:
        p.holds.hold("r", list(range(12)), 12 * 16)
        remote, local = list(range(12))[::-1], list(range(12, 24))
        res = p.read("r", remote, local)  # done when read() returns: one-sided, on this thread
        assert res.ok and res.nbytes == 12 * STRIDE and p.arrived(remote, local)
        assert sorted(n for _, n in gate.calls) == [4 * STRIDE] * 3  # three parts: this thread and two helpers
        assert (p.consumer.one_sided_reads, p.consumer.granted_reads) == (1, 0)
    finally:
        p.close()


def test_a_read_whose_helpers_never_come_is_copied_whole_by_the_reading_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Helpers without a core (a busy machine) take nothing: the reading thread takes every part."""
    gate = Gate(open_=True)
    p = helper_pair(monkeypatch, gate, threads=2)
    helpers = p.consumer._helpers
    assert helpers is not None
    for _ in helpers._workers:  # the helpers stop (a queue swapped under them raced a helper still starting)
        helpers._offers.put(None)
    for t in helpers._workers:
        t.join(10)
        assert not t.is_alive()
    try:
        p.holds.hold("r", [1, 2, 3, 4], 64)
        res = p.read("r", [1, 2, 3, 4], [5, 6, 7, 8])
        assert res.ok and p.arrived([1, 2, 3, 4], [5, 6, 7, 8])
        assert [t for t, _ in gate.calls] == [threading.current_thread().name] * 3
    finally:
        p.close()


def gated_read(p: Pair, gate: Gate, rid: str, remote: list[int], local: list[int]
               ) -> tuple[threading.Thread, list[BatchResult]]:
    """Start ``p.read`` on a thread of its own; returns once its first part waits at the gate."""
    p.holds.hold(rid, remote, 16 * len(remote))
    results: list[BatchResult] = []
    reader = threading.Thread(target=lambda: results.append(p.read(rid, remote, local)))
    reader.start()
    assert gate.started.wait(10)
    return reader, results


def test_a_hold_released_during_a_cut_copy_fails_the_read(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate()
    p = helper_pair(monkeypatch, gate)
    try:
        reader, results = gated_read(p, gate, "r", [3, 4], [8, 9])
        assert p.holds.release("r")
        gate.go.set()
        reader.join(15)
        assert len(results) == 1 and not results[0].ok and results[0].code is ErrorCode.NOT_HELD
    finally:
        gate.go.set()
        p.close()


def test_disconnect_waits_for_a_cut_copy_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate()
    p = helper_pair(monkeypatch, gate)
    try:
        reader, results = gated_read(p, gate, "a", [1, 2], [10, 11])
        returned = threading.Event()
        t = threading.Thread(target=lambda: (p.consumer.disconnect("p"), returned.set()))
        t.start()
        assert not returned.wait(0.3), "disconnect returned while a copy from the peer was in progress"
        gate.go.set()
        assert returned.wait(10)
        reader.join(10)
        assert results[0].ok and p.arrived([1, 2], [10, 11])  # begun before the disconnect: finished
    finally:
        gate.go.set()
        p.close()


def test_a_failing_part_fails_the_read_once_every_part_taken_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    lock = threading.Lock()

    def second_fails(pid: int, local: np.ndarray, remote: np.ndarray, nbytes: int) -> None:
        with lock:
            calls.append(nbytes)
            n = len(calls)
        if n == 2:
            raise OSError("process_vm_readv: injected")
        copy_from(pid, local, remote, nbytes=nbytes)

    p = helper_pair(monkeypatch, None, threads=1)
    assert p.consumer._helpers is not None
    monkeypatch.setattr(p.consumer._helpers, "_copy", second_fails)
    try:
        p.holds.hold("r", [1, 2, 3, 4], 64)
        res = p.read("r", [1, 2, 3, 4], [5, 6, 7, 8])
        assert not res.ok and "injected" in (res.error or "")
        # every part is done when read() returns (p.read polled it): a second report would be here now
        assert p.consumer.poll() == [], "a read cut in parts was reported twice"
    finally:
        p.close()


def test_a_failing_recheck_fails_the_read(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvxfer.connectors.cma as cma

    def broken(*args: object) -> bool:
        raise RuntimeError("a bug in the recheck")

    p = helper_pair(monkeypatch, None)
    monkeypatch.setattr(cma, "row_unchanged", broken)
    try:
        p.holds.hold("r", [1, 2], 32)
        res = p.read("r", [1, 2], [3, 4])
        assert not res.ok and res.code is ErrorCode.INTERNAL and "a bug in the recheck" in (res.error or "")
    finally:
        p.close()


def test_closed_helpers_leave_the_reading_thread_to_copy_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(open_=True)
    p = helper_pair(monkeypatch, gate, threads=2)
    assert p.consumer._helpers is not None
    p.consumer._helpers.close()
    try:
        p.holds.hold("r", [1, 2], 32)
        res = p.read("r", [1, 2], [3, 4])
        assert res.ok and p.arrived([1, 2], [3, 4])
        assert [t for t, _ in gate.calls] == [threading.current_thread().name] * 2
    finally:
        p.close()


@pytest.mark.parametrize(("options", "says"), [
    ({"copy_threads": "2"}, "copy_threads: expected an integer from 0 to 64"),
    ({"copy_threads": -1}, "copy_threads: expected an integer from 0 to 64"),
    ({"copy_threads": True}, "copy_threads: expected an integer from 0 to 64"),
    ({"inline_copy_bytes": -5}, "inline_copy_bytes: expected an integer >= 0"),
    ({"inline_copy_bytes": 1.5}, "inline_copy_bytes: expected an integer >= 0"),
])
def test_copy_options_are_checked_by_name(options: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        CmaDataPlane(options)  # type: ignore[arg-type]


def test_copy_threads_zero_copies_whole_on_the_reading_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    p = helper_pair(monkeypatch, None, threads=0)
    try:
        p.holds.hold("r", [5, 6], 32)
        res = p.read("r", [5, 6], [1, 2])
        assert res.ok and p.arrived([5, 6], [1, 2]) and p.consumer._helpers is None
    finally:
        p.close()


@pytest.mark.parametrize("data_path", ["engine", "agent"])
def test_loads_cut_into_parts_arrive_bit_exact_through_the_connector(data_path: str) -> None:
    from test_agent import cfg, make, wait_for

    dcfg = cfg("decode", "cma", data_path=data_path)
    dcfg = msgspec.structs.replace(dcfg, connector=msgspec.structs.replace(
        dcfg.connector, data_plane={"inline_copy_bytes": 0, "copy_threads": 2}))
    p, pt = make(cfg("prefill", "cma", data_path=data_path), fill=3)
    c, ct = make(dcfg)
    try:
        for i in range(6):
            src, dst = [1 + i, 30 - i, 12 + i], [40 + i, 20 + i, 50 + i]
            params = p.hold(f"r{i}", src, 48)
            c.start_load(f"r{i}", params, dst)
            out = wait_for(c, f"r{i}")
            assert f"r{i}" in out.receiving, out.errors
            for a, b in zip(pt, ct, strict=True):
                assert torch.equal(a[src].view(torch.uint8), b[dst].view(torch.uint8))
    finally:
        c.close()
        p.close()
