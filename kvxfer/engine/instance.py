"""An instance process: the model, its paged KV cache, the block manager and the connector,
behind a ZMQ socket, scheduled iteration by iteration.

Roles:
- prefill: compute a prompt, hold its blocks through the connector, answer with the first
  token and the ``KVTransferParams``; free the blocks when the connector says the readers
  are done (or the lease ran out);
- decode: reserve blocks for a prompt (local prefix hits are not transferred), load them
  through the connector, commit them, decode. A failed load is discarded and the prompt is
  computed here instead, so the request still completes;
- both: compute and decode everything locally (the monolithic reference for ``--verify``).

Each iteration admits new work, runs at most one prefill, then one decode step for every
running request (iteration-level continuous batching).
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass, field

import torch
import zmq

from kvxfer.cache import Admission, BlockManager, allocate_kv_cache, spec_from_config
from kvxfer.config import InstanceConfig
from kvxfer.connector import Connector
from kvxfer.engine import messages as m
from kvxfer.engine.model import Transformer
from kvxfer.protocol import KVTransferParams, ProtocolError
from kvxfer.topology import ParallelLayout

logger = logging.getLogger(__name__)


@dataclass
class Seq:
    request_id: str
    prompt: list[int]
    max_tokens: int
    reply_to: bytes
    received: float
    generated: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    num_computed: int = 0
    params: KVTransferParams | None = None
    first_token: int | None = None  # from the prefill instance
    load_started: float = 0.0
    kv_bytes: int = 0
    transfer_s: float = 0.0
    loaded: bool = False


class Instance:
    """One rank of a prefill, decode or combined instance (tp = pp = 1 for now)."""

    def __init__(self, cfg: InstanceConfig) -> None:
        if cfg.world_size != 1:
            raise ValueError(f"parallel: the reference engine runs one rank per instance so far; got tp="
                             f"{cfg.parallel.tp} pp={cfg.parallel.pp} (the transfer layer itself handles any TP/PP)")
        if cfg.cache.dtype != cfg.model.dtype:
            raise ValueError(f"cache.dtype: the reference engine stores its KV in the model dtype "
                             f"({cfg.model.dtype}), got {cfg.cache.dtype}")
        self.cfg = cfg
        self.layout = ParallelLayout.from_config(cfg)
        self.model = Transformer(cfg.model, self.layout)
        self.cache = allocate_kv_cache(spec_from_config(cfg), cfg.cache.num_blocks, cfg.cache.device,
                                       cfg.cache.huge_pages)
        self.bm = BlockManager.from_config(cfg.cache)
        self.connector: Connector | None = None
        if cfg.role in ("prefill", "decode"):
            self.connector = Connector.from_config(cfg, 0)
            self.connector.register_kv_caches(self.cache)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://{cfg.server.host}:{cfg.server.port}")
        self.prefill_queue: list[Seq] = []
        self.decode_queue: list[Seq] = []  # decode requests waiting for blocks
        self.loading: dict[str, Seq] = {}
        self.held: dict[str, Seq] = {}
        self.running: list[Seq] = []
        self.stop = False

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop", True))
        logger.info("%s instance %s serving on %s:%d", self.cfg.role, self.cfg.engine_id, self.cfg.server.host,
                    self.cfg.server.port)
        try:
            progressed = False
            while not self.stop:
                busy = bool(self.running) or progressed
                if self.sock.poll(0 if busy else 2):
                    self._drain()
                self._poll_connector()
                self._admit_decodes()
                progressed = bool(self.prefill_queue) and self._prefill(self.prefill_queue.pop(0))
                if self.running:
                    self._decode_step()
        finally:
            self.close()

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
            self.connector = None
        self.sock.close(linger=0)

    def _send(self, to: bytes, msg: m.EngineMessage) -> None:
        self.sock.send_multipart([to, b"", m.encode(msg)])

    def _drain(self) -> None:
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 3:
                continue
            ident, _, frame = parts
            try:
                self._handle(ident, m.decode(frame))
            except (ProtocolError, ValueError) as e:
                logger.warning("refused a message: %s", e)
                self._send(ident, m.Error(message=str(e)))

    def _handle(self, ident: bytes, msg: m.EngineMessage) -> None:
        now = time.monotonic()
        if isinstance(msg, m.Generate):
            if self.cfg.role == "decode":
                raise ValueError(f"{self.cfg.engine_id} is a decode instance; send it Decode, not Generate")
            self._check_prompt(msg.prompt, msg.max_tokens)
            self.prefill_queue.append(Seq(msg.request_id, list(msg.prompt), msg.max_tokens, ident, now))
        elif isinstance(msg, m.Decode):
            if self.cfg.role == "prefill":
                raise ValueError(f"{self.cfg.engine_id} is a prefill instance; it does not decode")
            self._check_prompt(msg.prompt, msg.max_tokens)
            seq = Seq(msg.request_id, list(msg.prompt), msg.max_tokens, ident, now, first_token=msg.first_token)
            if msg.params is not None and self.connector is not None:
                seq.params = KVTransferParams.from_bytes(msg.params)
                self.connector.wait(seq.request_id, seq.params)  # renew the producer's lease while queued
                self.decode_queue.append(seq)
            else:
                self.prefill_queue.append(seq)
        elif isinstance(msg, m.Ping):
            self._send(ident, m.Pong(engine_id=self.cfg.engine_id, role=self.cfg.role))
        elif isinstance(msg, m.StatsQuery):
            self._send(ident, m.Stats(engine_id=self.cfg.engine_id, free_blocks=self.bm.num_free_blocks,
                                      num_blocks=self.bm.num_blocks,
                                      running=len(self.running) + len(self.loading) + len(self.held),
                                      connector=self.connector.stats() if self.connector else {}))
        elif isinstance(msg, m.KVQuery):
            self._send(ident, self._kv_dump(msg.prompt))
        elif isinstance(msg, m.Shutdown):
            self._send(ident, m.Pong(engine_id=self.cfg.engine_id, role=self.cfg.role))
            self.stop = True
        else:
            raise ValueError(f"unexpected {type(msg).__name__}")

    def _check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        v = self.cfg.model.vocab_size
        if not prompt or min(prompt) < 0 or max(prompt) >= v:
            raise ValueError(f"prompt: expected 1+ token ids in [0, {v})")
        if max_tokens < 1 or len(prompt) + max_tokens > self.cfg.model.max_position:
            raise ValueError(f"max_tokens: expected >= 1 and prompt + max_tokens <= {self.cfg.model.max_position}")

    # ------------------------------------------------------------------ model
    def _forward(self, seq: Seq, tokens: list[int], start: int) -> int:
        """Compute tokens at positions start.. (writing their KV); return the greedy next token."""
        alloc = self.bm.get(seq.request_id)
        table = torch.as_tensor(alloc.block_ids, dtype=torch.int64)
        positions = torch.arange(start, start + len(tokens))
        hidden = self.model.embed_tokens(torch.as_tensor(tokens))
        hidden = self.model.forward_layers(hidden, positions, self.cache, table, start + len(tokens))
        return int(torch.argmax(self.model.logits(hidden[-1:])[0]))

    def _growth(self) -> int:
        """Blocks the requests already admitted may still take as they decode."""
        total = 0
        for seq in [*self.running, *self.loading.values()]:
            if seq.request_id in self.bm.requests:
                final = self.bm.blocks_needed(len(seq.prompt) + seq.max_tokens)
                total += max(0, final - len(self.bm.get(seq.request_id).blocks))
        return total

    def _admission(self, seq: Seq, max_cached_tokens: int | None) -> Admission:
        """Admit only what can also finish decoding: prompt and output blocks, and the growth
        the running requests are still owed, above the watermark."""
        decodes_here = self.cfg.role != "prefill"
        extra = seq.max_tokens if decodes_here else 0
        need = self.bm.blocks_needed(len(seq.prompt) + extra)
        if need > self.bm.num_blocks - self.bm.watermark_blocks:
            return Admission.NEVER
        adm = self.bm.admit(seq.prompt, max_cached_tokens=max_cached_tokens)
        if adm is not Admission.OK:
            return adm
        spare = self.bm.num_free_blocks - self.bm.watermark_blocks - (self._growth() if decodes_here else 0)
        return Admission.OK if spare >= need else Admission.LATER

    def _prefill(self, seq: Seq) -> bool:
        """Compute a prompt; False (and back to the queue head) when it must wait for blocks."""
        adm = self._admission(seq, max_cached_tokens=0)
        if adm is Admission.NEVER:
            self._finish(seq, error=f"prompt of {len(seq.prompt)} tokens and {seq.max_tokens} output tokens can "
                                    f"never fit this cache")
            return True
        if adm is Admission.LATER:
            self.prefill_queue.insert(0, seq)
            return False
        self.bm.allocate(seq.request_id, seq.prompt, max_cached_tokens=0)
        first = self._forward(seq, seq.prompt, 0)
        self.bm.commit(seq.request_id)
        seq.num_computed = len(seq.prompt)
        now = time.monotonic() - seq.received
        if self.cfg.role == "prefill":
            assert self.connector is not None
            params = self.connector.hold(seq.request_id, self.bm.get(seq.request_id).block_ids, len(seq.prompt))
            self.held[seq.request_id] = seq
            self._send(seq.reply_to, m.Prefilled(request_id=seq.request_id, first_token=first,
                                                 params=params.to_bytes()))
            return True
        # combined, or a decode instance computing the prompt itself (no params, or a failed load)
        seq.generated = [seq.first_token if seq.first_token is not None else first]
        seq.token_times = [now]
        self._after_first(seq)
        return True

    def _after_first(self, seq: Seq) -> None:
        if len(seq.generated) >= seq.max_tokens:
            self._finish(seq)
        else:
            self.running.append(seq)

    def _decode_step(self) -> None:
        for seq in list(self.running):
            token = seq.generated[-1]
            try:
                self.bm.append_tokens(seq.request_id, [token])
            except ValueError as e:
                self.running.remove(seq)
                self._finish(seq, error=f"out of KV blocks while decoding: {e}")
                continue
            nxt = self._forward(seq, [token], seq.num_computed)
            seq.num_computed += 1
            seq.generated.append(nxt)
            seq.token_times.append(time.monotonic() - seq.received)
            if len(seq.generated) >= seq.max_tokens:
                self.running.remove(seq)
                self._finish(seq)

    def _finish(self, seq: Seq, error: str = "") -> None:
        if seq.request_id in self.bm.requests:
            self.bm.free(seq.request_id)
        self._send(seq.reply_to, m.Generated(request_id=seq.request_id, tokens=seq.generated,
                                             token_times=seq.token_times, kv_bytes=seq.kv_bytes,
                                             transfer_s=seq.transfer_s, loaded=seq.loaded, error=error))

    # ------------------------------------------------------------------ transfers
    def _admit_decodes(self) -> None:
        assert self.connector is not None or not self.decode_queue
        while self.decode_queue:
            seq = self.decode_queue[0]
            assert seq.params is not None and self.connector is not None
            align = math.lcm(self.cfg.cache.block_size, seq.params.block_size)
            hit = len(self.bm.prefix_hits(seq.prompt)) * self.cfg.cache.block_size
            cached = hit // align * align
            adm = self._admission(seq, max_cached_tokens=cached)
            if adm is Admission.LATER:
                return  # the lease is renewed meanwhile
            self.decode_queue.pop(0)
            if adm is Admission.NEVER:
                self.connector.abandon(seq.request_id, seq.params, "cannot fit the decode cache")
                self._finish(seq, error=f"prompt of {len(seq.prompt)} tokens and {seq.max_tokens} output tokens "
                                        f"can never fit this cache")
                continue
            alloc = self.bm.reserve(seq.request_id, seq.prompt, timeout_s=self.cfg.connector.timeouts.reservation_s,
                                    max_cached_tokens=cached)
            seq.load_started = time.monotonic()
            try:
                self.connector.start_load(seq.request_id, seq.params, alloc.block_ids, alloc.num_cached_tokens)
            except ValueError as e:
                logger.warning("request %s: cannot load (%s); computing the prompt here", seq.request_id, e)
                self.bm.discard(seq.request_id)
                self.prefill_queue.append(seq)
                continue
            self.loading[seq.request_id] = seq

    def _poll_connector(self) -> None:
        if self.connector is None:
            return
        f = self.connector.poll()
        for rid in f.sending:  # prefill side: the readers are done with these blocks
            seq = self.held.pop(rid, None)
            if seq is not None and rid in self.bm.requests:
                self.bm.free(rid)
        for rid in f.receiving:
            seq = self.loading.pop(rid)
            self.bm.commit(rid)
            seq.loaded = True
            seq.transfer_s = time.monotonic() - seq.load_started
            spec = self.cache.spec
            seq.kv_bytes = (len(seq.prompt) - self.bm.get(rid).num_cached_tokens) * spec.bytes_per_block // \
                spec.block_size
            seq.num_computed = len(seq.prompt)
            seq.generated = [seq.first_token if seq.first_token is not None else 0]
            seq.token_times = [time.monotonic() - seq.received]
            self._after_first(seq)
        for rid, invalid in f.failed.items():
            seq = self.loading.pop(rid)
            logger.warning("request %s: KV load failed (%s); %d blocks recycled, computing the prompt here",
                           rid, f.errors.get(rid, "?"), len(invalid))
            self.bm.discard(rid)
            self.prefill_queue.append(seq)

    def _kv_dump(self, prompt: list[int]) -> m.KVDump:
        """Token-major K and V of the prompt's full blocks that sit in the prefix cache."""
        blocks = [b.block_id for b in self.bm.prefix_hits(prompt)]
        spec = self.cache.spec
        n = len(blocks) * spec.block_size
        ids = torch.as_tensor(blocks, dtype=torch.int64)
        out = []
        for layer in spec.layers:
            for view in self.cache.layer_kv(layer):
                assert view is not None
                b = view.index_select(0, ids)
                if spec.layout == "HND":
                    b = b.transpose(1, 2)
                out.append(b.reshape(n, spec.num_kv_heads, spec.storage_head_size))
        data = torch.stack(out).contiguous() if out else torch.zeros(0)
        return m.KVDump(num_tokens=n, data=data.numpy().tobytes())


def serve(cfg: InstanceConfig) -> None:
    """Run an instance until it is told to shut down (or gets SIGTERM)."""
    torch.set_num_threads(1)  # instances share a small machine; the model is tiny
    inst = Instance(cfg)
    print(f"kvxfer: {cfg.role} instance {cfg.engine_id} ready on {cfg.server.host}:{cfg.server.port}", flush=True)
    inst.serve()


