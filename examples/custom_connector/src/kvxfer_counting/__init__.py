"""An example third-party data plane: kvxfer's tcp plane plus per-peer byte counters."""

from __future__ import annotations

from collections import Counter

from kvxfer.connector import BatchResult, load_data_plane

TcpDataPlane = load_data_plane("tcp")  # found by entry point, like any other plane


class CountingTcpDataPlane(TcpDataPlane):  # type: ignore[misc,valid-type]
    """Counts the bytes each peer delivered in successful reads."""

    name = "counting-tcp"

    def __init__(self, options=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(options)
        self.bytes_by_peer: Counter[str] = Counter()

    def poll(self) -> list[BatchResult]:
        results = super().poll()
        for r in results:
            if r.ok:
                self.bytes_by_peer[r.peer_id] += r.nbytes
        return results
