"""A fault-injecting data plane: a real plane (tcp, cma or ucx) that raises where a test says.

It is a plugin like any other: test_supervision.py registers ``faulty-tcp``, ``faulty-cma`` and
``faulty-ucx`` in the ``kvxfer.connectors`` entry-point group (a dist-info directory on
``sys.path``, which spawned rank processes inherit), and the Connector finds them by name.

Options, beside the wrapped plane's own (``connector.data_plane``):
- ``fault_at``: ``connect``, ``read`` (``read_many`` too: one fault per burst) or ``poll``
  (consumer side), or ``serve`` (producer side:
  the read validator the plane's serving loop calls raises);
- ``fault_exc``: comma-separated exception names, raised one per fault, in order
  (``TimeoutError``, ``OSError``, ``RuntimeError``, ``asyncio.TimeoutError``, ``socket.timeout``);
- ``fault_forever``: raise on every call at ``fault_at`` (``poll``: even with nothing in flight).

``poll`` faults fire only once a read was issued since the last one (so that the fault hits a
load), after the wrapped plane's results were taken: those results are lost, the worst case.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from kvxfer.cache.tensors import MemoryRegion
from kvxfer.config import DataPlaneValue
from kvxfer.dataplane import BatchResult, DataPlane, Descriptors, ReadValidator, TokenChecker, load_data_plane
from kvxfer.protocol import Refusal

FAULT_OPTIONS = frozenset({"fault_at", "fault_exc", "fault_forever"})
EXCEPTIONS: dict[str, type[BaseException]] = {
    "TimeoutError": TimeoutError, "OSError": OSError, "RuntimeError": RuntimeError,
    "asyncio.TimeoutError": asyncio.TimeoutError, "socket.timeout": socket.timeout,
}
SITES = ("connect", "read", "poll", "serve")


class FaultyPlane(DataPlane):
    inner_name: ClassVar[str] = ""

    def __init__(self, options: Mapping[str, DataPlaneValue] | None = None) -> None:
        super().__init__(options)
        opts = dict(self.options)
        self.fault_at = str(opts.pop("fault_at", ""))
        names = [n for n in str(opts.pop("fault_exc", "RuntimeError")).split(",") if n]
        self.forever = bool(opts.pop("fault_forever", False))
        if self.fault_at and self.fault_at not in SITES:
            raise ValueError(f"connector.data_plane.fault_at: expected one of {SITES}, got {self.fault_at!r}")
        unknown = [n for n in names if n not in EXCEPTIONS]
        if unknown:
            raise ValueError(f"connector.data_plane.fault_exc: unknown {unknown}; known {sorted(EXCEPTIONS)}")
        self.pending = [EXCEPTIONS[n] for n in names]
        self.fired: list[str] = []
        self._lock = threading.Lock()
        self._read_since_fault = False
        self.inner = load_data_plane(self.inner_name)(opts)

    def _fault(self, site: str) -> None:
        with self._lock:
            if site != self.fault_at or not (self.pending or self.forever):
                return
            if site == "poll" and not (self._read_since_fault or self.forever):
                return
            self._read_since_fault = False
            exc = self.pending.pop(0) if self.pending else EXCEPTIONS["RuntimeError"]
            self.fired.append(exc.__name__)
        raise exc(f"injected {exc.__name__} in {site}")

    # the engine id the Connector sets goes to the wrapped plane, which sends it to peers
    @property  # type: ignore[override]
    def engine_id(self) -> str:
        return self.inner.engine_id

    @engine_id.setter
    def engine_id(self, value: str) -> None:
        self.inner.engine_id = value

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        self.inner.register(regions)

    def unregister(self, region_ids: Sequence[int]) -> None:
        self.inner.unregister(region_ids)

    def address(self) -> bytes:
        return self.inner.address()

    def connect(self, peer_id: str, address: bytes, token: bytes = b"") -> None:
        self._fault("connect")
        self.inner.connect(peer_id, address, token)

    def disconnect(self, peer_id: str) -> None:
        self.inner.disconnect(peer_id)

    def set_read_validator(self, validator: ReadValidator) -> None:
        def faulty(request_id: str, d: Descriptors) -> Refusal | None:
            self._fault("serve")
            return validator(request_id, d)

        self.inner.set_read_validator(faulty)

    def set_token_checker(self, checker: TokenChecker) -> None:
        self.inner.set_token_checker(checker)

    def set_completion_callback(self, callback: Callable[[], None]) -> None:
        self.inner.set_completion_callback(callback)

    def read(self, peer_id: str, request_id: str, descriptors: Descriptors) -> int:
        self._fault("read")
        batch = self.inner.read(peer_id, request_id, descriptors)
        with self._lock:
            self._read_since_fault = True
        return batch

    def read_many(self, reads: Sequence[tuple[str, str, Descriptors]]) -> list[int]:
        self._fault("read")  # one fault for the whole burst, before any of it is read
        batches = self.inner.read_many(reads)
        with self._lock:
            self._read_since_fault = True
        return batches

    def poll(self) -> list[BatchResult]:
        results = self.inner.poll()
        self._fault("poll")  # the results just taken are lost: the worst case for the consumer
        return results

    def broken(self) -> str | None:
        return self.inner.broken()

    def close(self) -> None:
        self.inner.close()


def _faulty(inner: str) -> type[FaultyPlane]:
    known = load_data_plane(inner).known_options
    attrs: dict[str, Any] = {"name": f"faulty-{inner}", "inner_name": inner,
                             "known_options": None if known is None else known | FAULT_OPTIONS}
    return type(f"Faulty{inner.capitalize()}Plane", (FaultyPlane,), attrs)


FaultyTcpPlane = _faulty("tcp")
FaultyCmaPlane = _faulty("cma")
FaultyUcxPlane = _faulty("ucx")

ENTRY_POINTS = {"faulty-tcp": "faultplane:FaultyTcpPlane", "faulty-cma": "faultplane:FaultyCmaPlane",
                "faulty-ucx": "faultplane:FaultyUcxPlane"}
