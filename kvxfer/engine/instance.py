"""An instance process: the model, its paged KV cache, the block manager and the connector,
behind a ZMQ socket, scheduled iteration by iteration.

Roles:
- prefill: compute a prompt, hold its blocks through the connector, answer with the first
  token and the ``KVTransferParams``; free the blocks when the connector says the readers
  are done (or the lease ran out);
- decode: reserve blocks for a prompt (local prefix hits are not transferred), load them
  through the connector, commit them, decode. A failed load is discarded and the prompt is
  computed here instead, so the request still completes;
- push mode (``connector.mode: push``): the decode instance reserves first (``Reserve``) and
  answers with a PushTarget; the prefill instance holds the prompt's blocks before computing
  them and saves each layer as its forward pass writes it, so the decode side reads layer by
  layer while the prefill runs; the decode instance decodes once every layer has landed and
  the first token has come (``Decode(pushed=True)``);
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

from kvxfer.cache import Admission, BlockManager, spec_from_config
from kvxfer.config import InstanceConfig
from kvxfer.engine import messages as m
from kvxfer.engine.ranks import Ranks
from kvxfer.engine.worker import (
    Abandon,
    AnyCommand,
    DumpKV,
    Forward,
    ForwardSpan,
    Hold,
    Poll,
    Release,
    Reply,
    Reserve,
    StartLoad,
    StatsOf,
    Wait,
    assemble_kv,
)
from kvxfer.protocol import KVTransferParams, ProtocolError, PushTarget, merge_params, merge_targets
from kvxfer.topology import ParallelLayout, check_compatible
from kvxfer.transfer.aggregator import Finished, FinishedAggregator

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50


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
    cancelled: bool = False  # dropped while its KV was loading: freed when the load ends, no answer
    target: bytes | None = None  # prefill, push: the decode instance's PushTarget
    push: bool = False  # decode, push: blocks reserved for a prefill instance to push into
    remote_block_size: int = 0  # decode, push: the prefill instance's block size


class Instance:
    """The scheduler of a prefill, decode or combined instance; it runs in rank 0's process and
    drives every rank (one process per TP/PP rank) through :class:`~kvxfer.engine.ranks.Ranks`."""

    def __init__(self, cfg: InstanceConfig, config_path: str | None = None) -> None:
        if cfg.cache.dtype != cfg.model.dtype:
            raise ValueError(f"cache.dtype: the reference engine stores its KV in the model dtype "
                             f"({cfg.model.dtype}), got {cfg.cache.dtype}")
        par = cfg.parallel
        for name, size, n in (("num_heads", par.tp, cfg.model.num_heads),
                              ("intermediate_size", par.tp, cfg.model.intermediate_size)):
            if n % size:
                raise ValueError(f"parallel.tp: the reference engine splits model.{name}={n} across tp ranks; "
                                 f"tp={size} does not divide it")
        self.cfg = cfg
        self.layout = ParallelLayout.from_config(cfg)
        self.transfers = cfg.role in ("prefill", "decode")
        # KV bytes of one block summed over every rank (what a load moves per block)
        self.bytes_per_block = sum(spec_from_config(cfg, s).bytes_per_block for s in range(par.pp)) * par.tp
        self.last_rank = self.layout.rank(0, par.pp - 1)  # its replies carry the sampled tokens
        self.bm = BlockManager.from_config(cfg.cache)
        self.ranks = Ranks(cfg, config_path)
        self.finished = FinishedAggregator(cfg.world_size)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self.sock.bind(f"tcp://{cfg.server.host}:{cfg.server.port}")
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"server: cannot listen on {cfg.server.host}:{cfg.server.port}: {e}") from None
        self.prefill_queue: list[Seq] = []
        self.decode_queue: list[Seq] = []  # decode requests waiting for blocks
        self.loading: dict[str, Seq] = {}
        self.pushed: dict[str, Seq] = {}  # push: every layer landed, waiting for the first token
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
                waiting = self.loading or self.held or self.decode_queue or self.prefill_queue
                # idle: wake on a message, or every IDLE_POLL_MS to poll the connectors (and
                # heartbeat the other ranks); a transfer in flight is polled every 2 ms
                if self.sock.poll(0 if busy else 2 if waiting else IDLE_POLL_MS):
                    self._drain()
                self._poll_connector()
                self._admit_decodes()
                progressed = bool(self.prefill_queue) and self._prefill(self.prefill_queue.pop(0))
                if self.running:
                    self._decode_step()
        finally:
            self.close()

    def close(self) -> None:
        if hasattr(self, "sock"):
            self.sock.close(linger=0)
        if hasattr(self, "ranks"):
            self.ranks.close()

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
            seq = Seq(msg.request_id, list(msg.prompt), msg.max_tokens, ident, now)
            if msg.target is not None:
                self._check_target(msg.target, len(msg.prompt))
                seq.target = msg.target
            self.prefill_queue.append(seq)
        elif isinstance(msg, m.Reserve):
            if not self.transfers or self.cfg.role != "decode":
                raise ValueError(f"{self.cfg.engine_id} is a {self.cfg.role} instance; only a decode instance "
                                 "reserves blocks for a push")
            self._check_prompt(msg.prompt, msg.max_tokens)
            if msg.remote_block_size < 1:
                raise ValueError(f"remote_block_size: expected >= 1, got {msg.remote_block_size}")
            self.decode_queue.append(Seq(msg.request_id, list(msg.prompt), msg.max_tokens, ident, now, push=True,
                                         remote_block_size=msg.remote_block_size))
        elif isinstance(msg, m.Decode) and self._reserved(msg.request_id) is not None:
            self._continue_push(ident, msg)
        elif isinstance(msg, m.Decode) and msg.pushed:  # a push this instance already finished (or failed)
            logger.info("request %s: pushed, but no longer here; ignored", msg.request_id)
        elif isinstance(msg, m.Decode):
            if self.cfg.role == "prefill":
                raise ValueError(f"{self.cfg.engine_id} is a prefill instance; it does not decode")
            self._check_prompt(msg.prompt, msg.max_tokens)
            seq = Seq(msg.request_id, list(msg.prompt), msg.max_tokens, ident, now, first_token=msg.first_token)
            if msg.params is not None and self.transfers:
                seq.params = KVTransferParams.from_bytes(msg.params)
                self._on_all(Wait(request_id=seq.request_id, params=msg.params))  # renew the leases while queued
                self.decode_queue.append(seq)
            else:
                self.prefill_queue.append(seq)
        elif isinstance(msg, m.Cancel):
            self._cancel(msg.request_id)
        elif isinstance(msg, m.Ping):
            self._send(ident, m.Pong(engine_id=self.cfg.engine_id, role=self.cfg.role))
        elif isinstance(msg, m.StatsQuery):
            self._send(ident, m.Stats(engine_id=self.cfg.engine_id, free_blocks=self.bm.num_free_blocks,
                                      num_blocks=self.bm.num_blocks,
                                      running=len(self.running) + len(self.loading) + len(self.held),
                                      connector=self._connector_stats()))
        elif isinstance(msg, m.KVQuery):
            self._send(ident, self._kv_dump(msg.prompt))
        elif isinstance(msg, m.Shutdown):
            self._send(ident, m.Pong(engine_id=self.cfg.engine_id, role=self.cfg.role))
            self.stop = True
        else:
            raise ValueError(f"unexpected {type(msg).__name__}")

    def _check_target(self, raw: bytes, num_tokens: int) -> None:
        """A push target must fit this instance (checked here: a rank refusing it would stop)."""
        target = PushTarget.from_bytes(raw)
        check_compatible(self.layout, target.layout)
        if target.num_tokens != num_tokens or not target.ranks:
            raise ValueError(f"push target {target.request_id}: reserved {target.num_tokens} tokens on "
                             f"{len(target.ranks)} ranks for a prompt of {num_tokens}")

    def _reserved(self, rid: str) -> Seq | None:
        """A push request of this decode instance: queued for blocks, loading, landed, or (its
        push failed) being computed here."""
        seq = self.loading.get(rid) or self.pushed.get(rid)
        if seq is None:
            seq = next((q for q in (*self.decode_queue, *self.prefill_queue, *self.running) if q.request_id == rid),
                       None)
        return seq if seq is not None and seq.push else None

    def _continue_push(self, ident: bytes, msg: m.Decode) -> None:
        """The prefill instance pushed the request (the first token comes with it), or did not
        answer in time (compute the prompt here; a reservation in flight is abandoned)."""
        rid = msg.request_id
        seq = self._reserved(rid)
        assert seq is not None
        seq.reply_to = ident
        if msg.pushed and msg.first_token is not None:
            if seq.first_token is None and seq not in self.running:
                seq.first_token = msg.first_token
            landed = self.pushed.pop(rid, None)
            if landed is not None:
                self._start_decoding(landed)
            return
        if seq in self.prefill_queue or seq in self.running:  # its push failed: computed here already
            return
        if seq in self.decode_queue:
            self.decode_queue.remove(seq)
            self.prefill_queue.append(seq)
        elif rid in self.loading:  # fails at a poll soon, and the prompt is computed then
            self._on_all(Abandon(request_id=rid, params=None, reason="the prefill instance did not answer"))
        elif rid in self.pushed:  # the KV is here but not the first token: compute it
            del self.pushed[rid]
            self.bm.free(rid)
            self.prefill_queue.append(seq)

    def _cancel(self, rid: str) -> None:
        """Drop a request wherever it is (the router has answered its client): queued, held for
        readers, waiting for blocks, loading, or decoding. Unknown ids are already done."""
        for queue in (self.prefill_queue, self.decode_queue):
            for seq in [q for q in queue if q.request_id == rid]:
                queue.remove(seq)
                if seq.params is not None and queue is self.decode_queue and not seq.push:
                    self._on_all(Abandon(request_id=rid, params=seq.params.to_bytes(), reason="cancelled"))
        if rid in self.held:  # prefill: the decode side will not read it
            del self.held[rid]
            self._on_all(Release(request_id=rid))
        if rid in self.loading:  # the data plane may still be writing its blocks: free them when it stops
            loading = self.loading[rid]
            loading.cancelled = True
            raw = loading.params.to_bytes() if loading.params is not None else None  # None: a push reservation
            self._on_all(Abandon(request_id=rid, params=raw, reason="cancelled"))
            return
        self.pushed.pop(rid, None)
        for seq in [q for q in self.running if q.request_id == rid]:
            self.running.remove(seq)
        if rid in self.bm.requests:
            self.bm.free(rid)

    def _check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        v = self.cfg.model.vocab_size
        if not prompt or min(prompt) < 0 or max(prompt) >= v:
            raise ValueError(f"prompt: expected 1+ token ids in [0, {v})")
        if max_tokens < 1 or len(prompt) + max_tokens > self.cfg.model.max_position:
            raise ValueError(f"max_tokens: expected >= 1 and prompt + max_tokens <= {self.cfg.model.max_position}")

    # ------------------------------------------------------------------ model
    def _on_all(self, cmd: AnyCommand) -> list[Reply]:
        """Run one command on every rank; each rank's reply."""
        return [replies[0] for replies in self.ranks.run([cmd])]

    def _forward(self, work: list[tuple[Seq, list[int], int]], save: bool = False) -> list[int]:
        """For each (request, tokens, start): compute the tokens at positions start.. on every
        rank (writing their KV), in one batch; the greedy next token of each. ``save`` (push):
        every rank saves each layer of these requests as soon as it is written."""
        spans = [ForwardSpan(block_ids=list(self.bm.get(seq.request_id).block_ids), tokens=tokens, start=start,
                             save_as=seq.request_id if save else None)
                 for seq, tokens, start in work]
        tokens = self._on_all(Forward(spans=spans))[self.last_rank].tokens
        assert tokens is not None and len(tokens) == len(work)
        return tokens

    def _connector_stats(self) -> dict[str, float]:
        """Every rank's connector counters, summed."""
        total: dict[str, float] = {}
        for r in self._on_all(StatsOf()):
            for k, v in (r.stats or {}).items():
                total[k] = total.get(k, 0.0) + v
        return total

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
        push = self.cfg.role == "prefill" and seq.target is not None
        if push:  # held before it is computed: each layer is read as soon as it is saved
            hold = Hold(request_id=seq.request_id, block_ids=list(self.bm.get(seq.request_id).block_ids),
                        num_tokens=len(seq.prompt), streaming=True, target=seq.target)
            params = merge_params([KVTransferParams.from_bytes(r.params or b"") for r in self._on_all(hold)])
            self.held[seq.request_id] = seq
        (first,) = self._forward([(seq, seq.prompt, 0)], save=push)
        self.bm.commit(seq.request_id)
        seq.num_computed = len(seq.prompt)
        now = time.monotonic() - seq.received
        if self.cfg.role == "prefill":
            if not push:
                hold = Hold(request_id=seq.request_id, block_ids=list(self.bm.get(seq.request_id).block_ids),
                            num_tokens=len(seq.prompt))
                params = merge_params([KVTransferParams.from_bytes(r.params or b"") for r in self._on_all(hold)])
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
        """One token for every running request, in one step on the ranks."""
        batch = []
        for seq in list(self.running):
            try:
                self.bm.append_tokens(seq.request_id, [seq.generated[-1]])
            except ValueError as e:
                self.running.remove(seq)
                self._finish(seq, error=f"out of KV blocks while decoding: {e}")
                continue
            batch.append(seq)
        tokens = self._forward([(seq, [seq.generated[-1]], seq.num_computed) for seq in batch]) if batch else []
        for seq, nxt in zip(batch, tokens, strict=True):
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
        while self.decode_queue:
            seq = self.decode_queue[0]
            remote_bs = seq.remote_block_size if seq.push else seq.params.block_size if seq.params else 0
            align = math.lcm(self.cfg.cache.block_size, remote_bs)
            hit = len(self.bm.prefix_hits(seq.prompt)) * self.cfg.cache.block_size
            cached = hit // align * align
            if seq.push:  # a reservation pushes at least one token (the prefill computes them all anyway)
                cached = min(cached, (len(seq.prompt) - 1) // align * align)
            adm = self._admission(seq, max_cached_tokens=cached)
            if adm is Admission.LATER:
                return  # the lease is renewed meanwhile
            self.decode_queue.pop(0)
            if adm is Admission.NEVER:
                if seq.params is not None:
                    self._on_all(Abandon(request_id=seq.request_id, params=seq.params.to_bytes(),
                                         reason="cannot fit the decode cache"))
                self._finish(seq, error=f"prompt of {len(seq.prompt)} tokens and {seq.max_tokens} output tokens "
                                        f"can never fit this cache")
                continue
            alloc = self.bm.reserve(seq.request_id, seq.prompt, timeout_s=self.cfg.connector.timeouts.reservation_s,
                                    max_cached_tokens=cached)
            seq.load_started = time.monotonic()
            if seq.push:
                replies = self._on_all(Reserve(request_id=seq.request_id, block_ids=list(alloc.block_ids),
                                               num_tokens=len(seq.prompt), num_cached_tokens=alloc.num_cached_tokens))
                target = merge_targets([PushTarget.from_bytes(r.params or b"") for r in replies])
                self.loading[seq.request_id] = seq
                self._send(seq.reply_to, m.Reserved(request_id=seq.request_id, target=target.to_bytes()))
                continue
            assert seq.params is not None
            params = seq.params.to_bytes()
            # a rank that cannot start its part reports the request failed at the next poll
            self._on_all(StartLoad(request_id=seq.request_id, params=params, block_ids=list(alloc.block_ids),
                                   num_cached_tokens=alloc.num_cached_tokens))
            self.loading[seq.request_id] = seq

    def _poll_connector(self) -> None:
        if not self.transfers:
            return
        f = Finished()
        for rank, r in enumerate(self._on_all(Poll())):
            assert r.finished is not None
            w = r.finished
            f.extend(self.finished.add(rank, Finished(w.sending, w.receiving, w.failed, w.errors, w.codes)))
        for rid in f.sending:  # prefill side: the readers are done with these blocks
            seq = self.held.pop(rid, None)
            if seq is not None and rid in self.bm.requests:
                self.bm.free(rid)
        for rid in f.receiving:
            seq = self.loading.pop(rid)
            if seq.cancelled:
                self.bm.discard(rid)
                continue
            self.bm.commit(rid)
            seq.loaded = True
            seq.transfer_s = time.monotonic() - seq.load_started
            seq.kv_bytes = (len(seq.prompt) - self.bm.get(rid).num_cached_tokens) * self.bytes_per_block // \
                self.cfg.cache.block_size
            seq.num_computed = len(seq.prompt)
            if seq.push and seq.first_token is None:  # landed before the prefill instance's answer
                self.pushed[rid] = seq
                continue
            self._start_decoding(seq)
        for rid, invalid in f.failed.items():
            seq = self.loading.pop(rid)
            if seq.cancelled:
                self.bm.discard(rid)
                continue
            logger.warning("request %s: KV load failed (%s); %d blocks recycled, computing the prompt here",
                           rid, f.errors.get(rid, "?"), len(invalid))
            self.bm.discard(rid)
            self.prefill_queue.append(seq)

    def _start_decoding(self, seq: Seq) -> None:
        """The prompt's KV is here and its first token known: decode from here."""
        seq.generated = [seq.first_token if seq.first_token is not None else 0]
        seq.token_times = [time.monotonic() - seq.received]
        self._after_first(seq)

    def _kv_dump(self, prompt: list[int]) -> m.KVDump:
        """Token-major K and V of the prompt's full blocks that sit in the prefix cache, gathered
        from every rank: [layers, 2, tokens, kv heads, head size]."""
        blocks = [b.block_id for b in self.bm.prefix_hits(prompt)]
        n = len(blocks) * self.cfg.cache.block_size
        parts = [r.data or b"" for r in self._on_all(DumpKV(block_ids=blocks))]
        return m.KVDump(num_tokens=n, data=assemble_kv(self.cfg, parts, n).tobytes())


def serve(cfg: InstanceConfig, config_path: str | None = None) -> None:
    """Run an instance (rank 0, which starts the other ranks) until it is told to shut down."""
    torch.set_num_threads(1)  # instances share a small machine; the model is tiny
    inst = Instance(cfg, config_path)
    print(f"kvxfer: {cfg.role} instance {cfg.engine_id} ready on {cfg.server.host}:{cfg.server.port}", flush=True)
    inst.serve()


