"""``same_host: cma`` (the default with one-sided reads): a ucx plane reads the producers on its
own host with CMA.

On one host UCX itself reads with CMA (``process_vm_readv``) when ``UCX_TLS`` lets it: vLLM's
documented NixlConnector setting (``sm,self,tcp``) does, since ``sm`` names CMA too. The ucx
plane leaves CMA out of UCX because, with error handling off, a producer that dies mid-read
makes UCX abort the reading process; without it UCX moves same-host gets over TCP loopback,
which needs the producer's threads on a CPU for every socket refill (on a host whose cores
vLLM's workers spin on, tens to hundreds of milliseconds for 16 MiB). With this option a ucx
plane runs kvxfer's cma plane beside it: the producer publishes the cma plane's address inside
its ucx address, and a consumer reads a producer through the cma plane when the cma plane can
read it (same boot id, and the kernel lets this process read that one: its one-byte probe),
else over UCX. A producer that dies mid-read then fails the read with ESRCH, as on the cma
plane. Each producer's choice is logged once, with the reason when it is UCX; the plane's
counters say how many reads each way took (``cma_*``). The engine's own thread copies small
loads from such producers as it does on the cma plane (``SameHostEngineReads``).

Why it is the default (issue 16, session 31): without CMA, UCX serves a same-host get by software
emulation over shared memory: the producer's progress thread copies every byte into the
consumer's FIFO and the consumer copies it out, two full copies in two processes (raw ucxx, 16 MiB
as 512 x 32 KiB: 2.6 ms of the producer's CPU and the consumer's polling for a 2.9 ms load;
``benchmarks/ucx_rma.py`` prints the CPU per load). With one of two cores taken by an engine's
spinning thread the two copies run one after the other, and the load takes twice as long, raw
ucxx too (busy/idle 0.47-0.61). CMA is one copy, made by the reader. Across hosts UCX reads over
RDMA (the NIC copies) or TCP, as before. ``reads: two-sided`` keeps ``ucx``: a two-sided producer
serves every byte itself, which a CMA reader would bypass, so the two are refused together.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence

import msgspec

from kvxfer.config import DataPlaneValue
from kvxfer.dataplane import BlockPieces, Descriptors, EngineReads

from .wire import UcxAddress

logger = logging.getLogger(__name__)

SAME_HOST = ("ucx", "cma")
# the ucx plane's options the cma plane beside it takes as they are
SHARED_OPTIONS = ("timeout_s", "host")


def same_host_option(options: Mapping[str, DataPlaneValue]) -> str:
    """The ``same_host`` option, checked: ``cma`` (the default with one-sided reads: this host's
    producers with CMA) or ``ucx`` (every producer over UCX; the default with ``reads: two-sided``)."""
    two_sided = options.get("reads") == "two-sided"
    value = options.get("same_host", "ucx" if two_sided else "cma")
    if value not in SAME_HOST:
        raise ValueError(f"connector.data_plane.same_host: expected ucx or cma, got {value!r}")
    if value == "cma" and two_sided:
        raise ValueError("connector.data_plane.same_host: cma lets this host's consumers read the producer's memory "
                         "themselves, which reads: two-sided rules out (every byte served by the producer); "
                         "set same_host: ucx or reads: one-sided")
    return str(value)


def cma_address_of(peer_id: str, address: bytes) -> bytes | None:
    """The cma address a producer's ucx ``address`` carries (None: it runs without ``same_host:
    cma``); raises ConnectionError naming a bad address."""
    try:
        return msgspec.msgpack.decode(address, type=UcxAddress).cma
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ConnectionError(f"peer {peer_id}: bad ucx address: {e}") from None


class SameHostReads:
    """The cma plane beside a ucx plane, and the producers read through it.

    ``peers`` is written by ``connect``/``disconnect`` (the consumer's worker thread, which also
    calls ``read_many``: in a transfer agent, its command thread), never by the UCX loop. The
    cma plane shares the ucx plane's batch id counter, so one ``poll`` may return both planes'
    results without two batches ever having the same id."""

    def __init__(self, options: Mapping[str, DataPlaneValue], batch_ids: Iterator[int]) -> None:
        from kvxfer.connectors.cma import CmaDataPlane

        self.plane = CmaDataPlane({k: options[k] for k in SHARED_OPTIONS if k in options})
        self.plane.share_batch_ids(batch_ids)
        self.peers: set[str] = set()

    def connect(self, peer_id: str, address: bytes | None, token: bytes) -> bool:
        """Whether ``peer_id`` is read through the cma plane from now (``address``: the cma
        address its ucx address carries, None when it runs without ``same_host: cma``)."""
        if address is None:
            self.disconnect(peer_id)  # it was read with CMA at an earlier address: no longer
            logger.info("ucx: peer %s publishes no cma address (its same_host is ucx): read over UCX", peer_id)
            return False
        try:
            self.plane.connect(peer_id, address, token)
        except ConnectionError as e:  # another host, another pid namespace, ptrace denied
            self.disconnect(peer_id)
            logger.info("ucx: peer %s read over UCX, not CMA: %s", peer_id, e)
            return False
        logger.info("ucx: peer %s is on this host: read with CMA (same_host: cma)", peer_id)
        self.peers.add(peer_id)
        return True

    def disconnect(self, peer_id: str) -> bool:
        """Drop ``peer_id`` from the cma plane; whether it was read through it."""
        if peer_id not in self.peers:
            return False
        self.peers.discard(peer_id)
        self.plane.disconnect(peer_id)
        return True

    def split(self, reads: Sequence[tuple[str, str, Descriptors]]) -> tuple[list[int], list[int]]:
        """The positions in ``reads`` of the cma plane's reads and of the others."""
        mine: list[int] = []
        others: list[int] = []
        for i, (peer_id, _, _) in enumerate(reads):
            (mine if peer_id in self.peers else others).append(i)
        return mine, others

    def counters(self) -> dict[str, float]:
        return {"cma_peers": len(self.peers), **{f"cma_{k}": v for k, v in self.plane.counters().items()}}


class SameHostEngineReads(EngineReads):
    """The cma plane's engine reads (the engine's thread copies a small load itself, beside its
    agent) for the producers a ``same_host: cma`` ucx plane reads with CMA: each producer's ucx
    address is opened at the cma address it carries. Threads: as :class:`EngineReads`."""

    def __init__(self, cma: EngineReads) -> None:
        self._cma = cma

    def connect(self, peer_id: str, address: bytes) -> None:
        cma = cma_address_of(peer_id, address)
        if cma is None:
            raise ConnectionError(f"peer {peer_id} publishes no cma address (its same_host is ucx)")
        self._cma.connect(peer_id, cma)

    def disconnect(self, peer_id: str) -> None:
        self._cma.disconnect(peer_id)

    def connected(self, peer_id: str) -> bool:
        return self._cma.connected(peer_id)

    def read(self, request_id: str, reads: Sequence[tuple[str, Descriptors]]) -> bool:
        return self._cma.read(request_id, reads)

    def read_blocks(self, request_id: str, reads: Sequence[tuple[str, BlockPieces, Sequence[int], Sequence[int]]],
                    release_gil: bool = False) -> bool:
        return self._cma.read_blocks(request_id, reads, release_gil)

    def close(self) -> None:
        self._cma.close()
