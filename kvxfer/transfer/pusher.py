"""The producer side of push mode: tell each decode rank a request is pushed to what is saved.

The decode instance reserved blocks first and handed the prefill instance a
:class:`~kvxfer.protocol.PushTarget`. As the prefill engine saves each layer, this rank sends
every rank of the target a ``LayersReady`` (all the layers saved so far), and those ranks read
the layers into their reserved blocks at once. The receiving side moves the bytes: it checks
its own reservation (lease and generation) before every read, so nothing lands in blocks it
has released, whatever the data plane.

A target that answers with a refusal (its reservation released, expired, or of an older
generation) or cannot be reached ends the push: the hold is released as abandoned, and the
engine frees its blocks (``poll().sending``).
"""

from __future__ import annotations

import logging
import queue
import threading

import msgspec

from kvxfer.handshake import HandshakeError, SideChannelClient
from kvxfer.protocol import ErrorReply, LayersReady, PushTarget, RemoteRank
from kvxfer.supervise import describe, report
from kvxfer.threads import NamedThread
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.producer import HoldRegistry

logger = logging.getLogger(__name__)


class Pusher:
    """Sends push notices for one producer rank.

    Threads: the engine's thread (``save_layer``, ``push``) calls ``notify``, which only queues
    the request id (once while it waits); the pusher thread ``kvxfer-push-<rank>`` owns
    ``_tokens`` and sends the notices, one at a time, each bounded by the client's timeout.
    """

    def __init__(self, engine_id: str, rank: int, layout: ParallelLayout, holds: HoldRegistry,
                 client: SideChannelClient, secret: bytes | None) -> None:
        self.engine_id = engine_id
        self.rank = rank
        self.layout = layout
        self.holds = holds
        self.client = client
        self.secret = secret
        self.sent = 0  # notices delivered
        self._tokens: dict[tuple[str, int, int], bytes] = {}  # (decode engine, rank, generation) -> token
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = NamedThread(target=self._run, name=f"kvxfer-push-{rank}", daemon=True)
        self._thread.start()

    def notify(self, request_id: str) -> None:
        """The request's saved layers or targets changed: send its state (coalesced)."""
        with self._lock:
            if request_id in self._queued:
                return
            self._queued.add(request_id)
        self._queue.put(request_id)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (rid := self._queue.get()) is not None:
            with self._lock:
                self._queued.discard(rid)
            try:
                self._send(rid)
            except Exception as e:  # supervised: the push fails, the thread goes on
                report("pusher", e, f"push of request {rid}")
                self.holds.abandon(rid, f"push failed: {describe(e)}")
        self.client.close_thread()

    def _send(self, rid: str) -> None:
        state = self.holds.push_state(rid)
        if state is None:
            return  # released meanwhile
        params, targets, layers = state
        for target in targets:
            for r in target.ranks:
                why = self._tell(target, r, LayersReady(request_id=target.request_id, generation=r.generation,
                                                        source=params, layers=layers))
                if why is not None:
                    logger.warning("request %s: push to %s rank %d (request %s) ends: %s", rid, target.engine_id,
                                   r.rank, target.request_id, why)
                    self.holds.abandon(rid, f"push target {target.engine_id} rank {r.rank}: {why}")
                    return

    def _tell(self, target: PushTarget, r: RemoteRank, msg: LayersReady) -> str | None:
        """Deliver one notice; why it was refused or undeliverable, or None."""
        key = (target.engine_id, r.rank, r.generation)
        try:
            token = self._tokens.get(key)
            if token is None:
                meta, token = self.client.handshake(r.host, r.port, self.engine_id, self.rank, self.layout,
                                                    self.secret)
                if meta.engine_id != target.engine_id or meta.generation != r.generation:
                    return (f"{r.host}:{r.port} is {meta.engine_id} generation {meta.generation}, expected "
                            f"{target.engine_id} generation {r.generation} (restarted?)")
                self._tokens[key] = token
            reply = self.client.request(r.host, r.port, msgspec.structs.replace(msg, token=token), retries=1)
        except HandshakeError as e:
            self._tokens.pop(key, None)
            return f"unreachable: {e}"
        if isinstance(reply, ErrorReply):
            return f"{reply.code.value}: {reply.message}"
        self.sent += 1
        return None

