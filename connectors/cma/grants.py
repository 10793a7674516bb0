"""The producer side of the cma plane: grants for reads the hold board does not allow.

A consumer whose read the board does not allow (no board, a hold not yet published, a region
without a block stride) asks here over ZMQ; the answer says whether the read is allowed
(regions, holds and token checked by the plane's ``check``) and the consumer then copies
one-sidedly. Nothing is copied here: the producer only answers.

Threads: one, ``kvxfer-cma-grants``; it owns the ROUTER socket, ``_names`` and ``_refused``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from kvxfer.handshake import serve_socket
from kvxfer.protocol import ErrorCode, ReadReply, ReadRequest, Refusal, decode_data, encode
from kvxfer.supervise import describe, report
from kvxfer.threads import NamedThread

logger = logging.getLogger(__name__)

MAX_CONTROL_BYTES = 32 << 20  # a read request of MAX_READ_PIECES pieces is 24 MiB

GrantCheck = Callable[[ReadRequest], tuple[Refusal | None, int]]  # -> (refusal or None, bytes allowed)


class GrantServer:
    """Answers grant requests on a ROUTER socket bound on ``host`` (``address`` says where)."""

    def __init__(self, host: str, check: GrantCheck) -> None:
        self._check = check
        self._closed = False
        self._refused: set[tuple[str, str]] = set()
        self._names: dict[bytes, str] = {}  # control identity -> the engine id it said hello as
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._ctrl = ctx.socket(zmq.ROUTER)
        self._ctrl.setsockopt(zmq.LINGER, 0)
        self._ctrl.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        self.address = f"tcp://{host}:{self._ctrl.bind_to_random_port(f'tcp://{host}')}"
        self._thread = NamedThread(target=self._serve, name="kvxfer-cma-grants", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._closed = True
        self._thread.join(timeout=timeout_s)

    def _serve(self) -> None:
        """Supervised: only ``close`` ends it."""
        serve_socket("cma grants", self._ctrl, self._on_control, lambda: self._closed)
        self._ctrl.close(linger=0)

    def _on_control(self, parts: list[bytes]) -> None:
        if len(parts) != 2:
            return
        ident, payload = parts
        kind, body = payload[:1], payload[1:]
        if kind == b"H":
            self._names[ident] = body.decode(errors="replace")[:256]
            return
        peer = self._names.get(ident, "a consumer that never said hello")
        try:
            msg = decode_data(body)
        except Exception as e:  # malformed: logged once, unanswered
            self._refuse_once(peer, ErrorCode.BAD_MESSAGE, f"undecodable grant request: {e}")
            return
        if isinstance(msg, ReadRequest):
            try:
                reply = self._grant(msg, peer)
            except Exception as e:  # a bug in the check: refused, named, and the next grant is served
                report("cma grants", e, f"read for {msg.request_id} from {peer}")
                reply = ReadReply(batch_id=msg.batch_id, nbytes=0, error=f"granting the read failed: {describe(e)}",
                                  code=ErrorCode.INTERNAL)
            self._ctrl.send_multipart([ident, encode(reply)])

    def _refuse_once(self, peer: str, code: ErrorCode, why: str) -> None:
        key = (peer, code.value)
        if key not in self._refused:
            self._refused.add(key)
            logger.warning("cma data plane refused peer %s: %s", peer, why)

    def _grant(self, req: ReadRequest, peer: str) -> ReadReply:
        why, nbytes = self._check(req)
        if why:
            self._refuse_once(peer, why.code, f"read for {req.request_id}: {why.message}")
            return ReadReply(batch_id=req.batch_id, nbytes=0, error=why.message, code=why.code)
        return ReadReply(batch_id=req.batch_id, nbytes=nbytes)
