"""What two ucx planes exchange: the address in the handshake, the hello, and the tags and
reply header of the UCX messages. One place for the format both sides must agree on."""

from __future__ import annotations

import struct

import msgspec

from kvxfer.protocol import ErrorCode

MAX_CONTROL_BYTES = 32 << 20  # a read request of MAX_READ_PIECES pieces is 24 MiB
HEADER_BYTES = 4096  # a reply's first message: REPLY_LENGTH, the encoded ReadReply, zero padding
KIND_HEADER, KIND_DATA = 2, 3
REPLY_LENGTH = struct.Struct("<I")  # the header's first 4 bytes: the encoded ReadReply's length
GRANT_ONLY = -1  # a read request's chunk size that asks for a grant on the control socket: the consumer gets the bytes


def message_tag(plane: int, kind: int, seq: int) -> int:
    """The UCX tag of one reply message: the consumer's plane, the kind, and the batch, so that
    replies to the reads in flight on one receive worker never match each other's receives."""
    return (plane & 0xFFFF) << 48 | (kind & 0xFF) << 40 | (seq & 0xFF_FFFF_FFFF)


class UcxAddress(msgspec.Struct, frozen=True):
    """What a plane publishes in the kvxfer handshake: where peers reach it over UCX and ZMQ."""

    worker: bytes
    plane: int
    control: str  # the producer's ZMQ endpoint for hellos and read requests
    one_sided: bool = False  # whether it serves one-sided reads (an RMA worker per consumer, named in HelloAck)
    regions: dict[int, tuple[int, int, bytes]] = {}  # region id -> (address, length, packed remote key)
    cma: bytes | None = None  # the address of its cma plane (same_host: cma), for consumers on its host


class Hello(msgspec.Struct, frozen=True):
    """A consumer's hello: where the producer sends replies (its receive worker and plane)."""

    worker: bytes
    plane: int
    engine_id: str
    token: bytes
    session: bytes = b""  # random per consumer plane: a hello from a new receive worker replaces the old
    rma: bool = False  # asks for an RMA worker of its own (one-sided reads); answered by a HelloAck
    hello_id: int = 0  # echoed in the HelloAck, so an answer to an earlier hello is never taken for this one


class HelloAck(msgspec.Struct, frozen=True):
    """The producer's answer to a hello that asks for one-sided reads (ZMQ, on the control socket):
    the address of the RMA worker it made for that consumer, or why it refused."""

    hello_id: int
    rma: bytes = b""
    code: ErrorCode | None = None
    error: str = ""
