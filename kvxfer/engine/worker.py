"""One rank of an instance: its slice of the model, its KV cache and its connector.

The scheduler (rank 0's :class:`~kvxfer.engine.instance.Instance`) decides; every rank runs
the same list of commands in the same order, so the collectives inside the model (the TP
all-reduce, the PP hand-over of hidden states) pair up. Commands and replies are msgspec
structs: rank 0 sends them to the other ranks over a ZMQ socket (see
:mod:`kvxfer.engine.ranks`), and runs them on its own worker directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import numpy as np
import torch

from kvxfer.cache import allocate_kv_cache, spec_from_config
from kvxfer.config import InstanceConfig
from kvxfer.connector import Connector, EngineConnector
from kvxfer.engine.model import Span, Transformer
from kvxfer.metrics import MetricsServer
from kvxfer.protocol import ErrorCode, KVTransferParams, PushTarget
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.aggregator import Finished

logger = logging.getLogger(__name__)


class Command(msgspec.Struct, tag=True, tag_field="op", forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


class ForwardSpan(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Compute ``tokens`` at positions ``start..`` of a request whose blocks are ``block_ids``."""

    block_ids: list[int]
    tokens: list[int]
    start: int
    save_as: str | None = None  # push: after each layer, save_layer(save_as, layer) on this rank


class Forward(Command, tag="forward", frozen=True):
    """One forward pass over a batch of requests (a prefill, or a decode step)."""

    spans: list[ForwardSpan]


class Hold(Command, tag="hold", frozen=True):
    request_id: str
    block_ids: list[int]
    num_tokens: int
    streaming: bool = False  # push: held before the forward pass, each layer readable once saved
    target: bytes | None = None  # push: the decode side's PushTarget (msgpack)


class Reserve(Command, tag="reserve", frozen=True):
    """Decode side, push: reserve ``block_ids`` for a prompt a prefill instance will push."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    num_cached_tokens: int


class Wait(Command, tag="wait", frozen=True):
    request_id: str
    params: bytes


class StartLoad(Command, tag="load", frozen=True):
    request_id: str
    params: bytes
    block_ids: list[int]
    num_cached_tokens: int


class Abandon(Command, tag="abandon", frozen=True):
    request_id: str
    params: bytes | None  # None: a push reservation
    reason: str


class Release(Command, tag="release", frozen=True):
    """Prefill side: free a hold now (its request was cancelled)."""

    request_id: str


class Poll(Command, tag="poll", frozen=True):
    pass


class DumpKV(Command, tag="dump", frozen=True):
    block_ids: list[int]


class StatsOf(Command, tag="stats", frozen=True):
    pass


class Stop(Command, tag="stop", frozen=True):
    pass


AnyCommand = Forward | Hold | Reserve | Wait | StartLoad | Abandon | Release | Poll | DumpKV | StatsOf | Stop


class FinishedMsg(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    sending: list[str]
    receiving: list[str]
    failed: dict[str, list[int]]
    errors: dict[str, str]
    codes: dict[str, ErrorCode] = {}


class Reply(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """What one rank answers to one command; only the field the command asks for is set."""

    tokens: list[int] | None = None  # a Forward's next token per span, from the last PP stage
    params: bytes | None = None  # a Hold's KVTransferParams, a Reserve's PushTarget
    finished: FinishedMsg | None = None
    data: bytes | None = None
    stats: dict[str, float] | None = None


class Step(msgspec.Struct, forbid_unknown_fields=True):
    seq: int
    commands: list[AnyCommand]


class StepReply(msgspec.Struct, forbid_unknown_fields=True):
    seq: int
    rank: int
    replies: list[Reply]
    error: str = ""


step_encoder = msgspec.msgpack.Encoder()
step_decoder = msgspec.msgpack.Decoder(Step)
reply_decoder = msgspec.msgpack.Decoder(StepReply)


class Worker:
    """Model slice, cache and connector of rank ``rank`` (= pp_rank * tp + tp_rank)."""

    def __init__(self, cfg: InstanceConfig, rank: int,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 send: Callable[[torch.Tensor, int], None] | None = None,
                 recv: Callable[[torch.Tensor, int], object] | None = None) -> None:  # result (sender rank) unused
        self.cfg = cfg
        self.rank = rank
        self.layout = ParallelLayout.from_config(cfg)
        self.tp_rank, self.pp_rank = rank % cfg.parallel.tp, rank // cfg.parallel.tp
        self.model = Transformer(cfg.model, self.layout, self.tp_rank, self.pp_rank, all_reduce)
        self.send, self.recv = send, recv
        self.metrics_server: MetricsServer | None = None
        self.cache = allocate_kv_cache(spec_from_config(cfg, self.pp_rank), cfg.cache.num_blocks, cfg.cache.device,
                                       cfg.cache.huge_pages)
        self.connector: EngineConnector | None = None
        if cfg.role in ("prefill", "decode"):
            self.connector = Connector.from_config(cfg, rank)
            self.connector.register_kv_caches(self.cache)
        self.refused = Finished()  # loads this rank refused to start, reported at the next poll
        if cfg.server.metrics_port is not None and self.connector is not None:
            try:
                self.metrics_server = MetricsServer(cfg.server.host, cfg.server.metrics_port + rank if
                                                    cfg.server.metrics_port else 0)
            except ValueError:
                self.close()
                raise
            self.metrics_server.add(self.connector.metrics)

    def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        if self.connector is not None:
            self.connector.close()
            self.connector = None

    def run(self, commands: list[AnyCommand]) -> list[Reply]:
        return [self.execute(c) for c in commands]

    def execute(self, cmd: AnyCommand) -> Reply:
        if isinstance(cmd, Forward):
            return Reply(tokens=self.forward(cmd))
        if isinstance(cmd, Poll):
            return Reply(finished=self.poll())
        if isinstance(cmd, DumpKV):
            return Reply(data=self.dump_kv(cmd.block_ids))
        if isinstance(cmd, StatsOf):
            return Reply(stats=self.connector.stats() if self.connector is not None else {})
        if isinstance(cmd, Stop):
            return Reply()
        conn = self.connector
        if conn is None:
            raise RuntimeError(f"{type(cmd).__name__}: a {self.cfg.role} instance has no connector")
        if isinstance(cmd, Hold):
            params = conn.hold(cmd.request_id, cmd.block_ids, cmd.num_tokens, streaming=cmd.streaming)
            if cmd.target is not None:
                conn.push(cmd.request_id, PushTarget.from_bytes(cmd.target))
            return Reply(params=params.to_bytes())
        if isinstance(cmd, Reserve):
            return Reply(params=conn.reserve(cmd.request_id, cmd.block_ids, cmd.num_tokens,
                                             cmd.num_cached_tokens).to_bytes())
        if isinstance(cmd, Release):
            conn.release(cmd.request_id)
            return Reply()
        if isinstance(cmd, Abandon) and cmd.params is None:
            conn.abandon(cmd.request_id, None, cmd.reason)
            return Reply()
        assert cmd.params is not None
        params = KVTransferParams.from_bytes(cmd.params)
        if isinstance(cmd, Wait):
            conn.wait(cmd.request_id, params)
        elif isinstance(cmd, StartLoad):
            try:
                conn.start_load(cmd.request_id, params, cmd.block_ids, cmd.num_cached_tokens)
            except ValueError as e:
                # the other ranks may have started theirs: the scheduler frees the blocks only once
                # every rank has reported the request, so this rank reports it as failed at the next poll
                logger.warning("rank %d: request %s: cannot load: %s", self.rank, cmd.request_id, e)
                self.refused.failed[cmd.request_id] = list(cmd.block_ids)
                self.refused.errors[cmd.request_id] = str(e)
                self.refused.codes[cmd.request_id] = ErrorCode.BAD_PARAMS
        else:
            conn.abandon(cmd.request_id, params, cmd.reason)
        return Reply()

    def forward(self, cmd: Forward) -> list[int] | None:
        """This rank's stages of the forward pass; the last stage returns each span's greedy next token."""
        model = self.model
        lengths = [len(s.tokens) for s in cmd.spans]
        if model.first_stage:
            hidden = [model.embed_tokens(torch.as_tensor(s.tokens)) for s in cmd.spans]
        else:  # the previous stage's output, all spans packed in one tensor
            assert self.recv is not None
            packed = torch.empty(sum(lengths), self.cfg.model.hidden_size, dtype=model.dtype)
            self.recv(packed, self.layout.rank(self.tp_rank, self.pp_rank - 1))
            hidden = list(packed.split(lengths))
        spans = [Span(torch.arange(s.start, s.start + len(s.tokens)), torch.as_tensor(s.block_ids, dtype=torch.int64),
                      s.start + len(s.tokens)) for s in cmd.spans]
        saves = [s.save_as for s in cmd.spans if s.save_as is not None]
        conn = self.connector

        def saved(layer: int) -> None:  # push: this layer's K/V of every span is written
            assert conn is not None
            for rid in saves:
                try:
                    conn.save_layer(rid, layer)
                except (ValueError, RuntimeError) as e:  # the push is over (hold released, agent gone):
                    # the forward pass goes on; the decode side fails its load and computes the prompt
                    logger.warning("rank %d: request %s: layer %d not pushed: %s", self.rank, rid, layer, e)

        hidden = model.forward_layers(hidden, spans, self.cache, after_layer=saved if saves and conn else None)
        if not model.last_stage:
            assert self.send is not None
            self.send(torch.cat(hidden), self.layout.rank(self.tp_rank, self.pp_rank + 1))
            return None
        return [int(torch.argmax(model.logits(h[-1:])[0])) for h in hidden]

    def poll(self) -> FinishedMsg:
        f = self.connector.poll() if self.connector is not None else Finished()
        if self.refused:
            f.extend(self.refused)
            self.refused = Finished()
        return FinishedMsg(sending=f.sending, receiving=f.receiving, failed=f.failed, errors=f.errors, codes=f.codes)

    def dump_kv(self, block_ids: list[int]) -> bytes:
        """Token-major K and V of ``block_ids``: [local layers, 2, tokens, local heads, head size]."""
        spec = self.cache.spec
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        n = len(block_ids) * spec.block_size
        out = []
        for layer in spec.layers:
            kv = []
            for view in self.cache.layer_kv(layer):
                assert view is not None
                b = view.index_select(0, ids)
                if spec.layout == "HND":
                    b = b.transpose(1, 2)
                kv.append(b.reshape(n, spec.num_kv_heads, spec.storage_head_size))
            out.append(torch.stack(kv))
        return torch.stack(out).contiguous().numpy().tobytes() if out else b""


def assemble_kv(cfg: InstanceConfig, parts: list[bytes], num_tokens: int) -> np.ndarray:
    """The whole instance's KV from every rank's :meth:`Worker.dump_kv`:
    [layers, 2, tokens, kv heads, head size] (a replicated head is taken from its first owner)."""
    layout = ParallelLayout.from_config(cfg)
    spec0 = spec_from_config(cfg, 0)
    dtype = spec0.torch_dtype
    out = torch.zeros(layout.num_layers, 2, num_tokens, layout.num_kv_heads, spec0.storage_head_size, dtype=dtype)
    for rank, data in enumerate(parts):
        tp_rank, pp_rank = rank % layout.tp_size, rank // layout.tp_size
        layers, heads = layout.layers_of(pp_rank), layout.heads_of(tp_rank)
        if layout.owners_of_head(heads.start).start != tp_rank:
            continue  # a replica of a head an earlier rank gave
        part = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.zeros(0, dtype=dtype)
        part = part.view(len(layers), 2, num_tokens, len(heads), spec0.storage_head_size)
        out[layers.start : layers.stop, :, :, heads.start : heads.stop] = part
    return out.numpy()
