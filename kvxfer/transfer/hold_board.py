"""Holds published in the producer's memory, so a one-sided reader checks a read without asking.

A data plane that reads the producer's memory directly (``cma``: ``process_vm_readv``) would
otherwise ask the producer for a grant before every copy: a round trip through two processes'
threads that cost more than copying a 2 MiB block. The producer instead publishes each pull
hold on a board: a fixed table of rows ``(key, ticket, address, count)``, where ``key`` is a
hash of the request id, ``ticket`` a number never used twice, and ``address``/``count`` the
hold's block ids (sorted and unique: beside the row in the board's file for a hold of up to
``INLINE`` blocks, else an int64 array the board keeps alive while the row is published).

A reader (see :func:`check_one_sided`) reads the row, the block ids, checks that every block
its pieces touch is held, copies, and reads the row again: the copy stands only if the row is
unchanged. The producer clears the ticket *before* the engine can learn that the hold ended
(``HoldRegistry`` calls the board under its lock, and the engine frees blocks only after
``take_released``), so an unchanged row after the copy means the blocks were pinned the whole
time. Tickets are never reused, so a row released and published again cannot look unchanged.
A request not on the board (never held, a full probe window, a push hold) is read the
two-sided way, with a grant: the board only ever makes reads faster, never different.

The board lives in a shared-memory file (``memfd``, where the platform has one), and a hold of
up to ``INLINE`` blocks keeps its ids in that file beside its row (its ``address`` points there):
a reader on the same host may map the file and make the check and the recheck with memory reads
(the cma plane's ``MappedBoard``; the recheck still reads the producer's own memory), where reading the
rows, the ids and the row again through ``process_vm_readv`` cost three cross-process reads.

Like an RDMA one-sided read, the check is the reader's own: a process that may read another's
memory (cma needs ptrace rights) could skip it. The producer that wants every read checked by
itself turns the board off (``cma``'s ``one_sided: false``).

Threads: ``publish``/``withdraw`` are called under the hold registry's lock (one writer at a
time); readers are other processes.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import mmap
import os
import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable

import numpy as np

SMALL_CHECK = 512  # reads of up to this many pieces are checked in Python, the GIL kept
SLOTS = 4096  # rows a request id hashes to
WINDOW = 8  # rows probed from its hash (the table has SLOTS + WINDOW rows: no wrap-around)
ROW = 4  # int64 fields: key, ticket, address of the block ids, their count
ROW_BYTES = ROW * 8
INLINE = 28  # block ids a hold keeps beside its row, in the board's file (a row and its ids: 256 bytes)


def board_bytes(rows: int) -> int:
    """The size of a board of ``rows`` rows: the table, then each row's inline block ids."""
    return rows * (ROW + INLINE) * 8


def key_of(request_id: str) -> int:
    """A nonzero 63-bit hash of a request id (the same in every process)."""
    h = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)
    return h or 1


class HoldBoard:
    """The producer's table of published holds (see the module docstring)."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        rows = slots + WINDOW
        self.nbytes = board_bytes(rows)
        self.fd = -1  # the shared-memory file the board lives in (-1: none, private memory)
        self.file_id = (0, 0)  # its st_dev and st_ino (a reader checks it opened this file)
        try:
            self.fd = os.memfd_create("kvxfer-hold-board", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(self.fd, self.nbytes)
            # sealed at its size: a mapping reader can never fault on a shrunk file (SIGBUS)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            st = os.fstat(self.fd)
            self.file_id = (st.st_dev, st.st_ino)
            memory: np.ndarray = np.frombuffer(mmap.mmap(self.fd, self.nbytes), dtype=np.int64)
        except (AttributeError, OSError):  # no memfd here: readers read it with process_vm_readv
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            memory = np.zeros(self.nbytes // 8, dtype=np.int64)
        self.table = memory[: rows * ROW].reshape(rows, ROW)
        # a board dropped without close() allows no read either: a mapping reader would otherwise
        # see its last rows for as long as this process lives, and no withdraw would reach them
        self._finalizer = weakref.finalize(self, _retire, self.table, self.fd)
        self.inline = memory[rows * ROW :].reshape(rows, INLINE)
        self._inline_at = int(self.inline.ctypes.data)
        self._rows: dict[str, tuple[int, np.ndarray | None]] = {}  # request id -> (row, a long hold's ids, kept alive)
        self._tickets = itertools.count(1)
        self.full = 0  # holds not published: every row of their window was taken

    @property
    def address(self) -> int:
        return int(self.table.ctypes.data)

    @property
    def rows(self) -> int:
        return len(self.table)

    def publish(self, request_id: str, block_ids: np.ndarray) -> bool:
        """Publish a hold's blocks; False when its window is full (reads then ask for grants)."""
        self.withdraw(request_id)
        key = key_of(request_id)
        first = key % self.slots
        window = self.table[first : first + WINDOW, 1]
        free = np.flatnonzero(window == 0)
        if not len(free):
            self.full += 1
            return False
        row = first + int(free[0])
        # the board's own copy, sorted and unique (readers search it); not np.unique: its hashing
        # releases the GIL (a hand-off to any waiting thread, under the hold registry's lock)
        ids = np.sort(np.asarray(block_ids, dtype=np.int64))
        if len(ids) > 1:
            ids = ids[np.concatenate(([True], ids[1:] != ids[:-1]))]
        if len(ids) <= INLINE:  # in the board's own file, beside the row (a mapped reader reads it there)
            self.inline[row, : len(ids)] = ids
            address = self._inline_at + row * INLINE * 8
            self._rows[request_id] = (row, None)
        else:
            address = ids.ctypes.data
            self._rows[request_id] = (row, ids)
        r = self.table[row]
        r[0], r[2], r[3] = key, address, len(ids)
        r[1] = next(self._tickets)  # last: a reader that sees this ticket sees the fields and ids before it
        return True

    def withdraw(self, request_id: str) -> None:
        """The hold ended: clear its ticket first (a reader's second look then fails)."""
        entry = self._rows.pop(request_id, None)
        if entry is not None:
            self.table[entry[0], 1] = 0

    def __len__(self) -> int:
        return len(self._rows)

    def close(self) -> None:
        """No read is allowed from here on (every ticket cleared; the owner publishes no more, but
        withdraws still clear a row published in a race with this); the file's descriptor closed
        (mappings readers made stay valid, and read an empty board)."""
        self.fd = -1
        self._finalizer()


def _retire(table: np.ndarray, fd: int) -> None:
    """Every ticket cleared, the file's descriptor closed (once: at close, or when the board goes)."""
    table[:, 1] = 0
    if fd >= 0:
        os.close(fd)


def _find(window: list[list[int]], key: int) -> int | None:
    """Where in ``window`` (rows as Python ints: one snapshot of the board's memory, which a
    mapped reader would otherwise read again while the producer writes it) the published row for
    ``key`` is, or None."""
    for i, (k, ticket, _, _) in enumerate(window):
        if k == key and ticket != 0:
            return i
    return None


def blocks_held(first: np.ndarray, last: np.ndarray, held: np.ndarray) -> bool:
    """Whether every block of every range ``[first[i], last[i]]`` is among ``held``, which the
    producer published sorted and unique. Read from another process, it may be garbage (a row
    being withdrawn): no allocation depends on its values, and the recheck after the copy
    (:func:`row_unchanged`) rejects a read that garbage allowed."""
    if not len(first):
        return True
    if len(first) <= SMALL_CHECK:
        # numpy's searchsorted releases the GIL whatever the size: an engine's thread copying a small
        # load (engine_loads.py) would hand it to any busy thread of the engine for a switch interval
        ids = held.tolist() if len(held) <= SMALL_CHECK else held  # bisect reads an ndarray as it is
        return all(bisect_right(ids, b) - bisect_left(ids, a) == b - a + 1
                   for a, b in set(zip(first.tolist(), last.tolist(), strict=True)))
    inside = held.searchsorted(last, side="right") - held.searchsorted(first, side="left")
    return bool((inside == last - first + 1).all())


def check_one_sided(read_at: Callable[[int, int], np.ndarray], board: tuple[int, int], request_id: str,
                    first: np.ndarray, last: np.ndarray) -> np.ndarray | None:
    """Before a one-sided copy: the board row proving blocks ``first..last`` (per piece) are held
    for ``request_id``, or None (not published, or some block not in the hold: ask for a grant).

    ``read_at(address, nbytes)`` reads the producer's memory (an OSError means None here);
    ``board`` is the producer's (address, rows). The row comes back as ROW + 1 int64s: its
    fields, then its index on the board. After the copy, the caller reads the row again
    (:func:`row_unchanged`): the copy stands only if it is."""
    try:
        found = _published(read_at, board, request_id)
        return found[0] if found is not None and blocks_held(first, last, found[1]) else None
    except Exception:  # garbage read from a row being withdrawn: ask for a grant
        return None


def check_blocks(read_at: Callable[[int, int], np.ndarray], board: tuple[int, int], request_id: str,
                 blocks: Iterable[int]) -> np.ndarray | None:
    """:func:`check_one_sided` for a read whose every piece lies inside one block: the row proving
    each of ``blocks`` is held, or None."""
    try:
        found = _published(read_at, board, request_id)
        if found is None:
            return None
        held = found[1].tolist() if len(found[1]) <= SMALL_CHECK else found[1]  # bisect reads an ndarray as it is
        for b in blocks:
            i = bisect_left(held, b)
            if i == len(held) or held[i] != b:
                return None
        return found[0]
    except Exception:  # garbage read from a row being withdrawn: ask for a grant
        return None


def _published(read_at: Callable[[int, int], np.ndarray], board: tuple[int, int],
               request_id: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The row published for ``request_id`` (ROW fields, then its index) and its block ids, or
    None (not published, or unreadable: the producer exited)."""
    if board[1] <= WINDOW:
        return None
    key = key_of(request_id)
    first_row = key % (board[1] - WINDOW)
    try:
        window = _rows(read_at, board, first_row, WINDOW).tolist()  # the row checked is the row kept
    except OSError:
        return None
    i = _find(window, key)
    if i is None:
        return None
    row = np.array([*window[i], first_row + i], dtype=np.int64)
    if not 0 < row[3] <= 1 << 24:
        return None
    try:
        return row, read_at(int(row[2]), int(row[3]) * 8).view(np.int64)
    except OSError:
        return None


def row_unchanged(read_at: Callable[[int, int], np.ndarray], board: tuple[int, int], row: np.ndarray) -> bool:
    """After the copy: is the row that allowed it (from :func:`check_one_sided`) still the same,
    so the blocks stayed held? Only its own index is read again: its ticket was never used
    before, so the same fields can be nowhere else."""
    if board[1] <= WINDOW or not 0 <= row[ROW] < board[1] or row[1] == 0:
        return False
    try:
        now = _rows(read_at, board, int(row[ROW]), 1)
    except OSError:
        return False
    return now.tobytes() == row[:ROW].tobytes()


def _rows(read_at: Callable[[int, int], np.ndarray], board: tuple[int, int], first_row: int, n: int) -> np.ndarray:
    """Rows ``first_row`` .. ``first_row + n - 1`` of a board, read from the producer."""
    return read_at(board[0] + first_row * ROW_BYTES, n * ROW_BYTES).view(np.int64).reshape(n, ROW)
