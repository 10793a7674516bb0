"""Every message that crosses a process: msgspec Structs, msgpack encoded, one tagged union.

Nothing from the network is unpickled: frames are size-checked, then decoded by msgspec
into these types, which refuses anything else (unknown tags, wrong types, missing fields).
``PROTOCOL_VERSION`` travels in every message; a peer with another version is refused.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from typing import Annotated, TypeVar

import msgspec

from kvxfer.topology import ParallelLayout

PROTOCOL_VERSION = 3  # 2: refusals carry an ErrorCode; 3: push (LayersReady, PushTarget, not_ready)
MAX_MESSAGE_BYTES = 4 << 20  # side-channel frames; a handshake response is a few KiB
MAX_READ_PIECES = 1 << 20  # descriptors in one data-plane read request
MAX_DONE_IDS = 4096  # request ids in one DoneNotices (4096 of the longest ids: 1 MiB)

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Nonce = Annotated[bytes, msgspec.Meta(max_length=64)]


class ErrorCode(str, enum.Enum):
    """Why a message, a read or a load was refused or failed. Code acts on these; the message
    beside each code is for people, and no control flow reads it."""

    NOT_HELD = "not_held"  # the producer holds no such request (yet, or any more)
    NOT_READY = "not_ready"  # push: a read of layers the producer has not saved yet
    OUT_OF_BOUNDS = "out_of_bounds"  # a piece outside the registered regions or the request's blocks
    EXPIRED = "expired"  # the hold's lease or abort limit passed
    AUTH = "auth"  # no valid shared-secret proof or handshake token
    INCOMPATIBLE = "incompatible"  # the peers' models, KV specs or layouts cannot be mapped
    BAD_MESSAGE = "bad_message"  # undecodable, too large, wrong version
    BAD_PARAMS = "bad_params"  # KVTransferParams that do not describe a readable request
    STALE_GENERATION = "stale_generation"  # the producer restarted since the params were made
    UNKNOWN_REQUEST = "unknown_request"  # a notice for a request this rank does not hold
    UNEXPECTED = "unexpected"  # a message this server does not answer
    UNREACHABLE = "unreachable"  # no reply from the peer's side channel
    PEER_LOST = "peer_lost"  # the data connection closed or failed mid-read
    TIMEOUT = "timeout"  # a bounded wait ran out
    CANCELLED = "cancelled"  # given up on purpose (e.g. a retired ucx receive worker)
    PLANE_BROKEN = "plane_broken"  # the data plane cannot go on; every load on it fails
    INTERNAL = "internal"  # a bug or unexpected exception inside kvxfer or a plugin


class ProtocolError(ValueError):
    """A frame was refused: too large, undecodable, or of the wrong version."""

    code = ErrorCode.BAD_MESSAGE


@dataclass(frozen=True)
class Refusal:
    """A typed refusal: what code acts on, and the human message that goes with it."""

    code: ErrorCode
    message: str

    def __str__(self) -> str:
        return self.message


class Message(msgspec.Struct, tag=True, tag_field="type", forbid_unknown_fields=True, frozen=True,
              kw_only=True):
    version: int = PROTOCOL_VERSION


class RegionInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A registered region as a peer sees it (no address: the data plane resolves ids)."""

    region_id: int
    length: int
    block_stride: int
    num_blocks: int
    layers: tuple[int, int]
    kind: str


class SpecInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The KV cache essentials two ranks must agree on, or repack between."""

    num_layers: int  # layers this rank holds
    first_layer: int
    num_kv_heads: int  # heads this rank holds
    head_size: int
    block_size: int
    dtype: str
    layout: str
    kv_split: bool
    mla: bool
    cross_layer: bool
    kv_fused: bool = False
    fused_order: str = ""  # the kernel's order inside a fused block ("vec", ...; "" not known)


# ------------------------------------------------------------------ side channel

class Hello(Message, tag="hello", frozen=True):
    """Client's first message; opens the challenge-response."""

    engine_id: Id
    client_nonce: Nonce


class Challenge(Message, tag="challenge", frozen=True):
    """Server's nonce, and its proof that it knows the shared secret (empty without auth)."""

    server_nonce: Nonce
    server_proof: bytes = b""


class HandshakeRequest(Message, tag="handshake", frozen=True):
    engine_id: Id
    rank: int
    layout: ParallelLayout
    client_nonce: Nonce
    server_nonce: Nonce
    proof: bytes = b""  # HMAC(secret, client proof) when auth is on


class HandshakeResponse(Message, tag="handshake_ok", frozen=True):
    engine_id: Id
    rank: int
    tp_rank: int
    pp_rank: int
    generation: int
    layout: ParallelLayout
    spec: SpecInfo
    regions: list[RegionInfo]
    data_plane: str  # the connector name
    data_address: bytes
    compat_hash: str
    model: str


class DoneNotice(Message, tag="done", frozen=True):
    """A consumer rank read what it needed of a request (or was told to count as a reader)."""

    request_id: Id
    engine_id: Id  # the consumer's
    rank: int  # the consumer's global rank
    layout: ParallelLayout  # the consumer's, so the producer knows how many readers to expect
    generation: int  # the producer's generation the consumer read from
    token: bytes = b""


class DoneNotices(Message, tag="dones", frozen=True):
    """``DoneNotice`` for several requests at once: a consumer rank's notices to one producer rank
    that were queued together (a burst of loads finishing) go as one round trip."""

    request_ids: Annotated[list[Id], msgspec.Meta(min_length=1, max_length=MAX_DONE_IDS)]
    engine_id: Id  # the consumer's
    rank: int  # the consumer's global rank
    layout: ParallelLayout  # the consumer's
    generation: int  # the producer's generation the consumer read from
    token: bytes = b""


class LeaseRenew(Message, tag="renew", frozen=True):
    """The consumer still means to read these requests; extend their holds."""

    request_ids: Annotated[list[Id], msgspec.Meta(max_length=4096)]
    generation: int
    token: bytes = b""


class Abandon(Message, tag="abandon", frozen=True):
    """The consumer will not read this request (dropped, or failed): free it now."""

    request_id: Id
    generation: int
    reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    token: bytes = b""


class Ack(Message, tag="ack", frozen=True):
    pass


class ErrorReply(Message, tag="error", frozen=True):
    code: ErrorCode
    message: Annotated[str, msgspec.Meta(max_length=4096)]




# ------------------------------------------------------------------ data plane (socket framing)

class ReadRequest(Message, tag="read", frozen=True):
    """Pieces the consumer wants, in the order it will receive them.

    The three arrays are little-endian int64, packed (numpy ``tobytes``).
    """

    request_id: Id
    batch_id: int
    regions: bytes
    offsets: bytes
    lengths: bytes
    token: bytes = b""
    # several requests' pieces read as one (ucx, tcp: a burst of small loads, one reply): the pieces
    # split, in order, into these (request id, piece count) parts, the first ``request_id``'s, each
    # checked against its own request's hold. Empty: every piece is ``request_id``'s.
    parts: list[tuple[Id, int]] = []


class ReadReply(Message, tag="read_ok", frozen=True):
    """Precedes ``nbytes`` of raw data (ok) or nothing (error set)."""

    batch_id: int
    nbytes: int
    error: str = ""  # the refusal's message; empty when the data follows
    code: ErrorCode | None = None  # the refusal's code


class DataHello(Message, tag="data_hello", frozen=True):
    """First frame on a data connection: proves it belongs to an authenticated handshake."""

    engine_id: Id
    token: bytes = b""


DataPlaneMessage = ReadRequest | ReadReply | DataHello | ErrorReply

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def _decode(frame: bytes | bytearray | memoryview, decoder: msgspec.msgpack.Decoder, limit: int) -> Message:
    if len(frame) > limit:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the limit of {limit}")
    try:
        msg = decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"undecodable message: {e}") from None
    if msg.version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.version}, expected {PROTOCOL_VERSION}")
    return msg


def decode_side(frame: bytes | memoryview, limit: int = MAX_MESSAGE_BYTES) -> Message:
    """Decode one side-channel frame (size-checked, typed, version-checked)."""
    return _decode(frame, _side, limit)


def decode_data(frame: bytes | bytearray | memoryview, limit: int = MAX_MESSAGE_BYTES) -> Message:
    """Decode one data-plane control frame."""
    return _decode(frame, _data, limit)


def compat_hash(model: str, num_layers: int, num_kv_heads: int, head_size: int, dtype: str, mla: bool) -> str:
    """What two instances must share for their KV bytes to mean the same thing."""
    key = f"{model}|{num_layers}|{num_kv_heads}|{head_size}|{dtype}|{mla}|v{PROTOCOL_VERSION}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


# ------------------------------------------------------------------ handed from prefill to decode

class RemoteRank(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where one producer rank's side channel listens, and which registration it serves."""

    rank: int
    host: str
    port: int
    generation: int


_H = TypeVar("_H", bound="Handed")


class Handed(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What one instance hands another through the router or an engine's request: msgpack bytes,
    size-checked and typed on the way in."""

    def to_bytes(self) -> bytes:
        return _encoder.encode(self)

    @classmethod
    def from_bytes(cls: type[_H], data: bytes) -> _H:
        if len(data) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"{cls.__name__} of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ProtocolError(f"undecodable {cls.__name__}: {e}") from None


class KVTransferParams(Handed, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the prefill instance returns for a request and the router hands to decode."""

    request_id: Id
    engine_id: Id
    num_tokens: int
    block_ids: list[int]
    block_size: int
    layout: ParallelLayout
    ranks: list[RemoteRank]
    lease_s: float



_Merged = TypeVar("_Merged", "KVTransferParams", "PushTarget")


def _merge(parts: list[_Merged], same: tuple[str, ...]) -> _Merged:
    """Per-rank params (or targets) as one: every field in ``same`` agrees, ``ranks`` united."""
    if not parts:
        raise ValueError("merge: nothing to merge")
    first = parts[0]
    for p in parts[1:]:
        for f in same:
            if getattr(p, f) != getattr(first, f):
                raise ValueError(f"merge: ranks disagree on {f}: {getattr(first, f)!r} vs {getattr(p, f)!r}")
    ranks = sorted({r.rank: r for p in parts for r in p.ranks}.values(), key=lambda r: r.rank)
    return msgspec.structs.replace(first, ranks=ranks)


def merge_params(parts: list[KVTransferParams]) -> KVTransferParams:
    """One instance-level params from the per-rank params its workers returned."""
    return _merge(parts, ("request_id", "engine_id", "num_tokens", "block_ids", "block_size", "layout"))


# ------------------------------------------------------------------ push mode

class PushTarget(Handed, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the decode instance returns from ``reserve`` and the router hands to prefill (push
    mode): where the decode ranks listen and what they reserved. The prefill side tells those
    ranks, layer by layer, what it has saved; they read it into the reserved blocks."""

    request_id: Id  # the decode side's id of the reservation
    engine_id: Id
    num_tokens: int
    num_cached_tokens: int  # tokens the decode side already has (a prefix hit): not sent
    layout: ParallelLayout
    ranks: list[RemoteRank]
    lease_s: float  # how long the decode side keeps the reservation (timeouts.reservation_s)



def merge_targets(parts: list[PushTarget]) -> PushTarget:
    """One instance-level push target from the per-rank targets its workers returned."""
    return _merge(parts, ("request_id", "engine_id", "num_tokens", "num_cached_tokens", "layout"))


class LayersReady(Message, tag="layers", frozen=True):
    """Producer rank -> consumer rank (push): these layers of the request are saved; read them.

    ``layers`` lists every layer the producer rank has saved so far (global ids), so notices
    are idempotent and a late one repeats what an earlier one said."""

    request_id: Id  # the consumer's reservation
    generation: int  # the consumer rank's registration
    source: KVTransferParams  # the producer rank's params (``ranks``: that rank alone)
    layers: Annotated[list[int], msgspec.Meta(max_length=65536)]
    token: bytes = b""


SideChannelMessage = Hello | Challenge | HandshakeRequest | HandshakeResponse | DoneNotice | DoneNotices | \
    LeaseRenew | Abandon | Ack | ErrorReply | LayersReady

# built here, after every message type (LayersReady needs KVTransferParams); used by decode_side/decode_data
_side = msgspec.msgpack.Decoder(SideChannelMessage)
_data = msgspec.msgpack.Decoder(DataPlaneMessage)
