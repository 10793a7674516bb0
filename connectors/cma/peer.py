"""What a cma consumer knows of a producer: its address, its regions' tables, its mappings.

``CmaAddress`` is what the producer publishes in the handshake; ``Peer`` the consumer's record
of one connected producer (owned by the plane: the one-sided reads use it under the plane's
``_direct_lock``, the read thread through its own table); ``pieces`` looks a batch's regions up
once per region pattern.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from .mapped import FileMap, RegionFile
from .memory import Peeker

MAX_PATTERNS = 64  # region patterns whose per-piece tables are kept (per peer, and for this side)
MAX_KEPT_PIECES = 4096  # only patterns up to this many pieces are kept: the small loads it is for, bounded memory


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class CmaAddress(msgspec.Struct, frozen=True):
    pid: int
    boot_id: str  # another host's process with the same pid must not be read
    control: str  # the producer's ZMQ endpoint for grants
    regions: dict[int, tuple[int, int]]  # region id -> (address, length) in the producer
    strides: dict[int, int] = {}  # region id -> bytes per block (what the board's block ids index)
    board: tuple[int, int] = (0, 0)  # the producer's hold board: (address, rows); (0, 0): none, ask for grants
    files: dict[int, RegionFile] = {}  # region id -> the shared-memory file it lies in (mapped.py)


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
    peek: Peeker  # small reads of its memory (the board), under the plane's _direct_lock
    patterns: dict[bytes, Pieces] = field(default_factory=dict)  # one-sided reads' (under _direct_lock)
    mapped: np.ndarray | None = None  # by position in ids, the region's address in maps (0: not mapped)
    maps: list[FileMap] = field(default_factory=list)  # unmapped under _direct_lock only (mapped.py)



def unmap(peer: Peer | None) -> None:
    """Unmap a peer's files. Caller holds the plane's _direct_lock and has taken the peer out of
    _direct, so no one-sided copy runs from them nor starts."""
    if peer is not None:
        for m in peer.maps:
            m.unmap()
        peer.maps = []
        peer.mapped = None
        peer.patterns = {}
