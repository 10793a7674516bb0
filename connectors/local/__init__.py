"""The ``local`` data plane: reads between ranks of one process, by memmove.

It is the memcpy limit of a transfer (the baseline every other connector is measured
against) and the data plane of an instance whose prefill and decode share a process.
Registered through the ``kvxfer.connectors`` entry point like any other connector.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence

from kvxfer.cache.tensors import MemoryRegion
from kvxfer.config import DataPlaneValue
from kvxfer.dataplane import BatchResult, DataPlane, Descriptors, ReadValidator, check_bounds
from kvxfer.protocol import ErrorCode, Refusal

logger = logging.getLogger(__name__)

# Planes of this process by address, so a peer's address resolves to its regions.
_PLANES: weakref.WeakValueDictionary[bytes, LocalDataPlane] = weakref.WeakValueDictionary()


class LocalDataPlane(DataPlane):
    """Copies descriptors between two planes of the same process (synchronously)."""

    name = "local"
    cross_process = False

    def __init__(self, options: Mapping[str, DataPlaneValue] | None = None) -> None:
        super().__init__(options)
        self._address = b"local:" + uuid.uuid4().hex.encode()
        self._regions: dict[int, MemoryRegion] = {}
        self._peers: dict[str, LocalDataPlane] = {}
        self._validator: ReadValidator | None = None
        self._results: list[BatchResult] = []
        self._batch_ids = itertools.count()
        self._closed = False
        self._on_complete: Callable[[], None] | None = None
        _PLANES[self._address] = self

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        for r in regions:
            if r.device != "cpu":
                raise ValueError(
                    f"region {r.region_id}: the local data plane moves host memory only, got {r.device}"
                )
            if r.region_id in self._regions:
                raise ValueError(f"region {r.region_id} is already registered")
        self._regions.update({r.region_id: r for r in regions})

    def unregister(self, region_ids: Sequence[int]) -> None:
        for rid in region_ids:
            self._regions.pop(rid, None)

    def set_completion_callback(self, callback: Callable[[], None]) -> None:
        self._on_complete = callback

    def address(self) -> bytes:
        return self._address

    def connect(self, peer_id: str, address: bytes, token: bytes = b"") -> None:
        peer = _PLANES.get(address)
        if peer is None or peer._closed:
            raise ConnectionError(f"peer {peer_id}: no local data plane at {address!r} in this process")
        self._peers[peer_id] = peer

    def set_read_validator(self, validator: ReadValidator) -> None:
        self._validator = validator

    def _serve_check(self, request_id: str, d: Descriptors) -> Refusal | None:
        why = check_bounds(self._regions, d.remote_region, d.remote_offset, d.length)
        if why is not None:
            return Refusal(ErrorCode.OUT_OF_BOUNDS, why)
        return self._validator(request_id, d) if self._validator is not None else None

    def read(self, peer_id: str, request_id: str, descriptors: Descriptors) -> int:
        if self._closed:
            raise RuntimeError("local data plane is closed")
        batch_id = next(self._batch_ids)
        peer = self._peers.get(peer_id)
        d = descriptors
        if peer is None or peer._closed:
            error: Refusal | None = Refusal(ErrorCode.PEER_LOST, f"peer {peer_id} is not connected")
        else:
            bounds = check_bounds(self._regions, d.local_region, d.local_offset, d.length)
            error = Refusal(ErrorCode.OUT_OF_BOUNDS, bounds) if bounds else peer._serve_check(request_id, d)
            if error is not None:
                logger.warning("peer %s refused read for %s: %s", peer_id, request_id, error.message)
        if error is None:
            assert peer is not None  # no refusal: the peer was found connected above
            src_base = {i: r.address for i, r in peer._regions.items()}
            dst_base = {i: r.address for i, r in self._regions.items()}
            for rr, ro, lr, lo, n in zip(
                d.remote_region.tolist(), d.remote_offset.tolist(), d.local_region.tolist(),
                d.local_offset.tolist(), d.length.tolist(), strict=True,
            ):
                ctypes.memmove(dst_base[lr] + lo, src_base[rr] + ro, n)
        if error is None:
            self._results.append(BatchResult(batch_id, peer_id, request_id, d.nbytes))
        else:
            self._results.append(BatchResult.failed(batch_id, peer_id, request_id, error.code, error.message))
        if self._on_complete is not None:
            self._on_complete()
        return batch_id

    def poll(self) -> list[BatchResult]:
        out, self._results = self._results, []
        return out

    def close(self) -> None:
        self._closed = True
        self._peers.clear()
        _PLANES.pop(self._address, None)
