"""The ``local`` data plane, loaded through its entry point: bit-exact reads and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer.cache import KVCacheSpec, allocate_kv_cache
from kvxfer.connector import Descriptors, load_data_plane
from kvxfer.protocol import ErrorCode, Refusal

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=16, block_size=8, dtype="bfloat16")


@pytest.fixture
def pair():
    cls = load_data_plane("local")
    src_cache, dst_cache = allocate_kv_cache(SPEC, 16), allocate_kv_cache(SPEC, 16)
    for i, t in enumerate(src_cache.tensors):
        t.copy_(torch.arange(t.numel()).reshape(t.shape).to(t.dtype) + i)
    producer, consumer = cls(), cls()
    producer.register(src_cache.regions)
    consumer.register(dst_cache.regions)
    consumer.connect("p", producer.address())
    yield producer, consumer, src_cache, dst_cache
    producer.close()
    consumer.close()


def block_descriptors(src_ids: list[int], dst_ids: list[int], num_regions: int, stride: int) -> Descriptors:
    rows = [(r, s * stride, r, d * stride, stride)
            for r in range(num_regions) for s, d in zip(src_ids, dst_ids, strict=True)]
    return Descriptors.from_rows(rows)


def test_read_moves_exact_bytes(pair) -> None:
    _, consumer, src, dst = pair
    stride = src.regions[0].block_stride
    d = block_descriptors([3, 4, 9], [0, 7, 1], len(src.regions), stride)
    consumer.read("p", "req-1", d)
    (res,) = consumer.poll()
    assert res.ok and res.nbytes == 3 * len(src.regions) * stride and res.request_id == "req-1"
    for s, t in zip(src.tensors, dst.tensors, strict=True):
        assert torch.equal(t[[0, 7, 1]], s[[3, 4, 9]])
        assert torch.count_nonzero(t[[2, 3, 4, 5, 6]].float()) == 0
    assert consumer.poll() == []


def test_out_of_bounds_and_unregistered_reads_are_refused(pair) -> None:
    _, consumer, src, dst = pair
    length = src.regions[0].length
    for rows, why in [
        ([(0, length - 8, 0, 0, 16)], "past the end of region 0"),
        ([(99, 0, 0, 0, 16)], "region 99 is not registered"),
        ([(0, 0, 0, length - 8, 16)], "past the end of region 0"),
    ]:
        consumer.read("p", "r", Descriptors.from_rows(rows))
        (res,) = consumer.poll()
        assert not res.ok and why in res.error and res.nbytes == 0
    assert all(torch.count_nonzero(t.float()) == 0 for t in dst.tensors)


def test_validator_refusal_reads_nothing(pair) -> None:
    producer, consumer, src, dst = pair
    producer.set_read_validator(
        lambda rid, d: None if rid == "held" else Refusal(ErrorCode.NOT_HELD, f"request {rid} is not held"))
    stride = src.regions[0].block_stride
    consumer.read("p", "other", block_descriptors([1], [1], 1, stride))
    (res,) = consumer.poll()
    assert res.error == "request other is not held" and res.code is ErrorCode.NOT_HELD
    assert torch.count_nonzero(dst.tensors[0].float()) == 0
    consumer.read("p", "held", block_descriptors([1], [1], 1, stride))
    assert consumer.poll()[0].ok and torch.equal(dst.tensors[0][1], src.tensors[0][1])


def test_closed_peer_and_bad_descriptors(pair) -> None:
    producer, consumer, _, _ = pair
    producer.close()
    consumer.read("p", "r", Descriptors.from_rows([(0, 0, 0, 0, 8)]))
    res = consumer.poll()[0]
    assert res.error == "peer p is not connected" and res.code is ErrorCode.PEER_LOST
    with pytest.raises(ConnectionError, match="no local data plane"):
        consumer.connect("q", producer.address())
    with pytest.raises(ValueError, match="lengths must be > 0"):
        Descriptors.from_rows([(0, 0, 0, 0, 0)])
    with pytest.raises(ValueError, match="five 1-d int64 arrays"):
        Descriptors(*(np.zeros(2, dtype=np.int32) for _ in range(5)))


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("tcp", {"stream": 2}, r"unknown option\(s\) \['stream'\] for tcp; known: "),
        ("tcp", {"transport": "udp"}, "transport: expected auto, tcp or unix, got 'udp'"),
        ("tcp", {"streams": 0}, "streams: expected 1..16, got 0"),
        ("ucx", {"tls_list": "tcp"}, r"unknown option\(s\) \['tls_list'\] for ucx; known: "),
        ("ucx", {"progress_mode": "busy"}, "progress_mode: expected blocking, polling, thread or thread-polling"),
        ("ucx", {"inflight": 0}, "inflight: expected > 0, got 0"),
    ],
)
def test_data_plane_options_are_checked_by_name(name: str, options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_data_plane(name)(options)
