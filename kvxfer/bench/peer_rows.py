"""The other transfer engines' rows of ``kvxfer bench transfer --peers`` (NIXL, Mooncake), each
in its own producer and consumer processes, measured after kvxfer's on the same cases."""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING

import numpy as np

from kvxfer.bench import peers as peer_mod
from kvxfer.bench.rounds import in_rounds
from kvxfer.bench.transfer_cases import bench_cache, stat
from kvxfer.bench.transfer_report import format_row
from kvxfer.connector import Descriptors
from kvxfer.progress import Progress

if TYPE_CHECKING:
    from kvxfer.bench.transfer import Bench


def run_peer(bench: Bench, name: str) -> None:
    """A peer in its own process pair, after kvxfer's: its threads must not load the cores
    while anything else is measured, and a crash in it must not end the run."""
    why = peer_mod.missing_reason(name)
    if why is not None:
        bench.skipped[name] = why
        return
    print(f"{name}: starting its own producer and consumer processes", file=sys.stderr)
    try:
        pair = peer_mod.PeerPair(name, functools.partial(bench_cache, bench.num_blocks, True))
    except RuntimeError as e:
        bench.skipped[name] = f"failed to start: {e}"
        return
    progress = Progress(len(bench.cases), f"{name} cases")
    try:
        for i, ((pat, tokens), (src, dst, d)) in enumerate(bench.cases.items()):
            progress.update(i)
            descs = (d.remote_region, d.remote_offset, d.local_region, d.local_offset, d.length)

            def measure(poll: str, where: str, budget_s: float | None = None, src: np.ndarray = src,
                        dst: np.ndarray = dst, descs: tuple[np.ndarray, ...] = descs) -> tuple[list[float], None]:
                budget = bench.args.budget_s if budget_s is None else budget_s
                with bench._spin(where, pair):
                    status, r = pair.measure({"op": "read", "src": src, "dst": dst, "descs": descs,
                                              "budget": budget, "spin": where == "consumer",
                                              "gap_s": bench.gap_s})
                if status != "ok":
                    raise RuntimeError(r)
                return r["times"], None

            try:
                idle = measure("busy", "idle")
                bench._add(name, "peer", pat, tokens, src, d, {**stat(idle[0], d.nbytes), "poll": "busy",
                                                              "stages": None, "checked": True})
                print(format_row(bench.records[-1]), flush=True)
                if bench.args.busy_engine:  # a peer polls its own way (NIXL: a tight loop)
                    bench._busy_rows(name, "peer", pat, tokens, d.nbytes, ["busy"], measure)
            except RuntimeError as e:
                bench.skipped[name] = f"failed at {pat} {tokens} tokens: {e}"
                if not pair.alive():
                    break
        if bench.conc is not None and pair.alive():
            peer_concurrency(bench, name, pair)
        progress.update(len(bench.cases))
    finally:
        pair.close()


def peer_concurrency(bench: Bench, name: str, pair: peer_mod.PeerPair) -> None:
    """--concurrency for a peer: one request of all the blocks and the requests in flight at once,
    in alternating rounds as kvxfer's (``rounds.py``); a failed measurement skips the row, named."""
    assert bench.conc is not None
    srcs, dsts = bench.conc
    src, dst = np.concatenate(srcs), np.concatenate(dsts)
    whole = bench._plan(src, dst)
    parts = [bench._plan(s, t) for s, t in zip(srcs, dsts, strict=True)]

    def tup(d: Descriptors) -> tuple[np.ndarray, ...]:
        return d.remote_region, d.remote_offset, d.local_region, d.local_offset, d.length

    lats: list[float] = []

    def measure(which: str, budget_s: float) -> tuple[list[float], None]:
        if which == "one":
            status, r = pair.measure({"op": "read", "src": src, "dst": dst, "descs": tup(whole), "budget": budget_s,
                                      "gap_s": bench.gap_s})
        else:
            status, r = pair.measure({"op": "many", "src": src, "dst": dst, "reqs": [tup(p) for p in parts],
                                      "budget": budget_s, "gap_s": bench.gap_s})
        if status != "ok":
            raise RuntimeError(r)
        if which == "many":
            lats.extend(r["lats"])
        return r["times"], None

    try:  # one request and many in alternating rounds (rounds.py), as kvxfer's
        got = in_rounds(("one", "many"), measure, bench.args.budget_s, bench.args.rounds)
    except RuntimeError as e:
        bench.skipped[f"{name} --concurrency"] = str(e)
        return
    bench._add_concurrency(name, "peer", "busy", whole.nbytes, got["one"][0], None, got["many"][0], lats, None)
