"""The router: takes requests from clients, has a prefill instance compute the prompt, hands
the params to a decode instance, returns the generated tokens. Round robin over instances.

If no prefill instance answers in time, the request goes to a decode instance without params
(it computes the prompt itself), so a dead prefill instance slows requests down but loses none.

Push mode (``connector.mode: push`` on every instance): the decode instance is asked first to
reserve blocks (``Reserve``); its ``Reserved`` target goes with the prompt to the prefill
instance, which streams each layer's KV there as it computes; the first token then goes to
the decode instance (``Decode(pushed=True)``), which decodes once every layer has landed.

Time to first token is measured to when the decode instance has the first token and the
prompt's KV (its first token time plus when the router first sent it the request), so a pull's
transfer counts as it should.
"""

from __future__ import annotations

import itertools
import logging
import signal
import time
from dataclasses import dataclass

import msgspec
import zmq

from kvxfer.config import InstanceConfig, LaunchConfig, load_instance_config, load_launch_config
from kvxfer.engine import messages as m
from kvxfer.protocol import ProtocolError

logger = logging.getLogger(__name__)


class RoutedGenerated(m.EngineMessage, tag="routed"):
    """Router -> client: the decode instance's answer plus what the router measured."""

    result: m.Generated
    ttft_s: float
    prefill_engine: str
    decode_engine: str
    fallback: bool  # the prefill instance did not answer; the decode instance computed the prompt


@dataclass
class Pending:
    client: bytes
    msg: m.Generate
    received: float
    prefill: str = ""
    decode: str = ""
    ttft_s: float = 0.0
    fallback: bool = False
    stage: str = "prefill"  # push: "reserve" first
    decode_sent: float = 0.0  # when the decode instance was first sent this request


class Router:
    def __init__(self, launch: LaunchConfig, instances: list[InstanceConfig], prefill_timeout_s: float) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.bind(f"tcp://{launch.router.host}:{launch.router.port}")
        self.backs: dict[str, zmq.Socket] = {}
        for cfg in instances:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://{cfg.server.host}:{cfg.server.port}")
            self.backs[cfg.engine_id] = s
        modes = {c.connector.mode for c in instances if c.role != "both"}
        if len(modes) > 1:
            raise ValueError(f"connector.mode: the launch file's instances mix {sorted(modes)}; use one")
        self.push = modes == {"push"}
        self.block_size = {c.engine_id: c.cache.block_size for c in instances}
        self.prefills = [c.engine_id for c in instances if c.role == "prefill"]
        self.decodes = [c.engine_id for c in instances if c.role in ("decode", "both")]
        if not self.decodes:
            raise ValueError("the launch file names no decode (or combined) instance")
        self._p = itertools.cycle(self.prefills) if self.prefills else None
        self._d = itertools.cycle(self.decodes)
        self.prefill_timeout_s = prefill_timeout_s
        self.pending: dict[str, Pending] = {}
        self.stop = False

    def _to(self, engine: str, msg: m.EngineMessage) -> None:
        self.backs[engine].send_multipart([b"", m.encode(msg)])

    def _decode(self, p: Pending, first: int | None, params: bytes | None, pushed: bool = False) -> None:
        if not p.decode:
            p.decode = next(self._d)
            p.decode_sent = time.monotonic()
        p.stage = "decode"
        self._to(p.decode, m.Decode(request_id=p.msg.request_id, prompt=p.msg.prompt, max_tokens=p.msg.max_tokens,
                                    first_token=first, params=params, pushed=pushed))

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop", True))
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        for s in self.backs.values():
            poller.register(s, zmq.POLLIN)
        print("kvxfer: router ready", flush=True)
        while not self.stop:
            events = dict(poller.poll(20))
            if self.front in events:
                self._from_client()
            for engine, s in self.backs.items():
                if s in events:
                    self._from_instance(engine, s)
            self._timeouts()
        self.front.close(linger=0)
        for s in self.backs.values():
            s.close(linger=0)

    def _from_client(self) -> None:
        while True:
            try:
                ident, _, frame = self.front.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = m.decode(frame)
            except ProtocolError as e:
                self.front.send_multipart([ident, b"", m.encode(m.Error(message=str(e)))])
                continue
            if isinstance(msg, m.Ping):
                self.front.send_multipart([ident, b"", m.encode(m.Pong(engine_id="router", role="router"))])
            elif isinstance(msg, m.Shutdown):
                self.front.send_multipart([ident, b"", m.encode(m.Pong(engine_id="router", role="router"))])
                self.stop = True
            elif isinstance(msg, m.Cancel):
                self._cancel(ident, msg)
            elif isinstance(msg, m.Generate):
                p = Pending(ident, msg, time.monotonic())
                self.pending[msg.request_id] = p
                if self._p is None:
                    self._decode(p, None, None)
                elif self.push:  # the decode instance reserves first
                    p.prefill, p.decode, p.stage = next(self._p), next(self._d), "reserve"
                    p.decode_sent = time.monotonic()
                    self._to(p.decode, m.Reserve(request_id=msg.request_id, prompt=msg.prompt,
                                                 max_tokens=msg.max_tokens,
                                                 remote_block_size=self.block_size[p.prefill]))
                else:
                    p.prefill = next(self._p)
                    self._to(p.prefill, msg)

    def _cancel(self, ident: bytes, msg: m.Cancel) -> None:
        """Answer the request's client now; tell the instances that have it to drop it."""
        p = self.pending.pop(msg.request_id, None)
        if p is None:
            return  # finished (or never seen): nothing to drop
        for engine in {p.prefill, p.decode} - {""}:
            self._to(engine, msg)
        out = RoutedGenerated(result=m.Generated(request_id=msg.request_id, tokens=[], token_times=[],
                                                 error="cancelled"),
                              ttft_s=0.0, prefill_engine=p.prefill, decode_engine=p.decode, fallback=p.fallback)
        self.front.send_multipart([p.client, b"", msgspec.msgpack.encode(out)])

    def _from_instance(self, engine: str, s: zmq.Socket) -> None:
        while True:
            try:
                _, frame = s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = m.decode(frame)
            rid: str | None = getattr(msg, "request_id", None)
            p = self.pending.get(rid) if rid else None
            if rid is None or p is None:
                continue  # a late answer for a request already sent on (e.g. after a prefill timeout)
            if isinstance(msg, m.Reserved) and p.stage == "reserve":
                p.stage = "prefill"
                self._to(p.prefill, m.Generate(request_id=rid, prompt=p.msg.prompt, max_tokens=p.msg.max_tokens,
                                               target=msg.target))
            elif isinstance(msg, m.Prefilled) and p.stage == "prefill":
                self._decode(p, msg.first_token, None if self.push else msg.params, pushed=self.push)
            elif isinstance(msg, m.Generated):
                del self.pending[rid]
                if msg.token_times and p.decode_sent:  # the decode instance had the KV and the first token
                    p.ttft_s = p.decode_sent - p.received + msg.token_times[0]
                elif msg.token_times:
                    p.ttft_s = time.monotonic() - p.received - (msg.token_times[-1] - msg.token_times[0])
                out = RoutedGenerated(result=msg, ttft_s=p.ttft_s, prefill_engine=p.prefill, decode_engine=p.decode,
                                      fallback=p.fallback)
                self.front.send_multipart([p.client, b"", msgspec.msgpack.encode(out)])

    def _timeouts(self) -> None:
        now = time.monotonic()
        for p in list(self.pending.values()):
            if p.stage in ("prefill", "reserve") and now - p.received > self.prefill_timeout_s:
                logger.warning("request %s: prefill instance %s did not answer in %.1fs; decode computes the prompt",
                               p.msg.request_id, p.prefill, self.prefill_timeout_s)
                p.fallback = True
                self._decode(p, None, None)


def route(launch_path: str) -> None:
    launch = load_launch_config(launch_path)
    instances = [load_instance_config(p) for p in launch.instances]
    Router(launch, instances, launch.prefill_timeout_s).serve()
