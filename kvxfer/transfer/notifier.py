"""The consumer's notices to producer ranks: done, abandon and lease renewals, off the worker.

A notice is a side-channel round trip (up to the client's timeout): sending it from the worker
would stall every load behind one slow producer, so a thread of its own sends them, in order.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from kvxfer.handshake import HandshakeError, SideChannelClient
from kvxfer.protocol import ErrorReply, KVTransferParams, LeaseRenew, RemoteRank
from kvxfer.supervise import report
from kvxfer.transfer.load import Notice

logger = logging.getLogger(__name__)

MAX_RENEW_IDS = 4096  # request ids in one LeaseRenew (the protocol's limit)


def renewals(waiting: list[KVTransferParams], token_for: Callable[[str, RemoteRank], bytes]) -> list[Notice]:
    """The LeaseRenew notices that keep ``waiting`` requests' holds alive: one per producer rank
    and generation (at most MAX_RENEW_IDS ids each), not one per request."""
    by_rank: dict[tuple[str, int, int], tuple[RemoteRank, list[str], str]] = {}
    for p in waiting:
        for r in p.ranks:
            by_rank.setdefault((p.engine_id, r.rank, r.generation), (r, [], p.engine_id))[1].append(p.request_id)
    return [Notice(r, LeaseRenew(request_ids=ids[a : a + MAX_RENEW_IDS], generation=r.generation,
                                 token=token_for(engine, r)))
            for r, ids, engine in by_rank.values() for a in range(0, len(ids), MAX_RENEW_IDS)]


class Notifier:
    """Sends ``Notice``s one at a time, each bounded by the client's timeout.

    Threads: any thread calls ``send`` (a queue put); the notifier thread ("kvxfer-notify-<rank>")
    owns the queue's consumer end and the client's socket for this thread; nothing else."""

    def __init__(self, client: SideChannelClient, rank: int) -> None:
        self.client = client
        # SimpleQueue: a put is one C call (a load's done notice is queued on the fast path)
        self._queue: queue.SimpleQueue[Notice | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-notify-{rank}", daemon=True)
        self._thread.start()

    def send(self, notice: Notice) -> None:
        self._queue.put(notice)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued (each within the client's timeout), then stop; waits ``timeout_s`` at most."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while (notice := self._queue.get()) is not None:
            r, msg = notice.rank, notice.msg
            try:
                reply = self.client.request(r.host, r.port, msg, retries=1)
                if isinstance(reply, ErrorReply):
                    logger.info("producer rank %d answered %s: %s: %s", r.rank, type(msg).__name__,
                                reply.code.value, reply.message)
            except HandshakeError as e:
                logger.warning("%s to producer rank %d not delivered: %s", type(msg).__name__, r.rank, e)
            except Exception as e:  # supervised: the next notice still goes out
                report("consumer notifier", e, f"{type(msg).__name__} to producer rank {r.rank}")
        self.client.close_thread()
