"""The consumer's notices to producer ranks: a request loaded, abandoned, or still waiting.

Each goes through the consumer's notifier thread (:mod:`kvxfer.transfer.notifier`), carrying the
side-channel token of the producer rank's generation. A load the engine's own thread copied
beside a transfer agent (:mod:`kvxfer.agent.engine_loads`) is told here too, so its producers
free their holds as for any other. :class:`ProducerNotices` is a part of
:class:`~kvxfer.transfer.consumer.Consumer` (its state and threads are the consumer's; these run
on the worker thread, or the fast path's caller, holding the turn lock).
"""

from __future__ import annotations

import logging
import queue
import threading

from kvxfer.metrics import ConnectorMetrics
from kvxfer.protocol import Abandon, DoneNotice, KVTransferParams, RemoteRank
from kvxfer.supervise import describe
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.load import EngineCopied, Job, Notice, Peer
from kvxfer.transfer.load_planner import LoadPlanner
from kvxfer.transfer.notifier import Notifier, renewals
from kvxfer.transfer.peers import PeerTable

logger = logging.getLogger(__name__)


class ProducerNotices:
    """The notices of the consumer (mixed into it)."""

    # the consumer's, declared for the methods here
    engine_id: str
    rank: int
    layout: ParallelLayout
    lease_s: float
    notifier: Notifier
    peers: PeerTable
    planner: LoadPlanner
    stats: ConnectorMetrics
    _jobs: queue.Queue[Job]
    _lock: threading.Lock
    _waiting: dict[str, KVTransferParams]

    def _notify_done(self, params: KVTransferParams, peers: dict[int, Peer]) -> None:
        """Tell the producer ranks read (``peers``, by rank) that the request is loaded; rank 0
        also tells those no consumer rank reads, which still wait for one notice."""
        for rr, peer in peers.items():
            self.notifier.send(Notice(_rank_of(params, rr), self._done_notice(params, peer.meta.generation,
                                                                              peer.token)))
        if self.rank == 0:
            unread = self.planner.unread_ranks(params.layout)
            for r in params.ranks:
                if r.rank in unread:
                    self.notifier.send(Notice(r, self._done_notice(params, r.generation,
                                                                   self.peers.token_for(params.engine_id, r))))

    def _done_notice(self, params: KVTransferParams, generation: int, token: bytes) -> DoneNotice:
        return DoneNotice(request_id=params.request_id, engine_id=self.engine_id, rank=self.rank,
                          layout=self.layout, generation=generation, token=token)

    def loaded_by_engine(self, copied: list[EngineCopied]) -> None:
        """Loads the engine's own thread copied beside this consumer's agent (``EngineReads``):
        counted now, and the worker sends their done notices (``_engine_copied``)."""
        for job in copied:
            with self._lock:  # no longer waiting: its holds are not renewed any more
                self._waiting.pop(job.request_id, None)
            self.stats.load_started()
            self.stats.load_finished(job.copied - job.started, job.nbytes,
                                     stages=(0.0, job.planned - job.started, job.copied - job.planned, 0.0))
            self._jobs.put(job)

    def _engine_copied(self, job: EngineCopied) -> None:
        params = job.params
        ranks = {r.rank: r for r in params.ranks}
        peers: dict[int, Peer] = {}
        for rr in self.planner.slices_by_rank(params):
            if rr not in ranks:
                continue
            try:  # known; or forgotten since (a failed read of another load): handshaken again, for its token
                peers[rr] = self.peers.get(params.engine_id, ranks[rr])
            except Exception as e:  # gone or restarted since the copy: its hold ends with it, or at its lease
                logger.info("request %s: no done notice for producer %s rank %d: %s", job.request_id,
                            params.engine_id, rr, describe(e))
        self._notify_done(params, peers)

    def _send_abandon(self, p: KVTransferParams, reason: str) -> None:
        """Tell every producer rank of ``p`` to free the request now (worker thread: it knows the tokens)."""
        for r in p.ranks:
            self.notifier.send(Notice(r, Abandon(request_id=p.request_id, generation=r.generation,
                                                 reason=reason[:1000], token=self.peers.token_for(p.engine_id, r))))

    def _renew_interval(self) -> float:
        """A third of the shortest lease among waiting requests (the producer's, from params)."""
        with self._lock:
            leases = [p.lease_s for p in self._waiting.values()]
        return min([self.lease_s, *leases]) / 3

    def _renew_waiting(self) -> None:
        with self._lock:
            waiting = list(self._waiting.values())
        for notice in renewals(waiting, self.peers.token_for):
            self.notifier.send(notice)


def _rank_of(params: KVTransferParams, rank: int) -> RemoteRank:
    return next(r for r in params.ranks if r.rank == rank)
