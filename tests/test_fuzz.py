"""Bad input against a live producer process (hypothesis): random, truncated, oversized and
well-formed-but-hostile messages on the side channel and on each data plane.

The producer must stay up, answer or drop each message, never send bytes outside the blocks
it holds, and still serve a good consumer afterwards.
"""

from __future__ import annotations

import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvproc import recv
from msgspec.structs import replace
from test_transfer import Producers, consume, make_cfg

from kvxfer.handshake import SideChannelClient
from kvxfer.protocol import (
    PROTOCOL_VERSION,
    Abandon,
    DataHello,
    DoneNotice,
    DoneNotices,
    HandshakeRequest,
    Hello,
    KVTransferParams,
    LeaseRenew,
    ReadRequest,
    decode_data,
    encode,
)
from kvxfer.topology import ParallelLayout

pytestmark = pytest.mark.slow

NTOK = 100
HELD = [3, 4, 5, 6, 7, 8, 9]  # the blocks of the one held request
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
LAYOUT = ParallelLayout(tp_size=1, pp_size=1, num_layers=4, num_kv_heads=4)


class Live:
    """A producer process holding "held", with what a client learns from a handshake."""

    def __init__(self, conn: str) -> None:
        self.conn = conn
        self.log = Path(tempfile.mkdtemp(prefix="kvx-fuzz-")) / "producer.log"
        self.prod = Producers(make_cfg("prefill", "P", connector=conn, lease_s=600.0), [("held", HELD, NTOK)],
                              env={"KVPROC_LOG": str(self.log)})
        self.params = self.prod.params["held"]
        r = self.params.ranks[0]
        self.side = f"tcp://{r.host}:{r.port}"
        self.meta, self.token = SideChannelClient(5.0, 0).handshake(r.host, r.port, "fuzzer", 0, LAYOUT, None)
        self.ctx = zmq.Context.instance()

    def alive(self) -> bool:
        return self.prod.procs[0][0].is_alive()

    def side_request(self, frame: bytes) -> bytes | None:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(self.side)
            s.send_multipart([b"", frame])
            return s.recv_multipart()[-1] if s.poll(3000) else None
        finally:
            s.close(linger=0)

    def held_bytes(self) -> dict[int, set[int]]:
        """Per region, the block indices the producer holds for "held"."""
        return {r.region_id: set(HELD) for r in self.meta.regions}


@pytest.fixture(scope="module", params=["tcp", "ucx"])
def live(request: pytest.FixtureRequest) -> Iterator[Live]:
    lv = Live(request.param)
    yield lv
    # after all the abuse: still up, and a good consumer loads the held request bit for bit
    assert lv.alive(), "the producer died"
    (status, detail, _), = consume(make_cfg("decode", "D", connector=lv.conn), lv.params)
    assert status == "ok", detail
    lv.prod.stop()


def _hostile_side() -> st.SearchStrategy[bytes]:
    ids = st.text(min_size=0, max_size=40).filter(lambda s: s != "held")
    gens = st.integers(min_value=-(2**63), max_value=2**63 - 1)
    return st.one_of(
        st.builds(lambda v, e: msgspec.msgpack.encode({"type": "hello", "version": v, "engine_id": e,
                                                       "client_nonce": b""}),
                  st.integers(-5, 500).filter(lambda v: v != PROTOCOL_VERSION), st.text(max_size=20)),
        st.builds(lambda rid, g, t: encode(DoneNotice(request_id=rid, engine_id="x", rank=0, layout=LAYOUT,
                                                      generation=g, token=t)), ids, gens, st.binary(max_size=40)),
        st.builds(lambda rids, g, t: encode(LeaseRenew(request_ids=rids, generation=g, token=t)),
                  st.lists(ids, max_size=5), gens, st.binary(max_size=40)),
        st.builds(lambda rids, g, t: encode(DoneNotices(request_ids=rids, engine_id="x", rank=0, layout=LAYOUT,
                                                        generation=g, token=t)),
                  st.lists(ids, max_size=5), gens, st.binary(max_size=40)),
        st.builds(lambda rid, g: encode(Abandon(request_id=rid, generation=g, reason="fuzz", token=b"")), ids, gens),
        st.builds(lambda e, n, cn: encode(HandshakeRequest(engine_id=e, rank=n, layout=LAYOUT, client_nonce=cn,
                                                           server_nonce=b"s" * 16)),
                  st.text(max_size=20), st.integers(-10, 10), st.binary(max_size=40)),
    )


def _valid_side_frames() -> list[bytes]:
    return [encode(Hello(engine_id="fuzzer", client_nonce=b"n" * 16)),
            encode(LeaseRenew(request_ids=["held"], generation=0, token=b""))]


@FUZZ
@given(frame=st.one_of(
    st.binary(max_size=4096),  # random
    st.sampled_from(_valid_side_frames()).flatmap(lambda f: st.integers(0, len(f) - 1).map(lambda n: f[:n])),
    _hostile_side(),
))
def test_side_channel_survives_anything(live: Live, frame: bytes) -> None:
    reply = live.side_request(frame)
    assert reply is not None, f"no answer to {frame[:60]!r}"
    msg = msgspec.msgpack.decode(reply)
    assert msg["type"] in ("error", "ack", "challenge", "handshake_ok"), msg


def test_side_channel_drops_oversized_frames(live: Live) -> None:
    assert live.side_request(b"\x00" * (8 << 20)) is None  # over the transport's message limit
    assert live.side_request(encode(Hello(engine_id="fuzzer", client_nonce=b"n" * 16))) is not None
    assert live.alive()


# ------------------------------------------------------------------ data planes

_LEN = struct.Struct("!I")


def _tcp_exchange(live: Live, frames: list[bytes], expect_reply: bool) -> tuple[list[Any], bytes]:
    """Send length-prefixed frames on one tcp data connection; collect replies and payload."""
    from kvxfer.connectors.tcp import Address

    addr = msgspec.msgpack.decode(live.meta.data_address, type=Address)
    s = socket.create_connection((addr.host, addr.port), timeout=5)
    replies: list[Any] = []
    data = b""
    try:
        for f in frames:
            s.sendall(_LEN.pack(len(f)) + f)
        if expect_reply:
            head = s.recv(4, socket.MSG_WAITALL)
            if len(head) == 4:
                body = s.recv(_LEN.unpack(head)[0], socket.MSG_WAITALL)
                reply = decode_data(body)
                replies.append(reply)
                want = getattr(reply, "nbytes", 0)
                while len(data) < want:
                    chunk = s.recv(want - len(data))
                    if not chunk:
                        break
                    data += chunk
    except (ConnectionError, TimeoutError, OSError):
        pass
    finally:
        s.close()
    return replies, data


def _read(rid: str, regions: list[int], offsets: list[int], lengths: list[int], batch: int = 1) -> bytes:
    return encode(ReadRequest(request_id=rid, batch_id=batch, regions=np.asarray(regions, "<i8").tobytes(),
                              offsets=np.asarray(offsets, "<i8").tobytes(),
                              lengths=np.asarray(lengths, "<i8").tobytes()))


pieces = st.lists(st.tuples(st.integers(-2, 12), st.integers(-(2**20), 2**22), st.integers(-16, 2**16)),
                  min_size=0, max_size=8)


@pytest.mark.parametrize("live", ["tcp"], indirect=True)  # ucx reads arrive on its control socket: next test
@FUZZ
@given(rid=st.sampled_from(["held", "not-held", ""]), ps=pieces, garbage=st.binary(max_size=64),
       how=st.sampled_from(["read", "garbage", "no-hello", "truncated"]))
def test_data_plane_reads_nothing_it_does_not_hold(live: Live, rid: str, ps: list[tuple[int, int, int]],
                                                   garbage: bytes, how: str) -> None:
    hello = encode(DataHello(engine_id="fuzzer", token=live.token))
    req = _read(rid, [p[0] for p in ps], [p[1] for p in ps], [p[2] for p in ps])
    frames = {"read": [hello, req], "garbage": [hello, garbage], "no-hello": [req],
              "truncated": [hello, req[: len(req) // 2]]}[how]
    replies, data = _tcp_exchange(live, frames, expect_reply=how == "read")
    if replies and getattr(replies[0], "nbytes", 0):
        # served: every piece must lie inside a held block of a registered region
        strides = {r.region_id: r.block_stride for r in live.meta.regions}
        assert rid == "held"
        for r, o, n in ps:
            assert r in strides and o >= 0 and n > 0
            first, last = o // strides[r], (o + n - 1) // strides[r]
            assert set(range(first, last + 1)) <= set(HELD), (r, o, n)
        assert len(data) == sum(p[2] for p in ps)
    assert live.alive()


@pytest.mark.parametrize("live", ["ucx"], indirect=True)  # tcp has no control socket
@FUZZ
@given(frame=st.one_of(st.binary(max_size=512),
                       st.builds(lambda b: b"H" + b, st.binary(max_size=256)),
                       st.builds(lambda b: b"R" + b, st.binary(max_size=256)),
                       st.builds(lambda ps: b"R" + _read("held", [p[0] for p in ps], [p[1] for p in ps],
                                                         [p[2] for p in ps]), pieces)))
def test_ucx_control_socket_survives_anything(live: Live, frame: bytes) -> None:
    from kvxfer.connectors.ucx import UcxAddress

    addr = msgspec.msgpack.decode(live.meta.data_address, type=UcxAddress)
    s = live.ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr.control)
    s.send(frame)
    s.close(linger=100)
    assert live.alive()


def test_a_consumer_lying_about_block_ids_is_refused_and_counted(live: Live) -> None:
    """A real consumer whose params name blocks the producer does not hold for that request."""
    _, conn = live.prod.procs[0]
    conn.send("stats")
    before = recv(conn, 30)[1]["refused_reads"]
    conn.send(("hold", "victim", [20, 21, 22, 23, 24, 25, 26], NTOK))
    victim = KVTransferParams.from_bytes(recv(conn, 30)[1])
    forged = replace(victim, block_ids=[0, 1, 2, 10, 11, 12, 13])  # held for "held", not for "victim"
    (status, (invalid, why), _), = consume(make_cfg("decode", "D", connector=live.conn), forged)
    assert status == "failed" and len(invalid) == 7, why
    assert "not held" in why or "refused" in why, why
    conn.send("stats")
    assert recv(conn, 30)[1]["refused_reads"] > before
    assert live.alive()


def test_duplicate_done_notices_count_once(live: Live) -> None:
    """A TP 2 consumer owes two done notices; the same rank's notice sent twice is one."""
    _, conn = live.prod.procs[0]
    conn.send(("hold", "dup", [30, 31, 32, 33, 34, 35, 36], NTOK))
    params = KVTransferParams.from_bytes(recv(conn, 30)[1])
    gen = params.ranks[0].generation
    tp2 = ParallelLayout(tp_size=2, pp_size=1, num_layers=4, num_kv_heads=4)

    def done(rank: int) -> dict[str, Any]:
        reply = live.side_request(encode(DoneNotice(request_id="dup", engine_id="D2", rank=rank, layout=tp2,
                                                    generation=gen, token=live.token)))
        assert reply is not None
        return msgspec.msgpack.decode(reply)

    assert done(0)["type"] == "ack"
    assert done(0)["type"] == "ack"  # a duplicate: acknowledged, not counted
    conn.send("released")
    assert "dup" not in recv(conn, 30)[1]
    assert done(1)["type"] == "ack"  # the second reader: now every reader is done
    deadline = time.monotonic() + 10
    while True:
        conn.send("released")
        if "dup" in recv(conn, 30)[1] or time.monotonic() > deadline:
            break
    conn.send("released")
    assert "dup" in recv(conn, 30)[1]
    reply = done(1)  # after the release: the request is unknown, and the server says so
    assert reply["type"] == "error" and reply["code"] == "unknown_request"
    assert live.alive()


def test_done_notices_count_each_request_and_name_the_unknown(live: Live) -> None:
    """One DoneNotices for several requests counts each as its own done notice (a TP 2 consumer
    owes two per request), names the requests not held, and is refused whole for a stale generation."""
    _, conn = live.prod.procs[0]
    conn.send(("hold", "many-a", [50, 51, 52, 53, 54, 55, 56], NTOK))
    gen = KVTransferParams.from_bytes(recv(conn, 30)[1]).ranks[0].generation
    conn.send(("hold", "many-b", [57, 58, 59, 60, 61, 62, 63], NTOK))
    recv(conn, 30)
    tp2 = ParallelLayout(tp_size=2, pp_size=1, num_layers=4, num_kv_heads=4)

    def dones(rank: int, ids: list[str], generation: int = gen) -> dict[str, Any]:
        reply = live.side_request(encode(DoneNotices(request_ids=ids, engine_id="D3", rank=rank, layout=tp2,
                                                     generation=generation, token=live.token)))
        assert reply is not None
        return msgspec.msgpack.decode(reply)

    def released() -> list[str]:
        conn.send("released")
        return list(recv(conn, 30)[1])

    reply = dones(1, ["many-a", "many-b"], generation=gen + 1)
    assert reply["type"] == "error" and reply["code"] == "stale_generation", reply
    assert dones(0, ["many-a", "many-b"])["type"] == "ack"
    # rank 1's stale notice counted nothing: one reader of two, nothing released
    assert not {"many-a", "many-b"} & set(released())
    reply = dones(1, ["many-a", "ghost", "many-b"])
    assert reply["type"] == "error" and reply["code"] == "unknown_request" and "ghost" in reply["message"], reply
    assert "many-a" not in reply["message"] and "many-b" not in reply["message"], reply
    deadline = time.monotonic() + 10
    while not {"many-a", "many-b"} <= set(got := released()) and time.monotonic() < deadline:
        pass  # each query is a round trip to the producer process
    assert {"many-a", "many-b"} <= set(got)
    assert live.alive()


def test_each_refusal_is_logged_once_naming_the_peer(live: Live) -> None:
    _, conn = live.prod.procs[0]
    conn.send(("hold", "liar", [40, 41, 42, 43, 44, 45, 46], NTOK))
    victim = KVTransferParams.from_bytes(recv(conn, 30)[1])
    forged = replace(victim, block_ids=[0, 1, 2, 10, 11, 12, 13])
    for _ in range(2):  # the same lie twice
        (status, _, _), = consume(make_cfg("decode", "D", connector=live.conn), forged)
        assert status == "failed"
    log = live.log.read_text()
    lines = [ln for ln in log.splitlines() if "refused peer" in ln and "read for liar" in ln]
    assert len(lines) == 1, log[-3000:]
    assert "refused peer D:" in lines[0]
