"""The producer's shared-memory files, mapped read-only by the consumer: copies at ``memcpy`` speed.

``process_vm_readv`` pins the producer's pages one by one before it copies: measured here, a
2 MiB block in 64 pieces took 380-400 us from memory in cache, where ``memcpy`` of the same
pieces took 160. When the producer's memory lives in a shared-memory file (the transfer agent's
cache always does: ``kvxfer/agent/shared.py``), the consumer can map that file itself and copy
with ``memcpy``, no page pinned and no system call per read.

The producer says which file backs each region (``region_file``: its descriptor number, the
file's device and inode, and the region's offset in it, found in ``/proc/self/maps``); the
consumer opens ``/proc/<pid>/fd/<fd>`` (the kernel allows it where it would allow the
cross-memory read: same user, ptrace rights), checks that it is the same file and large enough,
and maps the region's pages read-only (``map_region``). Memory that is not a shared file (an
engine's own tensors) is still read with ``process_vm_readv``.

The hold board is a shared file too (``HoldBoard``): ``MappedBoard`` reads its rows and a small
hold's block ids from a mapping for the check before a copy. The recheck after the copy still
reads the row with ``process_vm_readv``: a mapping outlives its producer, whose board then still
shows its last holds while the engine that owned the blocks may reuse them, and only a read of the
producer's own memory fails (ESRCH) from the moment that memory is torn down, which the kernel does
before it closes the producer's files (the channel its engine would learn of its death by).
Mapped boards are read on x86-64 only, whose stores are seen in order (the producer writes a row's
ticket last), and only with ``map_memory``; the board's file is sealed at its size.

A mapping must not be unmapped while a copy runs from it (a copy from an unmapped range is a
segfault, not an error): the plane unmaps only under the lock its copies hold. A producer that
truncates its own file under a mapping would make the copy raise SIGBUS: a process that may do
so could ptrace the consumer anyway (the same trust as cma's reads).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
from dataclasses import dataclass

import msgspec
import numpy as np

from kvxfer import _spancopy
from kvxfer.dataplane import address_view, join_adjacent

from .memory import Peeker

logger = logging.getLogger(__name__)

_LIBC_NAME = ctypes.util.find_library("c") or "libc.so.6"
_libc = ctypes.CDLL(_LIBC_NAME, use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = mmap.PAGESIZE


class RegionFile(msgspec.Struct, frozen=True, array_like=True):
    """Where a producer's region lives in a shared-memory file (a wire type: ``CmaAddress.files``)."""

    fd: int  # the descriptor number in the producer
    dev: int  # the file's st_dev and st_ino: the consumer checks it opened this file
    ino: int
    offset: int  # the region's first byte in the file


@dataclass
class FileMap:
    """One region of a producer mapped read-only here: ``address`` is the region's first byte."""

    address: int
    _start: int  # what munmap takes
    _length: int

    def unmap(self) -> None:
        if self._length:
            _libc.munmap(self._start, self._length)
            self._length = 0


def _maps() -> list[tuple[int, int, bool, int, int, int]]:
    """This process's file mappings: (start, end, shared, file offset, dev, inode)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 5 or parts[4] == "0":
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            out.append((start, end, "s" in parts[1], int(parts[2], 16), os.makedev(major, minor), int(parts[4])))
    return out


def _fd_of(dev: int, ino: int) -> int | None:
    """An open descriptor of this process on the file (dev, ino), if any."""
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile (listdir's own descriptor, for one)
        if (st.st_dev, st.st_ino) == (dev, ino):
            return int(name)
    return None


def region_files(regions: dict[int, tuple[int, int]]) -> dict[int, RegionFile]:
    """For each region id -> (address, length) of this process that lies whole in one shared
    file mapping (one or more adjacent mappings of consecutive offsets of the file), with a
    descriptor open on that file: its ``RegionFile``. Others are left out."""
    if not regions:
        return {}
    try:
        maps = _maps()
    except OSError as e:
        logger.info("cma: /proc/self/maps unreadable (%s): consumers read this process with process_vm_readv", e)
        return {}
    fds: dict[tuple[int, int], int | None] = {}
    out = {}
    for rid, (address, length) in regions.items():
        found = _covering(maps, address, length)
        if found is None:
            continue
        dev, ino, offset = found
        if (dev, ino) not in fds:
            fds[(dev, ino)] = _fd_of(dev, ino)
        fd = fds[(dev, ino)]
        if fd is not None:
            out[rid] = RegionFile(fd=fd, dev=dev, ino=ino, offset=offset)
    return out


def _covering(maps: list[tuple[int, int, bool, int, int, int]], address: int,
              length: int) -> tuple[int, int, int] | None:
    """(dev, inode, file offset of ``address``) when [address, address + length) lies in shared
    mappings of one file at consecutive offsets; else None."""
    end = address + length
    at = address
    found: tuple[int, int, int] | None = None
    for start, stop, shared, offset, dev, ino in maps:
        if not start <= at < stop:
            continue
        if not shared:
            return None  # a private mapping's pages may be this process's own copies
        here = offset + (at - start)
        if found is None:
            found = (dev, ino, here)
        elif (dev, ino) != found[:2] or here != found[2] + (at - address):
            return None
        at = stop
        if at >= end:
            return found
    return None


def map_region(pid: int, rf: RegionFile, length: int) -> FileMap:
    """Map ``length`` bytes of process ``pid``'s file ``rf`` read-only here. Raises OSError
    (named) when the file cannot be opened, is another file, or is too short."""
    fd = os.open(f"/proc/{pid}/fd/{rf.fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (rf.dev, rf.ino):
            raise OSError(f"descriptor {rf.fd} of pid {pid} is another file now")
        if rf.offset < 0 or length <= 0 or rf.offset + length > st.st_size:
            raise OSError(f"{length} bytes at offset {rf.offset} exceed the file of pid {pid} ({st.st_size} bytes)")
        start = rf.offset - rf.offset % PAGE
        span = rf.offset + length - start
        got = _libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if got is None or got == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of pid {pid}'s descriptor {rf.fd}: {os.strerror(err)}")
        return FileMap(address=got + (rf.offset - start), _start=got, _length=span)
    finally:
        os.close(fd)


def copy_mapped(local: np.ndarray, remote: np.ndarray, keep_gil: bool = False) -> None:
    """Copy pieces ``remote`` [n, 2] (address, length; addresses in this process's mappings)
    into ``local`` [n, 2]: pieces adjacent on both sides are joined, then copied by
    ``memcpy_spans`` (this thread and the native helpers). ``keep_gil``: a short copy keeps the
    GIL (see ``KEEP_GIL_BYTES`` in the plane); otherwise it is released during the copy. The
    caller checked every address."""
    dst, src, size, _ = join_adjacent(local[:, 0], remote[:, 0], local[:, 1])
    memcpy_spans(dst.tolist(), src.tolist(), size.tolist(), release_gil=not keep_gil)


def memcpy_spans(dst: list[int], src: list[int], size: list[int], release_gil: bool = False) -> bool:
    """``memcpy(dst[i], src[i], size[i])`` for every i in one native call (``kvxfer._spancopy``):
    a copy of 512 KiB or more is cut in 64 KiB parts that this thread and native helper threads
    take in turn (2 MiB in 64 spans: 500 -> 230 us, 16 MiB: 3.1 -> 1.7 ms, two cores), helpers
    that need no GIL. The GIL is kept throughout unless ``release_gil``: a busy Python thread of
    the engine cannot take it mid-copy (one that did would make the copy wait a switch interval
    to go on). True when the copy was offered to the helpers. The caller checked every address."""
    return _spancopy.copy(dst, src, size, release_gil)


class MappedBoard:
    """A producer's hold board read through this process's read-only mapping of its file (the
    module doc): a ``read_at(address, nbytes)`` for ``check_one_sided``/``check_blocks`` whose
    reads are memory reads; a read outside the board's file (a long hold's block ids) goes to
    ``peek``. Only the check before a copy reads it: the recheck after reads the row with
    ``peek`` (process_vm_readv), which fails once the producer's memory is gone, before its
    engine can learn that it died (the kernel tears a process's memory down before it closes its
    files, the channel to its engine among them), while a mapping still shows its last rows.

    Threads: the caller's lock (the plane's ``_direct_lock``, or the engine's), as ``Peeker``."""

    def __init__(self, fm: FileMap, address: int, nbytes: int, peek: Peeker) -> None:
        self._bytes: np.ndarray | None = np.frombuffer(address_view(fm.address, nbytes), dtype=np.uint8)
        self._start, self._end = address, address + nbytes  # the board's file in the producer
        self.peek = peek

    def __call__(self, address: int, nbytes: int) -> np.ndarray:
        if self._bytes is None:
            raise OSError("the board's mapping was let go")
        if self._start <= address and address + nbytes <= self._end:
            return self._bytes[address - self._start : address - self._start + nbytes]
        return self.peek(address, nbytes)

    def close(self) -> None:
        """Before the mapping goes: no read through it from here on."""
        self._bytes = None


def map_board(pid: int, rf: RegionFile, address: int, nbytes: int, peek: Peeker) -> tuple[FileMap, MappedBoard]:
    """Map a producer's hold board (``rf``, ``nbytes`` at ``address`` in the producer) read-only
    here. Raises OSError (named) when it cannot."""
    fm = map_region(pid, rf, nbytes)
    return fm, MappedBoard(fm, address, nbytes, peek)
