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
from kvxfer.dataplane import Descriptors, EngineReads
from kvxfer.transfer.hold_board import check_one_sided, row_unchanged

from .mapped import copy_mapped
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

    def connect(self, peer_id: str, address: bytes) -> None:
        peer, one_sided = open_peer(peer_id, address, b"", self.map_memory)
        if not one_sided:
            unmap(peer)
            raise ConnectionError(f"peer {peer_id} publishes no hold board (one_sided: false): every read of it "
                                  f"asks it for a grant")
        self.disconnect(peer_id)
        self._peers[peer_id] = peer

    def disconnect(self, peer_id: str) -> None:
        unmap(self._peers.pop(peer_id, None))

    def connected(self, peer_id: str) -> bool:
        return peer_id in self._peers

    def read(self, request_id: str, reads: Sequence[tuple[str, Descriptors]]) -> bool:
        allowed: list[tuple[Peer, Descriptors, np.ndarray, Pieces, np.ndarray]] = []
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
            allowed.append((peer, d, local.bases, remote, row))
        for peer, d, local_bases, remote, _ in allowed:
            try:
                if remote.mapped is not None:
                    iov = iovecs(d, local_bases, remote.mapped)
                    copy_mapped(iov[0], iov[1], keep_gil=True)
                else:
                    iov = iovecs(d, local_bases, remote.bases)
                    copy_from(peer.addr.pid, iov[0], iov[1], keep_gil=True, nbytes=d.nbytes)
            except OSError as e:
                logger.debug("cma: request %s: the engine's copy failed (%s); the agent loads it", request_id, e)
                return False
        return all(row_unchanged(peer.peek, peer.addr.board, row) for peer, _, _, _, row in allowed)

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
