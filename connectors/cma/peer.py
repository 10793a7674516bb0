"""What a cma consumer knows of a producer: its address, its regions' tables, its mappings.

``CmaAddress`` is what the producer publishes in the handshake; ``Peer`` the consumer's record
of one connected producer (owned by the plane: the one-sided reads use it under the plane's
``_direct_lock``, the read thread through its own table); ``pieces`` looks a batch's regions up
once per region pattern.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvxfer.transfer.hold_board import WINDOW, board_bytes

from .mapped import FileMap, MappedBoard, RegionFile, map_board, map_region
from .memory import Peeker, copy_from

logger = logging.getLogger(__name__)

MAX_PATTERNS = 64  # region patterns whose per-piece tables are kept (per peer, and for this side)
SMALL_LOOKUP = 512  # patterns of up to this many pieces are looked up in a dict, the GIL kept
MAX_KEPT_PIECES = 4096  # only patterns up to this many pieces are kept: the small loads it is for, bounded memory


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """This process's pid namespace ("device:inode" of /proc/self/ns/pid; "" where it cannot be
    read): two containers on one host share the boot id, not the namespace, and the producer's
    pid would name another process (or none) in the consumer's."""
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


class CmaAddress(msgspec.Struct, frozen=True):
    pid: int
    boot_id: str  # another host's process with the same pid must not be read
    control: str  # the producer's ZMQ endpoint for grants
    regions: dict[int, tuple[int, int]]  # region id -> (address, length) in the producer
    strides: dict[int, int] = {}  # region id -> bytes per block (what the board's block ids index)
    board: tuple[int, int] = (0, 0)  # the producer's hold board: (address, rows); (0, 0): none, ask for grants
    files: dict[int, RegionFile] = {}  # region id -> the shared-memory file it lies in (mapped.py)
    board_file: RegionFile | None = None  # the file the hold board lies in (offset 0); None: read it with peeks
    pid_ns: str = ""  # the producer's pid namespace (pid_namespace); "": unknown, not checked


@dataclass(frozen=True)
class Pieces:
    """A batch's regions looked up once per region pattern (its region ids, in order): per
    piece, its region's length, address and bytes per block. Loads of one plan shape repeat
    one pattern, so a read then costs no search of the region table."""

    sizes: np.ndarray
    bases: np.ndarray
    strides: np.ndarray | None  # None: not asked for (this side's regions)
    mapped: np.ndarray | None = None  # the regions' addresses in this process's mappings; None: some not mapped


def pieces(cache: dict[bytes, Pieces], ids: np.ndarray, sizes: np.ndarray, bases: np.ndarray,
            strides: np.ndarray | None, regions: np.ndarray, mapped: np.ndarray | None = None) -> Pieces | None:
    """The per-piece tables of ``regions`` (``ids`` sorted, the rest by position in it), kept in
    ``cache``; None when some region is not among ``ids``. ``mapped``: by position in ``ids``,
    each region's address in this process's mapping of it (0: not mapped)."""
    key = regions.tobytes()
    hit = cache.get(key)
    if hit is None:
        if not len(ids):
            return None
        if len(regions) <= SMALL_LOOKUP:  # np.searchsorted releases the GIL (the engine's copies keep it)
            at = {r: i for i, r in enumerate(ids.tolist())}
            pos = np.array([at.get(r, 0) for r in regions.tolist()], dtype=np.int64)
        else:
            pos = np.minimum(np.searchsorted(ids, regions), len(ids) - 1)
        if not (ids[pos] == regions).all():
            return None
        here = None if mapped is None else mapped[pos]
        hit = Pieces(sizes[pos], bases[pos], None if strides is None else strides[pos],
                      here if here is not None and here.all() else None)
        for a in (hit.sizes, hit.bases, hit.strides, hit.mapped):
            if a is not None:
                a.flags.writeable = False
        if len(regions) <= MAX_KEPT_PIECES:  # a large load's tables would cost MBs each, for little gain
            if len(cache) >= MAX_PATTERNS:
                cache.clear()
            cache[key] = hit
    return hit


@dataclass
class Peer:
    addr: CmaAddress
    dealer: Any  # zmq DEALER to the producer's control socket (plane thread only)
    token: bytes
    base: np.ndarray  # remote region id -> address (int64), indexed by position in ids
    ids: np.ndarray
    sizes: np.ndarray
    strides: np.ndarray  # bytes per block, by position in ids (0: unknown, no one-sided reads)
    peek: Peeker  # small reads of its memory, under the plane's _direct_lock
    patterns: dict[bytes, Pieces] = field(default_factory=dict)  # one-sided reads' (under _direct_lock)
    mapped: np.ndarray | None = None  # by position in ids, the region's address in maps (0: not mapped)
    maps: list[FileMap] = field(default_factory=list)  # unmapped under _direct_lock only (mapped.py)
    board: MappedBoard | None = None  # its hold board, mapped

    @property
    def board_read(self) -> Callable[[int, int], np.ndarray]:
        """Reads of its hold board: from the mapping, else with process_vm_readv (peek)."""
        return self.board if self.board is not None else self.peek


def open_peer(peer_id: str, address: bytes, token: bytes, map_memory: bool) -> tuple[Peer, bool]:
    """A producer's record from its published ``address``, after checking the kernel lets this
    process read it (one byte probed), with its shared-memory files mapped where it may be read
    one-sided and ``map_memory``; and whether it may be (it has a board and block strides).
    Raises ConnectionError naming why the peer cannot be read."""
    try:
        addr = msgspec.msgpack.decode(address, type=CmaAddress)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ConnectionError(f"peer {peer_id}: bad cma address: {e}") from None
    if addr.boot_id != boot_id():
        raise ConnectionError(f"peer {peer_id} runs on another host: the cma data plane reads only on one "
                              f"host (use tcp or ucx)")
    if addr.pid_ns and addr.pid_ns != (mine := pid_namespace()) and mine:
        raise ConnectionError(f"peer {peer_id} runs in another pid namespace (a container of its own): its pid "
                              f"{addr.pid} is not that process here; use tcp or ucx")
    if not addr.regions:
        raise ConnectionError(f"peer {peer_id} registered no regions")
    base, _length = next(iter(addr.regions.values()))
    probe = np.zeros(1, dtype=np.uint8)
    peek = Peeker(addr.pid)
    try:
        copy_from(addr.pid, np.array([[probe.ctypes.data, 1]], dtype=np.uint64),
                  np.array([[base, 1]], dtype=np.uint64))
    except OSError as e:
        raise ConnectionError(f"peer {peer_id} (pid {addr.pid}): the kernel refuses cross-memory reads ({e}); "
                              f"another pid namespace, or ptrace denied: use tcp or ucx") from None
    ids = np.array(sorted(addr.regions), dtype=np.int64)
    peer = Peer(addr, None, token, np.array([addr.regions[int(i)][0] for i in ids], dtype=np.int64), ids,
                np.array([addr.regions[int(i)][1] for i in ids], dtype=np.int64),
                np.array([max(addr.strides.get(int(i), 0), 0) for i in ids], dtype=np.int64), peek)
    one_sided = addr.board[1] > WINDOW and bool((peer.strides > 0).all())
    if one_sided and map_memory:
        _map(peer_id, peer)
        _map_board(peer_id, peer)
    return peer, one_sided


def _map_board(peer_id: str, peer: Peer) -> None:
    """Map the peer's hold board where it lies in a shared file and this CPU sees stores in order
    (mapped.py); otherwise it is read with process_vm_readv (logged)."""
    rf = peer.addr.board_file
    if rf is None or platform.machine() not in ("x86_64", "AMD64"):
        return
    try:
        fm, peer.board = map_board(peer.addr.pid, rf, peer.addr.board[0], board_bytes(peer.addr.board[1]), peer.peek)
    except OSError as e:
        logger.info("cma: peer %s (pid %d): hold board not mapped (%s): it is read with process_vm_readv",
                    peer_id, peer.addr.pid, e)
        return
    peer.maps.append(fm)


def _map(peer_id: str, peer: Peer) -> None:
    """Map the peer's regions that lie in shared-memory files (mapped.py); a region that
    cannot be mapped is read with process_vm_readv, as every region was before (logged)."""
    if not peer.addr.files:
        logger.info("cma: peer %s (pid %d) has no memory in shared files: it is read with process_vm_readv",
                    peer_id, peer.addr.pid)
        return
    mapped = np.zeros(len(peer.ids), dtype=np.int64)
    for i, rid in enumerate(peer.ids.tolist()):
        rf = peer.addr.files.get(rid)
        if rf is None:
            continue
        try:
            m = map_region(peer.addr.pid, rf, int(peer.sizes[i]))
        except OSError as e:
            logger.info("cma: peer %s (pid %d): region %d not mapped (%s): it is read with process_vm_readv",
                        peer_id, peer.addr.pid, rid, e)
            continue
        peer.maps.append(m)
        mapped[i] = m.address
    peer.mapped = mapped
    logger.debug("cma: peer %s: %d of %d regions mapped", peer_id, len(peer.maps), len(peer.ids))


def unmap(peer: Peer | None) -> None:
    """Unmap a peer's files. Caller holds the plane's _direct_lock and has taken the peer out of
    _direct, so no one-sided copy runs from them nor starts."""
    if peer is not None:
        if peer.board is not None:
            peer.board.close()
            peer.board = None
        for m in peer.maps:
            m.unmap()
        peer.maps = []
        peer.mapped = None
        peer.patterns = {}
