"""What an engine and its transfer agent say to each other (msgspec Structs, tagged).

Commands go engine -> agent on the command channel, each answered by one reply. Events go
agent -> engine on the event channel, unasked: what finished, and when the agent sent it. Loads
the engine copied itself go engine -> agent on the copied channel
(:class:`kvxfer.transfer.load.EngineCopied`), which the agent reads only with its periodic events
(so a small load wakes no agent thread).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from kvxfer.protocol import ErrorCode, HandshakeResponse, KVTransferParams, PushTarget


class SharedTensor(msgspec.Struct, frozen=True):
    """One cache tensor the engine shares: ``nbytes`` at ``offset`` in the memory file ``fd``."""

    fd: int
    offset: int
    nbytes: int
    shape: list[int]


class Start(msgspec.Struct, frozen=True, tag=True):
    config: dict[str, Any]  # the InstanceConfig, as builtins
    rank: int
    tensors: list[SharedTensor]
    num_blocks: int
    sys_path: list[str]  # so the agent finds the same connector plugins as the engine


class Hold(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    block_ids: list[int]
    num_tokens: int
    streaming: bool = False


class SaveLayer(msgspec.Struct, frozen=True, tag=True):
    """One-way (no answer): a streaming hold's layer is written."""

    request_id: str
    layer: int


class Push(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    target: PushTarget


class Reserve(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    local_block_ids: list[int]
    num_tokens: int
    num_cached_tokens: int


class Release(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class StartLoad(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    params: KVTransferParams
    local_block_ids: list[int]
    num_cached_tokens: int


class Wait(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    params: KVTransferParams


class AbandonLoad(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    params: KVTransferParams | None
    reason: str


class GetStats(msgspec.Struct, frozen=True, tag=True):
    pass


class Close(msgspec.Struct, frozen=True, tag=True):
    pass


Command = Start | Hold | SaveLayer | Push | Release | StartLoad | Reserve | Wait | AbandonLoad | GetStats | Close


class Ready(msgspec.Struct, frozen=True, tag=True):
    """The agent registered the cache and serves its side channel on ``port``."""

    port: int
    generation: int
    plane: str


class Done(msgspec.Struct, frozen=True, tag=True):
    value: bool = True  # release: whether there was a hold


class Held(msgspec.Struct, frozen=True, tag=True):
    params: KVTransferParams


class Reserved(msgspec.Struct, frozen=True, tag=True):
    target: PushTarget


class HistogramState(msgspec.Struct, frozen=True):
    counts: list[int]
    sum: float
    count: int


class Stats(msgspec.Struct, frozen=True, tag=True):
    snapshot: dict[str, float]
    failed_by_code: dict[str, int]
    handshake: HistogramState
    transfer: HistogramState
    broken: str | None


class Refused(msgspec.Struct, frozen=True, tag=True):
    """The command raised in the agent: ``kind`` says which exception the engine raises."""

    kind: Literal["value", "runtime"]
    message: str


Reply = Ready | Done | Held | Reserved | Stats | Refused


class PeerKnown(msgspec.Struct, frozen=True):
    """A producer rank the agent has handshaken with: what its handshake answered (the engine's
    ``EngineReads`` may then read it itself)."""

    engine_id: str
    meta: HandshakeResponse


class Finished(msgspec.Struct, frozen=True, tag=True):
    """What the agent's connector reported since the last event (the wire form of
    :class:`kvxfer.transfer.aggregator.Finished`)."""

    sending: list[str]
    receiving: list[str]
    failed: dict[str, list[int]]
    errors: dict[str, str]
    codes: dict[str, ErrorCode]
    broken: str | None  # why the agent's rank cannot load any more, or None
    sent_at: float  # time.monotonic() in the agent (CLOCK_MONOTONIC: comparable across processes)
    layers: dict[str, list[int]] = {}  # push: layers of a request newly landed
    peers: list[PeerKnown] = []  # producer ranks newly handshaken


Event = Finished
