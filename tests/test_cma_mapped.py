"""cma reads from a mapping of the producer's shared-memory file (connectors/cma/mapped.py).

Real files in /dev/shm, real mappings, real cma planes (two in this process, and a real agent
pair in their own processes at the end); the producer's holds in a real HoldRegistry.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from kvxfer.connectors.cma import CmaDataPlane
from kvxfer.connectors.cma.engine_reads import peer_shape
from kvxfer.connectors.cma.mapped import (
    RegionFile,
    copy_mapped,
    map_region,
    memcpy_spans,
    region_files,
)
from test_hold_board import NB, STRIDE, Pair

from kvxfer.dataplane import BlockPieces
from kvxfer.protocol import ErrorCode

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FIXED = 0x10


class ShmFile:
    """A file in /dev/shm (unlinked: O_TMPFILE), mapped shared, filled with random bytes."""

    def __init__(self, nbytes: int, seed: int = 0) -> None:
        self.fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR)
        os.ftruncate(self.fd, nbytes)
        self.map = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.a = np.frombuffer(self.map, dtype=np.uint8)
        self.a[:] = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)
        st = os.fstat(self.fd)
        self.dev, self.ino = st.st_dev, st.st_ino

    @property
    def address(self) -> int:
        return int(self.a.ctypes.data)


def mapped_ranges(ino: int) -> list[str]:
    """This process's mappings of the file with inode ``ino``, as /proc/self/maps writes them."""
    with open("/proc/self/maps") as f:
        return [line for line in f if len(line.split()) > 4 and line.split()[4] == str(ino)]


def test_a_region_in_a_shared_file_mapping_is_found_with_its_descriptor_and_offset() -> None:
    f = ShmFile(8 * mmap.PAGESIZE)
    anon = np.ones(4 * mmap.PAGESIZE, dtype=np.uint8)
    private = mmap.mmap(f.fd, 4 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    private_at = int(np.frombuffer(private, dtype=np.uint8).ctypes.data)
    files = region_files({1: (f.address + 3 * mmap.PAGESIZE + 10, 1000), 2: (anon.ctypes.data, anon.nbytes),
                          3: (private_at, 100), 4: (f.address + 7 * mmap.PAGESIZE, 2 * mmap.PAGESIZE)})
    assert set(files) == {1}, "anonymous memory, a private mapping, or a range past the mapping was listed"
    rf = files[1]
    assert (rf.dev, rf.ino, rf.offset) == (f.dev, f.ino, 3 * mmap.PAGESIZE + 10)
    assert os.fstat(rf.fd).st_ino == f.ino  # a descriptor of this process on that very file


def test_a_region_across_two_mappings_counts_only_if_their_offsets_follow_on() -> None:
    f = ShmFile(4 * mmap.PAGESIZE)
    half = 2 * mmap.PAGESIZE
    for first, second, listed in ((0, half, True), (half, 0, False)):
        base = _libc.mmap(None, 2 * half, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        try:
            assert _libc.mmap(base, half, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, f.fd, first) == base
            assert _libc.mmap(base + half, half, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, f.fd, second) \
                == base + half
            files = region_files({0: (base + 100, 2 * half - 200)})
            assert (0 in files) is listed
            if listed:
                assert files[0].offset == 100
        finally:
            _libc.munmap(base, 2 * half)


def test_map_region_refuses_another_file_or_a_short_one_by_name() -> None:
    f = ShmFile(4 * mmap.PAGESIZE)
    (rf,) = region_files({0: (f.address, 4 * mmap.PAGESIZE)}).values()
    other = RegionFile(fd=rf.fd, dev=rf.dev, ino=rf.ino + 1, offset=0)
    with pytest.raises(OSError, match="is another file now"):
        map_region(os.getpid(), other, mmap.PAGESIZE)
    with pytest.raises(OSError, match="exceed the file"):
        map_region(os.getpid(), RegionFile(fd=rf.fd, dev=rf.dev, ino=rf.ino, offset=mmap.PAGESIZE),
                   4 * mmap.PAGESIZE)
    with pytest.raises(OSError):
        map_region(os.getpid(), RegionFile(fd=999_999, dev=rf.dev, ino=rf.ino, offset=0), 10)
    m = map_region(os.getpid(), RegionFile(fd=rf.fd, dev=rf.dev, ino=rf.ino, offset=100), 5000)
    try:
        got = np.ctypeslib.as_array((ctypes.c_uint8 * 5000).from_address(m.address))
        assert np.array_equal(got, f.a[100:5100])
        assert [line.split()[1] for line in mapped_ranges(f.ino) if "r--s" in line], "not mapped read-only"
    finally:
        m.unmap()
    assert not [line for line in mapped_ranges(f.ino) if "r--s" in line], "unmap left the mapping"


def test_copy_mapped_joins_adjacent_pieces_and_copies_each_bit_exact() -> None:
    src = np.random.default_rng(1).integers(0, 255, 1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    s, d = src.ctypes.data, dst.ctypes.data
    # pieces: two adjacent on both sides, one adjacent only on one side, one alone
    local = np.array([[d, 100], [d + 100, 50], [d + 150, 10], [d + 1000, 7]], dtype=np.int64)
    remote = np.array([[s + 500, 100], [s + 600, 50], [s + 9000, 10], [s + 3, 7]], dtype=np.int64)
    copy_mapped(local, remote)
    copy_mapped(local[:1] + np.array([[200, 0]]), remote[:1], keep_gil=True)
    assert np.array_equal(dst[:150], src[500:650]) and np.array_equal(dst[150:160], src[9000:9010])
    assert np.array_equal(dst[1000:1007], src[3:10]) and np.array_equal(dst[200:300], src[500:600])
    assert not dst[300:1000].any() and not dst[1007:].any()


def test_memcpy_spans_copies_every_span_and_keeps_the_gil_throughout() -> None:
    """The engine's copy (``memcpy_spans``): bit-exact, and one bytecode for every span, so another
    Python thread does not run mid-copy even at a 1 us switch interval (a Python loop over the
    same spans lets it run at nearly every turn)."""
    import ctypes.util
    import sys
    import threading

    memcpy_keep_gil = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6").memcpy  # one span a call
    memcpy_keep_gil.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    src = np.random.default_rng(3).integers(0, 255, 8 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    order = np.random.default_rng(4).permutation(2048)  # 2048 spans of 4 KiB, scattered
    d = [dst.ctypes.data + int(i) * 4096 for i in range(2048)]
    s = [src.ctypes.data + int(i) * 4096 for i in order]
    turns = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            turns[0] += 1

    old = sys.getswitchinterval()
    t = threading.Thread(target=spin, daemon=True)
    t.start()
    tries = []
    try:
        sys.setswitchinterval(1e-6)
        # a loaded host may not run the spinner at all for a while: measure again (at most 20 times)
        # until the Python loop shows it running, and judge the copy on that try
        while len(tries) < 20 and (not tries or tries[-1][1] < 100):
            before = turns[0]
            memcpy_spans(d, s, [4096] * 2048)
            during = turns[0] - before
            before = turns[0]
            for a, b in zip(d, s, strict=True):  # the same copies, GIL kept, from a Python loop: it runs between
                memcpy_keep_gil(a, b, 4096)  # turns
            tries.append((during, turns[0] - before))
    finally:
        sys.setswitchinterval(old)
        stop.set()
        t.join(5)
    assert np.array_equal(dst.reshape(2048, 4096), src.reshape(2048, 4096)[order])
    during, looped = tries[-1]
    assert looped > 10 * max(during, 10), tries


class MappedPair(Pair):
    """test_hold_board's Pair (two cma planes in this process), the producer's memory a shared-memory file."""

    def __init__(self, consumer_options: dict[str, object] | None = None) -> None:
        self.file = ShmFile(NB * STRIDE, seed=2)
        super().__init__(consumer_options=consumer_options, src=self.file.a)

    def maps(self) -> list[str]:
        """The consumer's read-only mappings of the producer's file."""
        return [line for line in mapped_ranges(self.file.ino) if "r--s" in line]


@pytest.fixture
def mpair() -> Iterator[MappedPair]:
    p = MappedPair()
    yield p
    p.close()


def test_a_one_sided_read_of_a_shared_file_is_copied_from_the_consumers_mapping(mpair: MappedPair) -> None:
    assert mpair.maps(), "connect did not map the producer's file"
    mpair.holds.hold("r", [5, 6, 7], 48)
    res = mpair.read("r", [7, 5], [1, 2])
    assert res.ok and res.nbytes == 2 * STRIDE and mpair.arrived([7, 5], [1, 2])
    assert mpair.consumer.counters() == {"one_sided_reads": 1, "mapped_reads": 1, "granted_reads": 0}
    mpair.src[7 * STRIDE:8 * STRIDE] ^= 0xFF  # the producer writes: the mapping shows its pages, not a copy
    res = mpair.read("r", [7], [3])
    assert res.ok and mpair.arrived([7], [3])

    res = mpair.read("r", [5, 8], [4, 5])  # block 8 is not held: asked for a grant, refused by name
    assert not res.ok and res.code is ErrorCode.OUT_OF_BOUNDS and not mpair.dst[4 * STRIDE:6 * STRIDE].any()
    mpair.holds.release("r")
    res = mpair.read("r", [7], [6])
    assert not res.ok and res.code is ErrorCode.NOT_HELD and not mpair.dst[6 * STRIDE:7 * STRIDE].any()
    assert mpair.consumer.mapped_reads == 2


def test_a_hold_that_ends_during_the_mapped_copy_fails_the_read(mpair: MappedPair,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import kvxfer.connectors.cma as cma

    def copy_then_release(local: np.ndarray, remote: np.ndarray, keep_gil: bool = False) -> None:
        copy_mapped(local, remote, keep_gil)
        mpair.holds.release("r")  # the producer frees the blocks while the consumer copied

    monkeypatch.setattr(cma, "copy_mapped", copy_then_release)
    mpair.holds.hold("r", [5], 16)
    res = mpair.read("r", [5], [1])
    assert not res.ok and res.code is ErrorCode.NOT_HELD and "ended while it was read" in (res.error or "")


def test_disconnect_and_close_unmap_the_producers_file(mpair: MappedPair) -> None:
    assert len(mpair.maps()) == 1
    mpair.consumer.disconnect("p")
    assert mpair.maps() == []
    mpair.consumer.connect("p", mpair.producer.address())
    mpair.consumer.connect("p", mpair.producer.address())  # connecting again replaces the mapping
    assert len(mpair.maps()) == 1
    mpair.holds.hold("r", [3], 16)
    assert mpair.read("r", [3], [4]).ok and mpair.arrived([3], [4])
    mpair.consumer.close()
    assert mpair.maps() == []


def test_without_map_memory_the_read_uses_process_vm_readv() -> None:
    p = MappedPair({"map_memory": False})
    try:
        assert not p.maps()
        p.holds.hold("r", [1, 2], 32)
        res = p.read("r", [2, 1], [9, 10])
        assert res.ok and p.arrived([2, 1], [9, 10])
        assert p.consumer.counters() == {"one_sided_reads": 1, "mapped_reads": 0, "granted_reads": 0}
    finally:
        p.close()


def test_reads_above_inline_copy_bytes_and_reads_copied_together_are_copied_from_the_mapping() -> None:
    """The native span copy takes mapped reads of any size (inline_copy_bytes and copy_threads
    only cut process_vm_readv copies now), one read alone or several in one ``read_many``."""
    import time

    from kvxfer.dataplane import Descriptors

    p = MappedPair({"inline_copy_bytes": STRIDE})
    try:
        p.holds.hold("r", [1, 2], 32)
        res = p.read("r", [2, 1], [9, 10])  # two blocks: more than inline_copy_bytes
        assert res.ok and p.arrived([2, 1], [9, 10])
        assert p.consumer.counters() == {"one_sided_reads": 1, "mapped_reads": 1, "granted_reads": 0}
        reads = []
        for rid, blocks, to in (("a", [3], 11), ("b", [4, 6], 12), ("c", [7], 14)):
            p.holds.hold(rid, blocks, 16 * len(blocks))
            n = len(blocks)
            reads.append(("p", rid, Descriptors(np.zeros(n, np.int64), np.array(blocks, np.int64) * STRIDE,
                                                np.zeros(n, np.int64), np.arange(to, to + n, dtype=np.int64) * STRIDE,
                                                np.full(n, STRIDE, np.int64))))
        batches = p.consumer.read_many(reads)
        done: dict[int, bool] = {}
        deadline = time.monotonic() + 10
        while len(done) < 3 and time.monotonic() < deadline:
            done.update((r.batch_id, r.ok) for r in p.consumer.poll())
        assert done == dict.fromkeys(batches, True)
        assert p.arrived([3, 4, 6, 7], [11, 12, 13, 14])
        assert p.consumer.counters() == {"one_sided_reads": 4, "mapped_reads": 4, "granted_reads": 0}
    finally:
        p.close()


def test_map_memory_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="map_memory: expected true or false"):
        CmaDataPlane({"map_memory": "yes"})


def test_a_transfer_agents_cma_loads_are_copied_from_mappings_bit_exact() -> None:
    """Across processes: two transfer agents (their caches in shared memory); the consumer
    agent maps the producer agent's files and every small load is copied from them (by the
    agent: engine_copy_bytes 0; the engine's own copies are test_engine_copies.py's)."""
    import msgspec
    from test_agent import cfg, make, wait_for

    p, pt = make(cfg("prefill", "cma", data_path="agent"), fill=3)
    dcfg = cfg("decode", "cma", data_path="agent")
    c, ct = make(msgspec.structs.replace(dcfg, connector=msgspec.structs.replace(dcfg.connector, engine_copy_bytes=0)))
    try:
        for i in range(3):
            params = p.hold(f"r{i}", [1 + i, 5 + i], 32)
            c.start_load(f"r{i}", params, [10 + i, 20 + i])
            assert f"r{i}" in wait_for(c, f"r{i}").receiving
            for a, b in zip(pt, ct, strict=True):
                assert torch.equal(a[[1 + i, 5 + i]].view(torch.uint8), b[[10 + i, 20 + i]].view(torch.uint8))
        stats = c.stats()
        assert stats["plane_mapped_reads"] == stats["plane_one_sided_reads"] >= 3
    finally:
        c.close()
        p.close()


@pytest.mark.parametrize("blocks", [([7], [3]), ([4, 5, 6], [10, 11, 12]), ([4, 5, 9, 1, 2], [0, 1, 2, 8, 9]),
                                    ([11, 2, 6], [1, 0, 5])])
def test_a_whole_block_shapes_spans_are_the_pieces_walk_over_every_run(blocks: tuple[list[int], list[int]]) -> None:
    """``PeerShape.span_addresses`` of a per-block shape whose pieces fill their blocks (the
    precomputed fast path) gives the spans the generic walk gives, in its order, and copies
    bit-exact; a shape with one piece short of its block takes the walk."""
    piece = 64
    src = [np.random.default_rng(i).integers(0, 256, NB * piece, dtype=np.uint8) for i in range(3)]
    dst = [np.zeros(NB * piece, dtype=np.uint8) for _ in range(3)]
    local = {i: memoryview(a) for i, a in enumerate(dst)}
    remote = {10 + i: memoryview(a) for i, a in enumerate(src)}
    whole = BlockPieces(tuple((10 + i, 0, piece, 0, i, 0, piece, 0, piece) for i in range(3)), 3 * piece, True)
    short = BlockPieces(tuple((10 + i, 0, piece, 8, i, 0, piece, 8, piece - 8) for i in range(3)), 3 * piece, True)
    rb, lb = blocks
    for bp, fast in ((whole, True), (short, False)):
        shape = peer_shape(bp, local, remote, {10 + i: piece for i in range(3)})
        assert shape is not None and bool(shape.whole_sizes) == fast
        walked = ([shape.addresses[i][0] + lo for i, lo, _, _ in shape.spans(rb, lb)],
                  [shape.addresses[i][1] + ro for i, _, ro, _ in shape.spans(rb, lb)],
                  [n for _, _, _, n in shape.spans(rb, lb)])
        assert shape.span_addresses(rb, lb) == walked
        for a in dst:
            a[:] = 0
        shape.copy(rb, lb)
        inner = 0 if fast else 8
        for s, d in zip(src, dst, strict=True):
            for r, lo in zip(rb, lb, strict=True):
                assert np.array_equal(d[lo * piece + inner : (lo + 1) * piece], s[r * piece + inner : (r + 1) * piece])
            wrote = sum(int(s[r * piece + inner : (r + 1) * piece].astype(np.int64).sum()) for r in rb)
            assert int(d.astype(np.int64).sum()) == wrote  # and nothing else
