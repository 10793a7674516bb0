"""Wire protocol, params, aggregation across workers, and connector lifecycle (threads, sockets)."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch

from kvxfer.cache import allocate_kv_cache, spec_from_config
from kvxfer.config import CacheConfig, ConnectorConfig, InstanceConfig, ModelConfig, SideChannelConfig
from kvxfer.connector import Connector, Finished, FinishedAggregator
from kvxfer.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    DoneNotice,
    ErrorCode,
    ErrorReply,
    Hello,
    KVTransferParams,
    ProtocolError,
    ReadReply,
    RemoteRank,
    decode_data,
    decode_side,
    encode,
    merge_params,
)
from kvxfer.topology import ParallelLayout

LAYOUT = ParallelLayout(tp_size=2, pp_size=1, num_layers=4, num_kv_heads=4)


def params(rank: int, **kw: object) -> KVTransferParams:
    base = dict(request_id="r", engine_id="P", num_tokens=40, block_ids=[1, 2, 3], block_size=16, layout=LAYOUT,
                ranks=[RemoteRank(rank=rank, host="127.0.0.1", port=5600 + rank, generation=7)], lease_s=30.0)
    base.update(kw)
    return KVTransferParams(**base)  # type: ignore[arg-type]


def test_round_trip_and_refusals() -> None:
    msg = DoneNotice(request_id="r", engine_id="D", rank=1, layout=LAYOUT, generation=3)
    assert decode_side(encode(msg)) == msg
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode_side(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    with pytest.raises(ProtocolError, match=f"protocol version 1, expected {PROTOCOL_VERSION}"):
        decode_side(encode(Hello(engine_id="x", client_nonce=b"n", version=1)))
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_side(msgspec.msgpack.encode({"type": "pickle", "version": 1}))
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_side(msgspec.msgpack.encode({"type": "hello", "version": 1, "engine_id": "", "client_nonce": b""}))
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_side(b"\x80\x04\x95")  # a pickle header is just bytes that do not decode


def test_params_bytes_and_merge() -> None:
    p0, p1 = params(0), params(1)
    assert KVTransferParams.from_bytes(p0.to_bytes()) == p0
    merged = merge_params([p1, p0])
    assert [r.rank for r in merged.ranks] == [0, 1]
    with pytest.raises(ValueError, match="ranks disagree on num_tokens"):
        merge_params([p0, params(1, num_tokens=41)])
    with pytest.raises(ProtocolError, match="undecodable KVTransferParams"):
        KVTransferParams.from_bytes(b"garbage")


def test_aggregator_reports_once_every_worker_has() -> None:
    agg = FinishedAggregator(2)
    assert not agg.add(0, Finished(sending=["a"], receiving=["b"]))
    out = agg.add(1, Finished(sending=["a"], receiving=["b"]))
    assert out.sending == ["a"] and out.receiving == ["b"] and not out.failed
    assert not agg.add(0, Finished(failed={"c": [1, 2]}, errors={"c": "peer gone"}))
    out = agg.add(1, Finished(receiving=["c"]))  # one worker failed: the request failed
    assert out.failed == {"c": [1, 2]} and out.errors == {"c": "peer gone"} and not out.receiving
    with pytest.raises(ValueError, match="worker"):
        agg.add(2, Finished())


def _cfg(role: str, engine: str) -> InstanceConfig:
    return InstanceConfig(role=role, engine_id=engine,
                          model=ModelConfig(num_layers=2, num_kv_heads=2, num_heads=4, head_size=16),
                          cache=CacheConfig(block_size=16, num_blocks=16),
                          connector=ConnectorConfig(name="tcp", side_channel=SideChannelConfig(port=0)))


def test_close_stops_every_thread_and_socket() -> None:
    import os

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before_threads = threading.active_count()
    before_fds = None
    for i in range(3):
        if i == 1:  # after the first round: zmq's shared context and torch keep a few fds of their own
            before_fds = fds()
        pc, dc = _cfg("prefill", "P"), _cfg("decode", "D")
        src, dst = allocate_kv_cache(spec_from_config(pc), 16), allocate_kv_cache(spec_from_config(dc), 16)
        for t in src.tensors:
            t.copy_(torch.randn(t.shape))
        P, D = Connector.from_config(pc), Connector.from_config(dc)
        P.register_kv_caches(src)
        D.register_kv_caches(dst)
        D.start_load("r", P.hold("r", [1, 2], 20), [3, 4])
        f = D.poll(timeout_s=10)
        assert f.receiving == ["r"] and torch.equal(dst.tensors[0][3], src.tensors[0][1])
        time.sleep(0.1)
        P.close()
        D.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > before_threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before_threads, [t.name for t in threading.enumerate()]
    assert fds() == before_fds, "each connector round closes every socket it opened"


def test_refusals_travel_as_typed_codes() -> None:
    """A refusal's code is an ErrorCode on the wire and after decoding; an unknown code is refused."""
    reply = decode_side(encode(ErrorReply(code=ErrorCode.NOT_HELD, message="anything at all")))
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.NOT_HELD
    read = decode_data(encode(ReadReply(batch_id=3, nbytes=0, error="why", code=ErrorCode.EXPIRED)))
    assert isinstance(read, ReadReply) and read.code is ErrorCode.EXPIRED
    assert decode_data(encode(ReadReply(batch_id=3, nbytes=8))).code is None  # type: ignore[attr-defined]
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_side(msgspec.msgpack.encode({"type": "error", "version": PROTOCOL_VERSION, "code": "no_such_code",
                                            "message": "x"}))


def test_push_target_bytes_merge_and_layers_ready_on_the_wire() -> None:
    from kvxfer.protocol import LayersReady, PushTarget, encode, merge_targets

    def target(rank: int, **kw: object) -> PushTarget:
        base = dict(request_id="d", engine_id="D", num_tokens=40, num_cached_tokens=16, layout=LAYOUT,
                    ranks=[RemoteRank(rank=rank, host="127.0.0.1", port=5700 + rank, generation=9)], lease_s=60.0)
        base.update(kw)
        return PushTarget(**base)  # type: ignore[arg-type]

    t0, t1 = target(0), target(1)
    assert PushTarget.from_bytes(t0.to_bytes()) == t0
    assert [r.rank for r in merge_targets([t1, t0]).ranks] == [0, 1]
    with pytest.raises(ValueError, match="ranks disagree on num_cached_tokens"):
        merge_targets([t0, target(1, num_cached_tokens=0)])
    with pytest.raises(ProtocolError, match="undecodable PushTarget"):
        PushTarget.from_bytes(params(0).to_bytes())  # a params is not a target
    msg = LayersReady(request_id="d", generation=9, source=params(0), layers=[0, 1], token=b"t")
    assert decode_side(encode(msg)) == msg
    with pytest.raises(ProtocolError):
        decode_side(msgspec.msgpack.encode({"type": "layers", "version": PROTOCOL_VERSION, "request_id": "d",
                                            "generation": 9, "source": {"request_id": "x"}, "layers": [0]}))
