"""cma reads made by the engine's own thread, beside its transfer agent (:class:`kvxfer.dataplane.EngineReads`).

The same one-sided read as the plane's (:meth:`CmaDataPlane._read_one_sided`): the producer's hold
board row and block ids read before the copy, the copy from this process's read-only mapping of
the producer's file (``process_vm_readv`` where a region is not mapped), the row read again after.
The copy keeps the GIL, whatever its size (``connector.engine_copy_bytes`` bounds it): released
per piece, a busy Python thread of the engine would keep it a switch interval (5 ms) each time.

A load the board does not allow whole (not held yet, a push hold, a full board window, a producer
without a board), a copy that fails, or a row that changed: False, and the agent loads it as
before. A producer whose board cannot be read any more (it exited) is forgotten here, so its
file is not kept mapped.

Threads: one caller at a time (the engine's connector holds its lock around every call).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from kvxfer.cache.tensors import MemoryRegion
from kvxfer.dataplane import Descriptors, EngineReads, address_view
from kvxfer.transfer.hold_board import check_one_sided, row_unchanged

from .memory import copy_from, iovecs
from .peer import Peer, Pieces, open_peer, pieces, unmap

logger = logging.getLogger(__name__)


class CmaEngineReads(EngineReads):
    """One-sided cma reads into the engine's own cache regions (see the module doc)."""

    def __init__(self, regions: Sequence[MemoryRegion], map_memory: bool) -> None:
        self.map_memory = map_memory
        ids = np.array(sorted(r.region_id for r in regions), dtype=np.int64)
        by_id = {r.region_id: r for r in regions}
        self._ids = ids
        self._sizes = np.array([by_id[int(i)].length for i in ids], dtype=np.int64)
        self._bases = np.array([by_id[int(i)].address for i in ids], dtype=np.int64)
        self._patterns: dict[bytes, Pieces] = {}
        self._peers: dict[str, Peer] = {}
        self._views = {r.region_id: address_view(r.address, r.length) for r in regions}  # this side's regions
        self._peer_views: dict[str, dict[int, memoryview]] = {}  # a peer's mapped regions, by region id

    def connect(self, peer_id: str, address: bytes) -> None:
        peer, one_sided = open_peer(peer_id, address, b"", self.map_memory)
        if not one_sided:
            unmap(peer)
            raise ConnectionError(f"peer {peer_id} publishes no hold board (one_sided: false): every read of it "
                                  f"asks it for a grant")
        try:
            views = {} if peer.mapped is None else {
                rid: address_view(at, size).toreadonly()  # the mapping is PROT_READ: a write would fault, not raise
                for rid, at, size in zip(peer.ids.tolist(), peer.mapped.tolist(), peer.sizes.tolist(), strict=True)
                if at}
        except (ValueError, TypeError, OverflowError) as e:
            unmap(peer)
            raise ConnectionError(f"peer {peer_id}: its mapped regions cannot be viewed here ({e})") from None
        self.disconnect(peer_id)
        self._peers[peer_id] = peer
        self._peer_views[peer_id] = views

    def disconnect(self, peer_id: str) -> None:
        self._peer_views.pop(peer_id, None)  # before the unmap: nothing may read through them after
        unmap(self._peers.pop(peer_id, None))

    def connected(self, peer_id: str) -> bool:
        return peer_id in self._peers

    def read(self, request_id: str, reads: Sequence[tuple[str, Descriptors]]) -> bool:
        allowed: list[tuple[str, Peer, Descriptors, np.ndarray, Pieces, np.ndarray]] = []
        for peer_id, d in reads:
            if not len(d):
                continue
            peer = self._peers.get(peer_id)
            if peer is None:
                return False
            local = pieces(self._patterns, self._ids, self._sizes, self._bases, None, d.local_region)
            if local is None or (d.local_offset + d.length > local.sizes).any():
                return False
            remote = pieces(peer.patterns, peer.ids, peer.sizes, peer.base, peer.strides, d.remote_region,
                            peer.mapped)
            if remote is None or remote.strides is None:
                return False
            end = d.remote_offset + d.length
            if (end > remote.sizes).any():
                return False
            row = check_one_sided(peer.peek, peer.addr.board, request_id, d.remote_offset // remote.strides,
                                  (end - 1) // remote.strides)
            if row is None:
                self._forget_if_gone(peer_id, peer)
                return False
            allowed.append((peer_id, peer, d, local.bases, remote, row))
        for peer_id, peer, d, local_bases, remote, _ in allowed:
            try:
                if remote.mapped is not None:
                    copy_views(d, self._views, self._peer_views[peer_id])
                else:
                    iov = iovecs(d, local_bases, remote.bases)
                    copy_from(peer.addr.pid, iov[0], iov[1], keep_gil=True, nbytes=d.nbytes)
            except (OSError, ValueError, KeyError) as e:  # ruled out by the checks above; the agent loads it
                logger.debug("cma: request %s: the engine's copy failed (%s); the agent loads it", request_id, e)
                return False
        return all(row_unchanged(peer.peek, peer.addr.board, row) for _, peer, _, _, _, row in allowed)

    def _forget_if_gone(self, peer_id: str, peer: Peer) -> None:
        """The board did not allow a read: if the producer's memory cannot be read at all (it
        exited), unmap its files now rather than when its next generation is learnt."""
        try:
            peer.peek(peer.addr.board[0], 8)
        except OSError as e:
            logger.info("cma: producer %s (pid %d) cannot be read from the engine any more (%s); forgotten",
                        peer_id, peer.addr.pid, e)
            self.disconnect(peer_id)

    def close(self) -> None:
        for peer_id in list(self._peers):
            self.disconnect(peer_id)


def copy_views(d: Descriptors, local: dict[int, memoryview], remote: dict[int, memoryview]) -> None:
    """Copy ``d``'s pieces, each a slice assignment between region views: ``memcpy`` with the GIL
    kept and about 0.2 us of Python a piece, where a ``ctypes`` call costs 0.5 us and its
    arguments' conversion more (a 1-block load's 64 pieces: 250 us against 310-340). The caller
    checked every piece against both regions' sizes."""
    for lr, lo, rr, ro, n in zip(d.local_region.tolist(), d.local_offset.tolist(), d.remote_region.tolist(),
                                 d.remote_offset.tolist(), d.length.tolist(), strict=True):
        local[lr][lo : lo + n] = remote[rr][ro : ro + n]
