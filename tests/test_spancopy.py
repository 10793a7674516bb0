"""The native span copy (kvxfer/_spancopy.c): bit-exact however the spans are cut and shared
between the caller and its helper threads, from several threads at once, after a fork, and
refusing malformed arguments by name."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvxfer import _spancopy


def spans(rng: np.random.Generator, src: np.ndarray, dst: np.ndarray, n: int, largest: int
          ) -> tuple[list[int], list[int], list[int], list[tuple[int, int, int]]]:
    """``n`` spans of 0 to ``largest`` bytes at odd offsets, each into its own slot of ``dst``."""
    slot = len(dst) // n
    d, s, z, where = [], [], [], []
    for i in range(n):
        size = int(rng.integers(0, min(largest, slot) + 1))
        at = int(rng.integers(0, len(src) - size + 1))
        d.append(dst.ctypes.data + i * slot)
        s.append(src.ctypes.data + at)
        z.append(size)
        where.append((i * slot, at, size))
    return d, s, z, where


def check(src: np.ndarray, dst: np.ndarray, where: list[tuple[int, int, int]]) -> None:
    for to, at, size in where:
        assert np.array_equal(dst[to : to + size], src[at : at + size]), (to, at, size)


@pytest.mark.parametrize("release_gil", [False, True])
def test_spans_of_every_size_arrive_bit_exact_and_a_large_copy_is_shared(release_gil: bool) -> None:
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 48 << 20, dtype=np.uint8)
    before = _spancopy.stats()["split_copies"]
    for n, largest in ((1, 16 << 20), (3, 1), (64, 32 << 10), (7, 5 << 20), (2048, 4096), (1, 0)):
        dst = np.zeros(32 << 20, dtype=np.uint8)
        d, s, z, where = spans(rng, src, dst, n, largest)
        shared = _spancopy.copy(d, s, z, release_gil=release_gil)
        check(src, dst, where)
        assert shared == (sum(z) >= _spancopy.stats()["min_split"] and sum(-(-x // (64 << 10)) for x in z) > 1)
        # nothing outside the spans was written
        mask = np.ones(len(dst), dtype=bool)
        for to, _, size in where:
            mask[to : to + size] = False
        assert not dst[mask].any()
    stats = _spancopy.stats()
    assert stats["helpers"] >= 1 and stats["split_copies"] > before


def test_copies_from_several_threads_at_once_each_arrive_bit_exact() -> None:
    """One copy at a time gets the helpers; the others copy alone meanwhile. Both are exact."""
    src = np.random.default_rng(8).integers(0, 256, 8 << 20, dtype=np.uint8)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(20):
                dst = np.zeros(8 << 20, dtype=np.uint8)
                d, s, z, where = spans(rng, src, dst, 16, 1 << 20)
                _spancopy.copy(d, s, z, release_gil=True)
                check(src, dst, where)
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)


def test_a_forked_child_copies_with_helpers_of_its_own() -> None:
    src = np.random.default_rng(9).integers(0, 256, 4 << 20, dtype=np.uint8)
    first = np.zeros(1 << 20, np.uint8)  # kept alive through the copy: the copy writes to its address
    _spancopy.copy([first.ctypes.data], [src.ctypes.data], [1 << 20])  # the parent's helpers start
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its split copy is exact
        code = 1
        try:
            dst = np.zeros_like(src)
            shared = _spancopy.copy([dst.ctypes.data], [src.ctypes.data], [len(src)])
            code = 0 if shared and np.array_equal(dst, src) and _spancopy.stats()["helpers"] >= 1 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:  # hung: a helper the child never started, or a copy that never ends
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child's copy did not finish in 60 s")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_with_no_helpers_a_large_copy_runs_on_its_caller_alone() -> None:
    src = np.random.default_rng(10).integers(0, 256, 4 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    helpers = max(1, _spancopy.stats()["helpers"])
    try:
        _spancopy.configure(helpers=0)
        assert not _spancopy.copy([dst.ctypes.data], [src.ctypes.data], [len(src)])
        assert np.array_equal(dst, src)
    finally:
        _spancopy.configure(helpers=helpers)
    assert _spancopy.copy([dst.ctypes.data], [src.ctypes.data], [len(src)])


def test_malformed_arguments_are_refused_by_name_and_copy_nothing() -> None:
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    a, b = dst.ctypes.data, src.ctypes.data
    with pytest.raises(ValueError, match="2 destinations, 1 sources and 2 sizes"):
        _spancopy.copy([a, a + 128], [b], [1, 1])
    with pytest.raises(TypeError, match="lists of ints"):
        _spancopy.copy((a,), [b], [1])  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        _spancopy.copy([a, a], [b, b], [16, -1])
    with pytest.raises(TypeError):
        _spancopy.copy([a], ["x"], [1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"span 1's size 18446744073709551615 .* is not a size of memory"):
        _spancopy.copy([a, a], [b, b], [16, 2**64 - 1])  # would wrap the part count
    with pytest.raises(ValueError, match="helpers must be 0 to 16"):
        _spancopy.configure(helpers=99)
    assert not dst.any()


def test_thousands_of_split_copies_in_a_row_each_finish_with_every_part_copied() -> None:
    """Helpers that wake late, after their job ended and the next began, must not take (or
    count) a part of the next job: a copy would then wait forever for a part nobody copies, or
    return before one is copied. Each copy here is two parts, split, back to back, with more
    helpers than cores (preempted mid-claim); in a child process, so that a hang fails the test at
    its timeout instead of hanging the run."""
    script = (
        "import numpy as np\n"
        "from kvxfer import _spancopy as s\n"
        "s.configure(helpers=8, min_split=0)\n"
        "src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)\n"
        "for i in range(100000):\n"
        "    dst = np.zeros(2 * 65537, np.uint8)\n"
        "    a = (i * 4099) % (len(src) - 2 * 65537)\n"
        "    d, f = dst.ctypes.data, src.ctypes.data + a\n"
        "    assert s.copy([d, d + 65537], [f, f + 65537], [65537, 65537], release_gil=bool(i % 2))\n"
        "    assert np.array_equal(dst, src[a:a + 2 * 65537]), i\n"
        "print(s.stats()['split_copies'])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) >= 100000
