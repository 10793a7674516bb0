"""Messages between the launcher's client, the router and the instances (msgspec, msgpack)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvxfer.protocol import MAX_MESSAGE_BYTES, ProtocolError

Tokens = Annotated[list[int], msgspec.Meta(max_length=1 << 20)]


class EngineMessage(msgspec.Struct, tag=True, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    pass


class Generate(EngineMessage, tag="generate"):
    """Client -> router, router -> prefill or combined instance."""

    request_id: str
    prompt: Tokens
    max_tokens: int
    target: bytes | None = None  # push: the decode instance's PushTarget (msgpack); stream the KV there


class Reserve(EngineMessage, tag="reserve"):
    """Router -> decode instance (push mode, first): reserve blocks for this prompt."""

    request_id: str
    prompt: Tokens
    max_tokens: int
    remote_block_size: int  # the prefill instance's: a prefix hit must be a multiple of both


class Reserved(EngineMessage, tag="reserved"):
    """Decode instance -> router: the PushTarget to hand the prefill instance."""

    request_id: str
    target: bytes  # PushTarget, msgpack


class Prefilled(EngineMessage, tag="prefilled"):
    """Prefill instance -> router: the first token and where to read the prompt's KV."""

    request_id: str
    first_token: int
    params: bytes  # KVTransferParams, msgpack


class Decode(EngineMessage, tag="decode"):
    """Router -> decode instance: continue a request; no params means compute the prompt here."""

    request_id: str
    prompt: Tokens
    max_tokens: int
    first_token: int | None = None
    params: bytes | None = None
    pushed: bool = False  # push: the prefill instance has pushed the reserved request's KV


class Generated(EngineMessage, tag="generated"):
    """The finished request: tokens and per-token times (seconds since the instance got it)."""

    request_id: str
    tokens: Tokens
    token_times: list[float]
    kv_bytes: int = 0
    transfer_s: float = 0.0
    loaded: bool = False  # the prompt's KV came from the prefill instance (not recomputed)
    error: str = ""


class Cancel(EngineMessage, tag="cancel"):
    """Client -> router -> instances: drop a request wherever it is; its blocks go back to the
    pools (held KV released, loads abandoned). The router answers the client at once."""

    request_id: str


class Ping(EngineMessage, tag="ping"):
    pass


class Pong(EngineMessage, tag="pong"):
    engine_id: str
    role: str


class StatsQuery(EngineMessage, tag="stats"):
    pass


class Stats(EngineMessage, tag="stats_ok"):
    engine_id: str
    free_blocks: int
    num_blocks: int
    running: int
    connector: dict[str, float]


class KVQuery(EngineMessage, tag="kv"):
    """Debug: the KV of a prompt's full blocks found in the prefix cache, token-major bytes."""

    prompt: Tokens


class KVDump(EngineMessage, tag="kv_ok"):
    num_tokens: int
    data: bytes  # [layers, 2, tokens, kv heads, head size] in the cache dtype, C order


class Shutdown(EngineMessage, tag="shutdown"):
    pass


class Error(EngineMessage, tag="error"):
    message: str


Any_ = Generate | Reserve | Reserved | Prefilled | Decode | Generated | Cancel | Ping | Pong | StatsQuery | Stats | \
    KVQuery | KVDump | Shutdown | Error
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Any_)


def encode(msg: EngineMessage) -> bytes:
    return _enc.encode(msg)


def decode(frame: bytes) -> EngineMessage:
    if len(frame) > MAX_MESSAGE_BYTES * 64:
        raise ProtocolError(f"message of {len(frame)} bytes is too large")
    try:
        return _dec.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"undecodable engine message: {e}") from None
