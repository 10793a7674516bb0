"""Push mode, layer by layer, between real processes over real sockets.

The decode ranks reserve blocks first and hand their PushTarget to the prefill ranks, which
write the oracle's values one layer at a time and save each; the decode ranks read each layer
as it is saved. Checked: bit-exact arrival across the topology, layout and block-size pairs pull
supports; layers land in order while later ones are still being written; a registration made
after some layers were saved gets those at once; a prefill killed mid-push fails the decode
side's load with its block ids within transfer_s; a decode side killed mid-push frees the
prefill side's blocks; a push after the reservation expired is refused and lands nothing.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from kvproc import recv, start
from pushproc import push_consumer_main, push_producer_main
from test_transfer import CASES, enc, make_cfg

from kvxfer.config import InstanceConfig
from kvxfer.protocol import PushTarget, merge_targets

NTOK = 100
P_BLOCKS = [7, 3, 12, 13, 14, 40, 2, 21, 22, 23, 50, 51, 60]
D_BLOCKS = [30, 31, 5, 6, 7, 8, 90, 91, 92, 17, 18, 70, 71]
PUSH_CASES = ["same layout", "HND 16 -> NHD 64", "block 64->16", "prefill TP2 -> decode TP1",
              "prefill TP1 -> decode TP2", "prefill PP2 -> decode PP1", "MLA, prefill TP2 -> decode TP1",
              "fused vec 16->64"]


class Push:
    """Decode ranks that reserved, prefill ranks that push; every process stopped on exit."""

    def __init__(self, pcfg: InstanceConfig, dcfg: InstanceConfig, rid: str = "req", ntok: int = NTOK,
                 timeout_s: float = 60.0, num_cached_tokens: int = 0) -> None:
        self.pcfg, self.dcfg, self.rid, self.ntok = pcfg, dcfg, rid, ntok
        self.decode = [start(push_consumer_main, enc(dcfg), r, rid, ntok, D_BLOCKS, timeout_s=timeout_s,
                             num_cached_tokens=num_cached_tokens) for r in range(dcfg.world_size)]
        self.prefill = [start(push_producer_main, enc(pcfg), r) for r in range(pcfg.world_size)]
        self.target = merge_targets([PushTarget.from_bytes(recv(c, 120)[1]) for _, c in self.decode])
        for _, c in self.prefill:
            recv(c, 120)  # a loaded machine starts processes slowly

    def push(self, after: int = 0, delay_s: float = 0.0, target: PushTarget | None = None) -> None:
        blocks = P_BLOCKS[: -(-self.ntok // self.pcfg.cache.block_size)]
        raw = (target or self.target).to_bytes()
        for _, c in self.prefill:
            c.send(("push", self.rid, blocks, self.ntok, raw, after, delay_s))

    def pushed(self) -> None:
        for _, c in self.prefill:
            recv(c, 120)

    def results(self, timeout: float = 90.0) -> list[tuple[Any, ...]]:
        return [recv(c, timeout)[1:] for _, c in self.decode]

    def released(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = []
            for _, c in self.prefill:
                c.send(("released",))
                done.append(self.rid in recv(c)[1])
            if all(done):
                return True
            time.sleep(0.05)
        return False

    def stats(self, rank: int = 0) -> dict[str, float]:
        c = self.prefill[rank][1]
        c.send(("stats",))
        return recv(c)[1]

    def __enter__(self) -> Push:
        return self

    def __exit__(self, *exc: object) -> None:
        for p, c in self.prefill:
            if p.is_alive():
                try:
                    c.send("stop")
                except (BrokenPipeError, OSError):
                    pass
        for p, _ in self.prefill + self.decode:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


@pytest.fixture(params=["tcp", "cma", "ucx"])
def conn(request: pytest.FixtureRequest) -> str:
    return request.param


# every case on tcp; on cma and ucx the cases that exercise their own paths (direct, gathered heads, staged)
MATRIX = [("tcp", c) for c in PUSH_CASES] + [(p, c) for p in ("cma", "ucx") for c in
                                            ("same layout", "HND 16 -> NHD 64", "prefill TP2 -> decode TP1")]


@pytest.mark.parametrize(("conn", "case"), MATRIX, ids=[f"{p}-{c}" for p, c in MATRIX])
def test_push_is_bit_exact(case: str, conn: str) -> None:
    pkw, dkw = CASES[case]
    pcfg, dcfg = make_cfg("prefill", "P", connector=conn, **pkw), make_cfg("decode", "D", connector=conn, **dkw)
    with Push(pcfg, dcfg) as push:
        push.push()
        push.pushed()
        for status, detail, _landed, _stats, _ in push.results():
            assert status == "ok", (status, detail)
        assert push.released(), "every prefill rank frees its blocks once its readers are done"
        assert [push.stats(r)["holds_done"] for r in range(pcfg.world_size)] == [1] * pcfg.world_size


def test_layers_land_in_order_while_later_ones_are_written(conn: str) -> None:
    pcfg, dcfg = make_cfg("prefill", "P", connector=conn), make_cfg("decode", "D", connector=conn)
    with Push(pcfg, dcfg) as push:
        push.push(delay_s=0.3)  # each layer's "forward pass" takes 0.3 s
        (status, detail, landed, _, _), = push.results()
        assert status == "ok", detail
        assert landed == [0, 1, 2, 3], "each layer reported as it landed, in order"


def test_a_late_registration_gets_the_saved_layers_at_once(conn: str) -> None:
    pkw, dkw = CASES["prefill TP2 -> decode TP1"]
    pcfg, dcfg = make_cfg("prefill", "P", connector=conn, **pkw), make_cfg("decode", "D", connector=conn, **dkw)
    with Push(pcfg, dcfg) as push:
        push.push(after=3, delay_s=0.2)  # the target arrives after three of four layers were saved
        (status, detail, landed, _, _), = push.results()
        assert status == "ok", detail
        assert sorted(landed) == [0, 1, 2, 3] and landed[-1] == 3


def test_a_partial_prefix_hit_is_not_pushed(conn: str) -> None:
    pcfg, dcfg = make_cfg("prefill", "P", connector=conn), make_cfg("decode", "D", connector=conn)
    with Push(pcfg, dcfg, num_cached_tokens=32) as push:
        push.push()
        (status, detail, _, stats, _), = push.results()
        assert status == "ok", detail
        per_token = stats["bytes_received"] / (NTOK - 32)
        assert per_token == 4 * 2 * 4 * 16 * 4, "only the 68 tokens past the prefix hit moved"


def test_prefill_killed_mid_push_fails_the_load_with_its_blocks() -> None:
    pcfg = make_cfg("prefill", "P")
    dcfg = make_cfg("decode", "D", transfer_s=2.0)
    with Push(pcfg, dcfg) as push:
        push.push(delay_s=1.0)
        time.sleep(1.5)  # a layer or two saved and read
        p, _ = push.prefill[0]
        os.kill(p.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        (status, detail, _, _, seen_at), = push.results()
        assert status == "failed", detail
        invalid, _why, code, _ = detail
        assert invalid == D_BLOCKS[:7] and code == "timeout"
        # the last notice came before the kill: failed by transfer_s (2 s) after it, not by the
        # reservation (60 s); the margin is for a loaded machine
        assert seen_at - killed_at < 2.0 + 3.0


def test_decode_killed_mid_push_frees_the_prefill_blocks() -> None:
    pcfg, dcfg = make_cfg("prefill", "P"), make_cfg("decode", "D")
    with Push(pcfg, dcfg) as push:
        push.push(delay_s=0.5)
        time.sleep(0.8)
        p, _ = push.decode[0]
        os.kill(p.pid, signal.SIGKILL)
        push.pushed()
        assert push.released(timeout=15.0), "the next notice finds no decode side: the hold is released"
        assert push.stats()["holds_abandoned"] == 1


def test_a_push_after_the_reservation_expired_is_refused_and_lands_nothing() -> None:
    pcfg = make_cfg("prefill", "P")
    dcfg = msgspec_replace_reservation(make_cfg("decode", "D"), 1.0)
    with Push(pcfg, dcfg) as push:
        (status, detail, _, _, _), = push.results()  # nothing pushed within the reservation
        assert status == "failed", detail
        invalid, _why, code, untouched = detail
        assert invalid == D_BLOCKS[:7] and code == "timeout" and untouched
        push.push()
        push.pushed()
        assert push.released(), "refused: the prefill side frees its blocks"
        assert push.stats()["holds_abandoned"] == 1


def msgspec_replace_reservation(cfg: InstanceConfig, reservation_s: float) -> InstanceConfig:
    import msgspec

    t = msgspec.structs.replace(cfg.connector.timeouts, reservation_s=reservation_s)
    return msgspec.structs.replace(cfg, connector=msgspec.structs.replace(cfg.connector, timeouts=t))


@pytest.mark.parametrize("case", ["same layout", "prefill TP2 -> decode TP1"])
def test_push_through_transfer_agents(case: str, conn: str) -> None:
    """Every rank's data path in a transfer agent (the default): save_layer, push and reserve are
    agent commands, landed layers come back as events."""
    pkw, dkw = CASES[case]
    pcfg = make_cfg("prefill", "P", connector=conn, data_path="agent", **pkw)
    dcfg = make_cfg("decode", "D", connector=conn, data_path="agent", **dkw)
    with Push(pcfg, dcfg) as push:
        push.push(delay_s=0.1)
        push.pushed()
        for status, detail, landed, _, _ in push.results():
            assert status == "ok", (status, detail)
            assert sorted(landed) == [0, 1, 2, 3], landed  # each layer once; reads may finish out of order
        assert push.released()
