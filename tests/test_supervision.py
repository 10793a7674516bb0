"""Supervision: an exception raised inside a data plane fails the load it touched, with its block
ids and the exception named, and the next load on the same Connector succeeds; a plane that
cannot go on fails every load at once and says so in the stats.

Faults come from a real plugin (tests/faultplane.py) that wraps the real tcp, cma or ucx plane
and is found through the ``kvxfer.connectors`` entry-point group. Producer and consumer are
separate processes over real sockets.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faultplane import ENTRY_POINTS
from msgspec.structs import replace
from test_faults import ConsumerProc
from test_transfer import Producers, make_cfg

from kvxfer.config import InstanceConfig
from kvxfer.dataplane import available_data_planes
from kvxfer.protocol import ErrorCode, KVTransferParams
from kvxfer.supervise import code_of
from kvxfer.transfer.aggregator import Finished, FinishedAggregator

pytestmark = pytest.mark.slow

NTOK = 100  # 7 blocks of 16
TRANSFER_S = 20.0  # far above what a supervised failure takes; the test checks none timed out
EXCEPTIONS = ["TimeoutError", "OSError", "RuntimeError"]


@pytest.fixture(scope="module", autouse=True)
def faulty_planes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Install the fault plugin the way pip would: a dist-info with entry points on sys.path
    (spawned rank processes start with this process's sys.path)."""
    site = tmp_path_factory.mktemp("site")
    info = site / "kvxfer_faultplane-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvxfer-faultplane\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvxfer.connectors]\n" +
                                           "".join(f"{k} = {v}\n" for k, v in ENTRY_POINTS.items()))
    sys.path.insert(0, str(site))
    try:
        assert set(ENTRY_POINTS) <= set(available_data_planes())
        yield
    finally:
        sys.path.remove(str(site))


def with_faults(cfg: InstanceConfig, plane: str, **options: Any) -> InstanceConfig:
    c = cfg.connector
    return replace(cfg, connector=replace(c, name=f"faulty-{plane}", data_plane={**c.data_plane, **options}))


def blocks(i: int) -> list[int]:
    return list(range(8 * i, 8 * i + 7))


def held(prod: Producers, n: int) -> list[KVTransferParams]:
    return [prod.params[f"r{i}"] for i in range(n)]


@pytest.mark.parametrize("site,path", [("connect", "engine"), ("read", "engine"), ("poll", "engine"),
                                       ("read", "agent")])
@pytest.mark.parametrize("conn", ["tcp", "cma", "ucx"])
def test_a_consumer_plane_that_raises_fails_only_that_load(conn: str, site: str, path: str) -> None:
    """With path agent, the fault plugin is found by entry point in the consumer's transfer agent."""
    excs = EXCEPTIONS + (["asyncio.TimeoutError"] if conn == "ucx" else [])
    pcfg = make_cfg("prefill", "P", connector=conn, data_path=path)
    dcfg = with_faults(make_cfg("decode", "D", connector=conn, transfer_s=TRANSFER_S, data_path=path), conn,
                       fault_at=site,
                       fault_exc=",".join(excs))
    with Producers(pcfg, [(f"r{i}", blocks(i), NTOK) for i in range(len(excs) + 1)]) as prod:
        cons = ConsumerProc(dcfg)
        try:
            params = held(prod, len(excs) + 1)
            for exc, p in zip(excs, params, strict=False):
                status, invalid, why, _ = cons.load(p, timeout_s=60)
                # the load's own blocks, named as failed, for the injected exception: not a hang,
                # not a timeout at the deadline
                assert status == "failed", (exc, status, why)
                assert len(invalid) == 7 and f"injected {exc.split('.')[-1]}" in why, (exc, invalid, why)
                assert cons.last_code == code_of(_instance(exc)).value, (exc, cons.last_code, why)
            status, _, why, _ = cons.load(params[-1], timeout_s=60)
            assert status == "ok", (status, why)  # the same Connector loads the next request
            stats = cons.stats()
            assert stats["load_timeouts"] == 0 and stats["loads_failed"] == len(excs) and stats["broken"] == 0
            assert stats["loop_errors"] >= 1  # each was reported (logged once with its traceback)
            assert cons.pool_is_whole()
        finally:
            cons.stop()


@pytest.mark.parametrize("conn", ["tcp", "cma", "ucx"])
def test_a_producer_serving_loop_that_raises_serves_the_next_read(conn: str) -> None:
    pcfg = with_faults(make_cfg("prefill", "P", connector=conn), conn, fault_at="serve",
                       fault_exc=",".join(EXCEPTIONS))
    dcfg = make_cfg("decode", "D", connector=conn, transfer_s=TRANSFER_S)
    with Producers(pcfg, [(f"r{i}", blocks(i), NTOK) for i in range(len(EXCEPTIONS) + 1)]) as prod:
        cons = ConsumerProc(dcfg)
        try:
            params = held(prod, len(EXCEPTIONS) + 1)
            for exc, p in zip(EXCEPTIONS, params, strict=False):
                status, invalid, why, _ = cons.load(p, timeout_s=60)
                assert status == "failed" and len(invalid) == 7, (exc, status, why)
                assert f"injected {exc}" in why and cons.last_code == ErrorCode.INTERNAL.value, (exc, why)
            status, _, why, _ = cons.load(params[-1], timeout_s=60)
            assert status == "ok", (status, why)
            assert cons.stats()["load_timeouts"] == 0
        finally:
            cons.stop()


@pytest.mark.parametrize("conn", ["tcp", "cma", "ucx"])
def test_a_broken_plane_fails_every_load_at_once_and_says_so(conn: str) -> None:
    pcfg = make_cfg("prefill", "P", connector=conn)
    dcfg = with_faults(make_cfg("decode", "D", connector=conn, transfer_s=TRANSFER_S), conn, fault_at="poll",
                       fault_forever=True)
    with Producers(pcfg, [(f"r{i}", blocks(i), NTOK) for i in range(2)]) as prod:
        cons = ConsumerProc(dcfg)
        try:
            deadline = time.monotonic() + 30
            while cons.stats()["broken"] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            stats = cons.stats()
            assert stats["broken"] == 1, stats  # the poll raising on every turn: broken, and visible
            for p in held(prod, 2):  # every later load fails at once, with its blocks
                status, invalid, why, _ = cons.load(p, timeout_s=60)
                assert status == "failed" and len(invalid) == 7, (status, why)
                assert cons.last_code == ErrorCode.PLANE_BROKEN.value and "poll raised" in why, why
            stats = cons.stats()
            assert stats["load_timeouts"] == 0 and stats["loads_failed_plane_broken"] == 2
            assert cons.pool_is_whole()
        finally:
            cons.stop()


def _instance(name: str) -> BaseException:
    return {"TimeoutError": TimeoutError(), "OSError": OSError(), "RuntimeError": RuntimeError(),
            "asyncio.TimeoutError": asyncio.TimeoutError()}[name]


def test_exceptions_map_to_codes() -> None:
    assert code_of(TimeoutError()) is ErrorCode.TIMEOUT
    assert code_of(asyncio.TimeoutError()) is ErrorCode.TIMEOUT  # a distinct type on Python 3.10
    assert code_of(ConnectionResetError()) is ErrorCode.PEER_LOST
    assert code_of(RuntimeError()) is ErrorCode.INTERNAL
    assert code_of(KeyError()) is ErrorCode.INTERNAL


def test_the_aggregator_keeps_the_first_workers_code() -> None:
    agg = FinishedAggregator(2)
    assert not agg.add(0, Finished(failed={"r": [1]}, errors={"r": "gone"}, codes={"r": ErrorCode.PEER_LOST}))
    out = agg.add(1, Finished(receiving=["r"]))
    assert out.failed == {"r": [1]} and out.codes == {"r": ErrorCode.PEER_LOST} and out.errors == {"r": "gone"}


def test_the_fault_plugin_is_found_by_entry_point() -> None:
    assert Path(__file__).with_name("faultplane.py").exists()
    assert available_data_planes()["faulty-tcp"].value == "faultplane:FaultyTcpPlane"
