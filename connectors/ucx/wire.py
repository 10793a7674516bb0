"""What two ucx planes exchange: the address in the handshake, the hello, and the tags and
reply header of the UCX messages. One place for the format both sides must agree on."""

from __future__ import annotations

import struct

import msgspec

MAX_CONTROL_BYTES = 32 << 20  # a read request of MAX_READ_PIECES pieces is 24 MiB
HEADER_BYTES = 4096  # a reply's first message: REPLY_LENGTH, the encoded ReadReply, zero padding
KIND_HEADER, KIND_DATA = 2, 3
REPLY_LENGTH = struct.Struct("<I")  # the header's first 4 bytes: the encoded ReadReply's length
GRANT_ONLY = -1  # a read request's chunk size that asks for the header alone: the consumer gets the bytes itself


def message_tag(plane: int, kind: int, seq: int) -> int:
    """The UCX tag of one reply message: the consumer's plane, the kind, and the batch, so that
    replies to the reads in flight on one receive worker never match each other's receives."""
    return (plane & 0xFFFF) << 48 | (kind & 0xFF) << 40 | (seq & 0xFF_FFFF_FFFF)


class UcxAddress(msgspec.Struct, frozen=True):
    """What a plane publishes in the kvxfer handshake: where peers reach it over UCX and ZMQ."""

    worker: bytes
    plane: int
    control: str  # the producer's ZMQ endpoint for hellos and read requests
    rma: bytes = b""  # the worker that serves one-sided reads (empty: the producer offers none)
    regions: dict[int, tuple[int, int, bytes]] = {}  # region id -> (address, length, packed remote key)


class Hello(msgspec.Struct, frozen=True):
    """A consumer's hello: where the producer sends replies (its receive worker and plane)."""

    worker: bytes
    plane: int
    engine_id: str
    token: bytes
    session: bytes = b""  # random per consumer plane: a hello from a new receive worker replaces the old
