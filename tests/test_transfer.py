"""End-to-end transfers between real producer and consumer processes over real sockets:
bit-exact arrival across layouts, block sizes and TP/PP shapes, and the failure contract."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from kvproc import consumer_main, producer_main, recv, start

from kvxfer.config import (
    AuthConfig,
    CacheConfig,
    ConnectorConfig,
    InstanceConfig,
    ModelConfig,
    ParallelConfig,
    SideChannelConfig,
    TimeoutsConfig,
)
from kvxfer.handshake import AuthError, SideChannelClient
from kvxfer.protocol import KVTransferParams, merge_params
from kvxfer.topology import ParallelLayout

CONNECTORS = ["tcp", "ucx", "cma"]
# The matrix runs with the data path in the rank's process (the same Connector the agent runs,
# without two agent starts per case); test_bit_exact_through_transfer_agents and the agent
# variants in test_faults, test_supervision and test_agent run it in transfer agents.
DATA_PATH = "engine"


@pytest.fixture(params=CONNECTORS)
def conn(request: pytest.FixtureRequest) -> str:
    """Every transfer test runs against each shipped cross-process data plane."""
    return request.param


NTOK = 100  # not a multiple of any block size used: the last block is partly filled
P_BLOCKS = [7, 3, 12, 13, 14, 40, 2, 21, 22, 23, 50, 51, 60]  # scattered, with some runs
D_BLOCKS = [30, 31, 5, 6, 7, 8, 90, 91, 92, 17, 18, 70, 71]


def make_cfg(role: str, engine: str, *, tp: int = 1, pp: int = 1, layout: str = "NHD", bs: int = 16,
             mla: bool = False, head_size: int = 16, lease_s: float = 30.0, transfer_s: float = 20.0,
             secret_env: str | None = None, connector: str = "tcp", num_blocks: int = 128,
             host_staging: str = "auto", kv_fused: bool = False, fused_order: str = "", hold_wait_s: float = 1.0,
             data_path: str = DATA_PATH, data_plane: dict[str, Any] | None = None,
             ucx_same_host: str | None = "ucx") -> InstanceConfig:
    """``ucx_same_host``: the ucx plane's ``same_host`` when ``data_plane`` does not set it. These tests
    run the ucx plane on UCX's own wire (``ucx``) unless they say otherwise: its default (``cma``,
    None here) reads a producer on this host through the cma plane beside it, which the cma rows
    and tests/test_ucx_same_host.py cover."""
    heads = 1 if mla else 4
    data_plane = dict(data_plane or {})
    if connector == "ucx" and ucx_same_host is not None and data_plane.get("reads") != "two-sided":
        data_plane.setdefault("same_host", ucx_same_host)
    return InstanceConfig(
        role=role, engine_id=engine,
        model=ModelConfig(num_layers=4, num_kv_heads=heads, num_heads=8, head_size=head_size, mla=mla),
        cache=CacheConfig(block_size=bs, num_blocks=num_blocks, layout=layout, kv_fused=kv_fused,
                          fused_order=fused_order),
        parallel=ParallelConfig(tp=tp, pp=pp),
        connector=ConnectorConfig(
            name=connector, side_channel=SideChannelConfig(host="127.0.0.1", port=0),
            timeouts=TimeoutsConfig(handshake_s=2.0, handshake_retries=1, transfer_s=transfer_s, lease_s=lease_s,
                                    abort_s=max(600.0, transfer_s), hold_wait_s=hold_wait_s),
            auth=AuthConfig(secret_env=secret_env) if secret_env else None,
            host_staging=host_staging, data_path=data_path, data_plane=data_plane,
        ),
    )


def enc(cfg: InstanceConfig) -> bytes:
    return msgspec.json.encode(cfg)


class Producers:
    """Producer rank processes holding one request each; stopped on exit."""

    def __init__(self, cfg: InstanceConfig, requests: list[tuple], env: dict[str, str] | None = None,
                 fill_mode: str = "oracle") -> None:
        self.procs: list[tuple[Any, Any]] = []
        parts: dict[str, list[KVTransferParams]] = {}
        for rank in range(cfg.world_size):
            p, conn = start(producer_main, enc(cfg), rank, requests, env=env, fill_mode=fill_mode)
            self.procs.append((p, conn))
        for _, conn in self.procs:
            _, params, _port = recv(conn)
            for raw in params:
                kp = KVTransferParams.from_bytes(raw)
                parts.setdefault(kp.request_id, []).append(kp)
        self.params = {rid: merge_params(ps) for rid, ps in parts.items()}

    def released(self, rank: int = 0) -> list[str]:
        _, conn = self.procs[rank]
        conn.send("released")
        return recv(conn)[1]

    def wait_released(self, rid: str, timeout: float = 10.0) -> bool:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if all(rid in self.released(r) for r in range(len(self.procs))):
                return True
            time.sleep(0.05)
        return False

    def hold(self, rid: str, blocks: list[int], rank: int = 0) -> str:
        """Hold ``rid`` on ``blocks`` now (filled as the oracle says); the reply's kind ("params")."""
        conn = self.procs[rank][1]
        conn.send(("hold", rid, blocks, NTOK))
        return recv(conn)[0]

    def stats(self, rank: int = 0) -> dict[str, float]:
        conn = self.procs[rank][1]
        conn.send("stats")
        return recv(conn)[1]

    def stop(self) -> None:
        for p, conn in self.procs:
            if p.is_alive():
                try:
                    conn.send("stop")
                except (BrokenPipeError, OSError):
                    pass
        for p, _ in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> Producers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def consume(cfg: InstanceConfig, params: KVTransferParams, blocks: list[int] | None = None,
            **kw: Any) -> list[tuple]:
    """Run every rank of a consumer instance; returns each rank's (status, detail, elapsed)."""
    procs = [start(consumer_main, enc(cfg), rank, params.to_bytes(), blocks or D_BLOCKS, **kw)
             for rank in range(cfg.world_size)]
    out = []
    for p, conn in procs:
        recv(conn, 60)  # started
        out.append(recv(conn, 90)[1:])
        p.join(timeout=10)
    return out


CASES = {
    "same layout": ({}, {}),
    "HND->NHD": ({"layout": "HND"}, {}),
    "NHD->HND": ({}, {"layout": "HND"}),
    "block 16->64": ({}, {"bs": 64}),
    "block 64->16": ({"bs": 64}, {}),
    "HND 16 -> NHD 64": ({"layout": "HND"}, {"bs": 64}),
    "prefill TP2 -> decode TP1": ({"tp": 2}, {}),
    "prefill TP1 -> decode TP2": ({}, {"tp": 2}),
    "prefill PP2 -> decode PP1": ({"pp": 2}, {}),
    "prefill TP2 -> decode TP1 HND": ({"tp": 2, "layout": "HND"}, {"layout": "HND"}),
    "MLA, prefill TP2 -> decode TP1": ({"mla": True, "tp": 2}, {"mla": True}),
    # vLLM's CPU layout: per block and head, K rows then V rows
    "fused K|V HND": ({"kv_fused": True, "layout": "HND"}, {"kv_fused": True, "layout": "HND"}),
    "fused K|V HND, prefill TP2 -> decode TP1": ({"kv_fused": True, "layout": "HND", "tp": 2},
                                                 {"kv_fused": True, "layout": "HND"}),
    "fused K|V HND, prefill TP1 -> decode TP2": ({"kv_fused": True, "layout": "HND"},
                                                 {"kv_fused": True, "layout": "HND", "tp": 2}),
    # vLLM's CPU "vec" order (K transposed, V token-major per block and head): re-cut between block sizes
    "fused vec 16->64": ({"kv_fused": True, "layout": "HND", "fused_order": "vec"},
                         {"kv_fused": True, "layout": "HND", "fused_order": "vec", "bs": 64}),
    "fused vec 64->16, prefill TP2 -> decode TP1": ({"kv_fused": True, "layout": "HND", "fused_order": "vec",
                                                     "bs": 64, "tp": 2},
                                                    {"kv_fused": True, "layout": "HND", "fused_order": "vec"}),
    # the path device caches take (host mirror, batched copies), forced on for CPU caches
    "host staging both sides, HND -> NHD": ({"host_staging": "always", "layout": "HND"},
                                            {"host_staging": "always"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bit_exact_transfer(case: str, conn: str) -> None:
    pkw, dkw = CASES[case]
    pcfg, dcfg = make_cfg("prefill", "P", connector=conn, **pkw), make_cfg("decode", "D", connector=conn, **dkw)
    pbs = pcfg.cache.block_size
    blocks = P_BLOCKS[: -(-NTOK // pbs)]
    with Producers(pcfg, [("req", blocks, NTOK)]) as prod:
        results = consume(dcfg, prod.params["req"])
        for status, detail, _ in results:
            assert status == "ok", (status, detail)
        assert prod.wait_released("req"), "every producer rank frees the blocks once its readers are done"


AGENT_CASES = ["same layout", "HND 16 -> NHD 64", "prefill TP2 -> decode TP1", "prefill PP2 -> decode PP1",
               "fused K|V HND, prefill TP1 -> decode TP2", "host staging both sides, HND -> NHD"]


@pytest.mark.parametrize("case", AGENT_CASES)
def test_bit_exact_through_transfer_agents(case: str, conn: str) -> None:
    """Every rank on both sides runs its data path in a transfer agent (the default)."""
    pkw, dkw = CASES[case]
    pcfg = make_cfg("prefill", "P", connector=conn, data_path="agent", **pkw)
    dcfg = make_cfg("decode", "D", connector=conn, data_path="agent", **dkw)
    blocks = P_BLOCKS[: -(-NTOK // pcfg.cache.block_size)]
    with Producers(pcfg, [("req", blocks, NTOK)]) as prod:
        for status, detail, _ in consume(dcfg, prod.params["req"]):
            assert status == "ok", (status, detail)
        assert prod.wait_released("req")
        assert [prod.stats(r)["holds_done"] for r in range(len(prod.procs))] == [1] * len(prod.procs)


@pytest.mark.parametrize("path", ["engine", "agent"])
def test_ucx_same_host_cma_reads_a_producer_on_this_host_with_cma(path: str) -> None:
    """``connector.data_plane.same_host: cma`` on both sides: the ucx consumer reads this host's
    producer through the cma plane beside it (its stats say so), bit-exact, across TP sizes."""
    pkw, dkw = CASES["prefill TP2 -> decode TP1"]
    opts = {"same_host": "cma"}
    pcfg = make_cfg("prefill", "P", connector="ucx", data_path=path, data_plane=opts, **pkw)
    dcfg = make_cfg("decode", "D", connector="ucx", data_path=path, data_plane=opts, **dkw)
    blocks = P_BLOCKS[: -(-NTOK // pcfg.cache.block_size)]
    with Producers(pcfg, [("req", blocks, NTOK)]) as prod:
        [(status, stats, _)] = consume(dcfg, prod.params["req"], with_stats=True)
        assert status == "ok", stats
        assert stats["plane_cma_peers"] == 2, stats  # both prefill ranks
        assert stats["plane_cma_one_sided_reads"] + stats["plane_cma_granted_reads"] >= 2, stats
        assert prod.wait_released("req")


def test_decode_side_may_know_the_request_by_another_id(conn: str) -> None:
    """Engines such as vLLM give each instance its own request ids: reads and done notices
    carry the producer's id from the params, bookkeeping the consumer's own."""
    pcfg, dcfg = make_cfg("prefill", "P", connector=conn), make_cfg("decode", "D", connector=conn)
    with Producers(pcfg, [("p-side-id", P_BLOCKS[: -(-NTOK // 16)], NTOK)]) as prod:
        (status, detail, _), = consume(dcfg, prod.params["p-side-id"], local_id="d-side-id")
        assert status == "ok", detail
        assert prod.wait_released("p-side-id"), "the done notice names the producer's id"


def test_partial_prefix_hit_moves_only_the_suffix(conn: str) -> None:
    pcfg, dcfg = make_cfg("prefill", "P", connector=conn), make_cfg("decode", "D", connector=conn)
    blocks = P_BLOCKS[:7]
    # the producer's first 32 tokens are garbage: a consumer that read them would fail the check
    with Producers(pcfg, [("req", blocks, NTOK, 32), ("control", blocks, NTOK, 32)]) as prod:
        (status, detail, _), = consume(dcfg, prod.params["req"], num_cached_tokens=32)
        assert status == "ok", detail
        # and without the prefix hit the garbage does arrive: the check can tell
        (status, detail, _), = consume(dcfg, prod.params["control"])
        assert status == "mismatch", detail


def test_read_of_blocks_not_held_is_refused(conn: str) -> None:
    pcfg, dcfg = make_cfg("prefill", "P", connector=conn), make_cfg("decode", "D", connector=conn)
    with Producers(pcfg, [("req", P_BLOCKS[:7], NTOK)]) as prod:
        forged = msgspec.structs.replace(prod.params["req"], block_ids=[100, 101, 102, 103, 104, 105, 106])
        (status, (invalid, why), _), = consume(dcfg, forged)
        assert status == "failed"
        assert invalid == D_BLOCKS[:7]
        assert "not held" in why
        stats = prod.procs[0][1]
        stats.send("stats")
        assert recv(stats)[1]["refused_reads"] >= 1


def test_read_after_lease_expired_is_refused_and_reported(conn: str) -> None:
    pcfg, dcfg = make_cfg("prefill", "P", connector=conn, lease_s=0.5), make_cfg("decode", "D", connector=conn)
    with Producers(pcfg, [("req", P_BLOCKS[:7], NTOK)]) as prod:
        assert prod.wait_released("req", timeout=5.0), "the producer frees the blocks when the lease runs out"
        assert prod.stats()["holds_expired"] == 1
        (status, (invalid, why), _), = consume(dcfg, prod.params["req"])
        assert status == "failed" and invalid == D_BLOCKS[:7]
        assert "not held" in why  # never served from blocks that may have been reused


def test_a_read_before_the_hold_is_made_waits_for_it(conn: str) -> None:
    """vLLM makes the prefill side's hold one engine step after it answered the request, so the
    decode side can ask first: a read refused as "not held" is tried again for hold_wait_s."""
    pcfg = make_cfg("prefill", "P", connector=conn)
    dcfg = make_cfg("decode", "D", connector=conn, hold_wait_s=15.0)
    blocks = [80, 81, 82, 83, 84, 85, 86]
    with Producers(pcfg, [("req", P_BLOCKS[:7], NTOK)]) as prod:
        early = msgspec.structs.replace(prod.params["req"], request_id="late", block_ids=blocks)
        made: list[str] = []

        def hold_after_the_first_refusal() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if prod.stats()["refused_reads"] >= 1:
                    made.append(prod.hold("late", blocks))
                    return
                time.sleep(0.02)

        holder = threading.Thread(target=hold_after_the_first_refusal)
        holder.start()
        (status, detail, _), = consume(dcfg, early)
        holder.join(timeout=70)
        assert made == ["params"], "the read was refused before the hold existed"
        assert status == "ok", detail
        assert prod.wait_released("late")


def test_lease_renewal_keeps_a_queued_request_held(conn: str) -> None:
    """The hold is made once the consumer has queued the request (spawning the consumer can take
    longer than a lease on a loaded machine); the queue wait is then 2.5 leases."""
    pcfg, dcfg = make_cfg("prefill", "P", connector=conn, lease_s=3.0), make_cfg("decode", "D", connector=conn)
    blocks = [80, 81, 82, 83, 84, 85, 86]
    with Producers(pcfg, [("req", P_BLOCKS[:7], NTOK)]) as prod:
        queued = msgspec.structs.replace(prod.params["req"], request_id="queued", block_ids=blocks)
        p, cconn = start(consumer_main, enc(dcfg), 0, queued.to_bytes(), D_BLOCKS, wait_s=7.5, announce_wait=True)
        assert recv(cconn, 60)[0] == "waiting"
        assert prod.hold("queued", blocks) == "params"
        recv(cconn, 60)  # started
        status, detail, _ = recv(cconn, 90)[1:]
        p.join(timeout=10)
        assert status == "ok", detail
        assert prod.wait_released("queued")


def test_consumer_that_never_reads_lets_the_producer_free(conn: str) -> None:
    pcfg = make_cfg("prefill", "P", connector=conn, lease_s=0.4)
    with Producers(pcfg, [("req", P_BLOCKS[:7], NTOK)]) as prod:
        assert prod.wait_released("req", timeout=5.0)


def test_cma_producer_dead_before_the_read_fails_the_load_with_its_blocks() -> None:
    """cma copies one-sided, at memory speed: a kill cannot land mid-copy (the kernel keeps the
    producer's memory until the copy returns), so its failure case is a producer already gone."""
    pcfg, dcfg = make_cfg("prefill", "P", connector="cma"), make_cfg("decode", "D", connector="cma", transfer_s=5.0)
    with Producers(pcfg, [("req", P_BLOCKS[:7], NTOK)]) as prod:
        os.kill(prod.procs[0][0].pid, signal.SIGKILL)
        prod.procs[0][0].join(timeout=10)
        (status, detail, elapsed), = consume(dcfg, prod.params["req"])
    assert status == "failed" and detail[0] == D_BLOCKS[:7], detail
    assert elapsed < 5.0 + 3.0


def with_children(pid: int) -> list[int]:
    """A process's children (its transfer agent), then the process: SIGKILLed in this order, every byte it
    serves stops at once."""
    kids = [int(k) for task in Path(f"/proc/{pid}/task").iterdir()
            for k in (task / "children").read_text().split()]
    return [*kids, pid]


# the kill must land while bytes move: two-sided reads only. cma's and ucx's one-sided reads move 512 MiB
# before the kill lands (see the cma case above; tests/test_ucx_rma.py kills a producer with gets in flight).
@pytest.mark.parametrize("conn,path", [("tcp", "engine"), ("ucx", "engine"), ("tcp", "agent"), ("ucx", "agent")])
def test_producer_killed_mid_transfer_fails_the_request_within_the_timeout(conn: str, path: str) -> None:
    ntok = 64 * 1024  # 512 MiB of KV: the kill lands while bytes are moving
    plane = {"reads": "two-sided"} if conn == "ucx" else None
    pcfg = make_cfg("prefill", "P", connector=conn, head_size=64, num_blocks=4100, transfer_s=5.0, data_path=path,
                    data_plane=plane)
    dcfg = make_cfg("decode", "D", connector=conn, head_size=64, num_blocks=4200, transfer_s=5.0, data_path=path,
                    data_plane=plane)
    pb = list(range(ntok // 16))
    with Producers(pcfg, [("req", pb, ntok)], fill_mode="ones") as prod:
        # the first block has arrived, the rest has not: the producer dies, its transfer agent with it (a
        # machine or container lost; an agent whose engine alone died finishes serving from the shared cache).
        # The consumer kills them the moment it sees the block.
        p, conn = start(consumer_main, enc(dcfg), 0, prod.params["req"].to_bytes(), [], signal_first_write=True,
                        use_block_manager=True, kill_on_first_write=(doomed := with_children(prod.procs[0][0].pid)))
        assert len(doomed) == (2 if path == "agent" else 1), doomed  # the agent is up before the producer says ready
        recv(conn, 60)  # started
        msg = recv(conn, 30)
        assert msg[0] == "writing", msg
        status, detail, elapsed = recv(conn, 60)[1:]
        p.join(timeout=10)
    assert status == "failed", (status, detail)
    invalid, why, free, total = detail
    assert len(invalid) == len(pb)  # every block the load was to write is reported invalid...
    assert free == total  # ...and discarded back to the block manager: nothing leaks
    assert elapsed < 5.0 + 3.0, why


def test_side_channel_survives_garbage_and_refuses_incompatible_peers(conn: str) -> None:
    pcfg = make_cfg("prefill", "P", connector=conn)
    with Producers(pcfg, [("req", P_BLOCKS[:7], NTOK), ("req2", P_BLOCKS[:7], NTOK)]) as prod:
        r = prod.params["req"].ranks[0]
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{r.host}:{r.port}")
        bad_version = msgspec.msgpack.encode({"type": "hello", "version": 99, "engine_id": "x", "client_nonce": b""})
        for frame in [b"\x00garbage", b"\xff" * 100, bad_version, msgspec.msgpack.encode({"type": "nope"})]:
            s.send_multipart([b"", frame])
            assert s.poll(2000), "the server answers a bad message with an error"
            reply = s.recv_multipart()[1]
            assert msgspec.msgpack.decode(reply)["type"] == "error"
        s.send_multipart([b"", b"x" * (5 << 20)])  # oversized: dropped by the transport limit
        s.close()
        # an incompatible consumer (other head size) is refused with both values named
        other = make_cfg("decode", "D", connector=conn, head_size=32)
        (status, (invalid, why), _), = consume(other, prod.params["req"])
        assert status == "failed" and invalid == D_BLOCKS[:7]
        assert "head_size: local 32, remote 16" in why
        # the failed load abandoned its request, so the producer freed it at once
        assert prod.wait_released("req", timeout=5.0)
        # and the server still serves a good consumer
        (status, detail, _), = consume(make_cfg("decode", "D", connector=conn), prod.params["req2"])
        assert status == "ok", detail


@pytest.mark.parametrize(("dkw", "why"), [
    ({"kv_fused": True, "layout": "HND", "bs": 64}, "block sizes must match (local 64, remote 16)"),
    ({"layout": "HND"}, "kv_fused: local False, remote True"),
])
def test_fused_caches_refuse_what_they_cannot_repack(conn: str, dkw: dict, why: str) -> None:
    """vLLM's kernels order a block's rows their own way: blocks move whole, never re-cut."""
    pcfg = make_cfg("prefill", "P", connector=conn, kv_fused=True, layout="HND")
    with Producers(pcfg, [("req", P_BLOCKS[:7], NTOK)]) as prod:
        (status, detail, _), = consume(make_cfg("decode", "D", connector=conn, **dkw), prod.params["req"])
        assert status == "failed" and why in detail[1], detail
        assert prod.wait_released("req", timeout=5.0), "the refused load abandons, so the producer frees"
        st = prod.stats()
        assert (st["holds_abandoned"], st["holds_expired"], st["holds_done"]) == (1, 0, 0), \
            "freed because the consumer abandoned it, not a lease later"


def test_auth_a_client_without_the_secret_gets_nothing(conn: str) -> None:
    env = {"KVX_TEST_SECRET": "s3cret"}
    pcfg = make_cfg("prefill", "P", connector=conn, secret_env="KVX_TEST_SECRET")
    with Producers(pcfg, [("req", P_BLOCKS[:7], NTOK)], env=env) as prod:
        r = prod.params["req"].ranks[0]
        lay = ParallelLayout(tp_size=1, pp_size=1, num_layers=4, num_kv_heads=4)
        client = SideChannelClient(2.0, 0)
        with pytest.raises(AuthError):
            client.handshake(r.host, r.port, "intruder", 0, lay, b"wrong")
        with pytest.raises(AuthError):
            client.handshake(r.host, r.port, "intruder", 0, lay, None)
        # a consumer with no secret fails cleanly; one with the secret loads
        (status, (_, why), _), = consume(make_cfg("decode", "D", connector=conn), prod.params["req"])
        assert status == "failed" and "auth" in why
        (status, detail, _), = consume(make_cfg("decode", "D", connector=conn, secret_env="KVX_TEST_SECRET"),
                                       prod.params["req"], env=env)
        assert status == "ok", detail
