"""The ZMQ side channel: one server per producer rank, and a client with timeouts.

Every exchange is one request frame and one reply frame (DEALER -> ROUTER), decoded by
:mod:`kvxfer.protocol`. The handshake is a challenge-response so that, with a shared
secret configured, a process without it learns nothing (no regions, no data address)
and can neither read nor release anything:

    client -> Hello(client_nonce)
    server -> Challenge(server_nonce, server_proof = HMAC(secret, "server" | cn | sn))
    client -> HandshakeRequest(proof = HMAC(secret, "client" | sn | cn))
    server -> HandshakeResponse (metadata)

Both sides then derive ``token = HMAC(secret, "token" | cn | sn)``, which later side-channel
messages and data-plane connections carry. The secret never crosses the wire; see
docs/security.md for what this does and does not protect.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import zmq

from kvxfer.protocol import (
    Challenge,
    ErrorCode,
    ErrorReply,
    HandshakeRequest,
    HandshakeResponse,
    Hello,
    Message,
    ProtocolError,
    decode_side,
    encode,
)
from kvxfer.supervise import describe, report, supervised_loop
from kvxfer.threads import NamedThread
from kvxfer.topology import ParallelLayout

logger = logging.getLogger(__name__)

NONCE_BYTES = 16


class HandshakeError(RuntimeError):
    """A handshake failed: the peer was unreachable, refused us, or is incompatible (``code`` says which)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.UNREACHABLE) -> None:
        super().__init__(message)
        self.code = code


class AuthError(HandshakeError):
    """The shared-secret proof did not verify."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.AUTH) -> None:
        super().__init__(message, code)


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"|" + b"|".join(parts), "sha256").digest()


def read_secret(env_name: str | None) -> bytes | None:
    """The shared secret from the environment variable the config names (None: auth off)."""
    if env_name is None:
        return None
    value = os.environ.get(env_name)
    if not value:
        raise ValueError(f"connector.auth.secret_env: environment variable {env_name} is not set or empty")
    return value.encode()


class Authenticator:
    """Server-side auth state: outstanding challenges and the tokens of completed handshakes."""

    def __init__(self, secret: bytes | None, max_entries: int = 4096, challenge_ttl_s: float = 30.0) -> None:
        self.secret = secret
        self._challenges: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()
        self._tokens: OrderedDict[bytes, str] = OrderedDict()
        self._max = max_entries
        self._ttl = challenge_ttl_s
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def challenge(self, hello: Hello) -> Challenge:
        sn = secrets.token_bytes(NONCE_BYTES)
        with self._lock:
            self._challenges[sn] = (hello.client_nonce, time.monotonic() + self._ttl)
            while len(self._challenges) > self._max:
                self._challenges.popitem(last=False)
        proof = _mac(self.secret, b"server", hello.client_nonce, sn) if self.secret else b""
        return Challenge(server_nonce=sn, server_proof=proof)

    def verify(self, req: HandshakeRequest) -> str | None:
        """None if the request answers one of our challenges correctly; else why not."""
        with self._lock:
            entry = self._challenges.pop(req.server_nonce, None)
        if entry is None or entry[1] < time.monotonic() or entry[0] != req.client_nonce:
            return "unknown or expired challenge"
        if self.secret is None:
            return None
        if not hmac.compare_digest(req.proof, _mac(self.secret, b"client", req.server_nonce, req.client_nonce)):
            return "authentication failed"
        token = _mac(self.secret, b"token", req.client_nonce, req.server_nonce)
        with self._lock:
            self._tokens[token] = req.engine_id
            while len(self._tokens) > self._max:
                self._tokens.popitem(last=False)
        return None

    def check_token(self, token: bytes) -> bool:
        if self.secret is None:
            return True
        with self._lock:
            return token in self._tokens


Responder = Callable[[Message, str], Message | None]


def serve_socket(loop: str, sock: zmq.Socket[bytes], handle: Callable[[list[bytes]], None],
                 stopped: Callable[[], bool]) -> None:
    """Hand each multipart message that arrives on ``sock`` to ``handle`` until ``stopped()``.

    Supervised (:func:`kvxfer.supervise.supervised_loop`): an exception from ``handle`` is
    reported and the next message is served. Waits at most 100 ms at a time, so ``stopped``
    is seen promptly. The side-channel server, cma's grant thread and ucx's control thread
    all run on this."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)

    def step() -> None:
        try:
            if not poller.poll(100):
                return
            parts = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        except zmq.ZMQError as e:
            if not stopped():
                logger.warning("%s: receive error: %s", loop, e)
            return
        handle(parts)

    supervised_loop(loop, step, stopped)


class SideChannelServer:
    """A ROUTER socket served by one thread; ``responder`` answers each decoded message."""

    def __init__(self, host: str, port: int, responder: Responder, name: str = "side-channel",
                 max_message_bytes: int | None = None) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes or (4 << 20) + 1024)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if port == 0:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        self.host = host
        self._responder = responder
        self._stop = threading.Event()
        self._refused: set[tuple[str, str]] = set()
        self._thread = NamedThread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        serve_socket("side-channel server", self._sock, self._answer, self._stop.is_set)

    def _answer(self, parts: list[bytes]) -> None:
        if len(parts) != 3 or parts[1] != b"":
            return  # not a DEALER request frame; nothing to answer
        identity, _, frame = parts
        peer = identity.hex()
        try:
            msg = decode_side(frame)
            reply = self._responder(msg, peer)
        except ProtocolError as e:
            self._log_refusal(peer, ErrorCode.BAD_MESSAGE, str(e))
            reply = ErrorReply(code=ErrorCode.BAD_MESSAGE, message=str(e)[:4000])
        except Exception as e:  # a bug in a handler must not kill the server
            report("side-channel handler", e, f"message from peer {peer}")
            reply = ErrorReply(code=ErrorCode.INTERNAL, message=describe(e)[:4000])
        if reply is not None:
            try:
                self._sock.send_multipart([identity, b"", encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.warning("side channel reply to %s dropped: %s", peer, e)

    def _log_refusal(self, peer: str, code: ErrorCode, why: str) -> None:
        key = (peer, code)
        if key not in self._refused:  # once per peer and kind, so a flood cannot flood the log
            self._refused.add(key)
            logger.warning("side channel refused a message from peer %s: %s", peer, why)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)


class SideChannelClient:
    """Request/reply to side-channel servers, each call bounded by a timeout and retries.

    Threads: any; each thread keeps its own open socket per server (``_local``), so a stream of
    notices (a push sends one per layer) pays a TCP connect once, not per message. A socket
    whose request timed out or failed is closed, never reused: a late reply cannot be taken
    for the answer to the next request. At most ``MAX_OPEN`` servers per thread stay open.
    """

    MAX_OPEN = 64

    def __init__(self, timeout_s: float, retries: int) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.timeout_s = timeout_s
        self.retries = retries
        self._local = threading.local()
        self._all: dict[zmq.Socket[bytes], threading.Thread] = {}  # every open socket: its thread
        self._all_lock = threading.Lock()

    def _socket(self, addr: str) -> zmq.Socket[bytes]:
        open_: OrderedDict[str, zmq.Socket[bytes]] = self._local.__dict__.setdefault("open", OrderedDict())
        sock = open_.get(addr)
        if sock is not None:
            open_.move_to_end(addr)
            return sock
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        open_[addr] = sock
        with self._all_lock:
            self._all[sock] = threading.current_thread()
        if len(open_) > self.MAX_OPEN:
            self._drop(*open_.popitem(last=False))
        return sock

    def _drop(self, addr: str, sock: zmq.Socket[bytes]) -> None:
        open_: OrderedDict[str, zmq.Socket[bytes]] = self._local.__dict__.get("open", OrderedDict())
        if open_.get(addr) is sock:
            del open_[addr]
        with self._all_lock:
            self._all.pop(sock, None)
        sock.close(linger=0)

    def close_thread(self) -> None:
        """Close the calling thread's open sockets (a thread that used this client ends)."""
        for addr, sock in list(self._local.__dict__.get("open", OrderedDict()).items()):
            self._drop(addr, sock)

    def close(self) -> None:
        """Close the open sockets of threads that have ended (or of the caller): a zmq socket
        must not be closed under a thread still using it, so a live thread's stay open."""
        me = threading.current_thread()
        with self._all_lock:
            done = [s for s, t in self._all.items() if t is me or not t.is_alive()]
            for s in done:
                del self._all[s]
        for s in done:
            s.close(linger=0)

    def request(self, host: str, port: int, msg: Message, timeout_s: float | None = None,
                retries: int | None = None) -> Message:
        """Send ``msg``, return the decoded reply; HandshakeError after the last attempt."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        attempts = 1 + (self.retries if retries is None else retries)
        frame = encode(msg)
        addr = f"tcp://{host}:{port}"
        last = "no attempt"
        for attempt in range(attempts):
            sock = self._socket(addr)
            keep = False
            try:
                sock.send_multipart([b"", frame])
                if sock.poll(int(timeout * 1000), zmq.POLLIN):
                    parts = sock.recv_multipart()
                    if len(parts) == 2 and parts[0] == b"":
                        reply = decode_side(parts[1])
                        keep = True
                        return reply
                    last = "malformed reply"
                else:
                    last = f"no reply within {timeout:g}s"
            except ProtocolError as e:
                last = f"bad reply: {e}"
            except zmq.ZMQError as e:
                last = f"socket error: {e}"
            finally:
                if not keep:
                    self._drop(addr, sock)
            if attempt + 1 < attempts:
                time.sleep(min(0.05 * 2**attempt, 1.0))
        raise HandshakeError(f"side channel {host}:{port}: {last} (after {attempts} attempt(s))")

    def handshake(self, host: str, port: int, engine_id: str, rank: int, layout: ParallelLayout,
                  secret: bytes | None) -> tuple[HandshakeResponse, bytes]:
        """Challenge-response, then metadata. Returns (metadata, token)."""
        cn = secrets.token_bytes(NONCE_BYTES)
        reply = self.request(host, port, Hello(engine_id=engine_id, client_nonce=cn))
        if isinstance(reply, ErrorReply):
            raise HandshakeError(f"{host}:{port} refused the hello: {reply.code.value}: {reply.message}", reply.code)
        if not isinstance(reply, Challenge):
            raise HandshakeError(f"{host}:{port}: expected a challenge, got {type(reply).__name__}",
                                 ErrorCode.BAD_MESSAGE)
        sn = reply.server_nonce
        if secret is not None and not hmac.compare_digest(reply.server_proof, _mac(secret, b"server", cn, sn)):
            raise AuthError(f"{host}:{port} could not prove the shared secret")
        proof = _mac(secret, b"client", sn, cn) if secret is not None else b""
        req = HandshakeRequest(engine_id=engine_id, rank=rank, layout=layout, client_nonce=cn,
                               server_nonce=sn, proof=proof)
        reply = self.request(host, port, req, retries=0)
        if isinstance(reply, ErrorReply):
            cls = AuthError if reply.code is ErrorCode.AUTH else HandshakeError
            raise cls(f"{host}:{port} refused the handshake: {reply.code.value}: {reply.message}", reply.code)
        if not isinstance(reply, HandshakeResponse):
            raise HandshakeError(f"{host}:{port}: expected handshake metadata, got {type(reply).__name__}",
                                 ErrorCode.BAD_MESSAGE)
        token = _mac(secret, b"token", cn, sn) if secret is not None else b""
        return reply, token
