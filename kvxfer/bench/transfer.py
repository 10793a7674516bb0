"""``kvxfer bench transfer``: every installed connector, the peers, and the baselines, moving
the same KV between the same two processes in one run.

The cache is the Llama-3-8B-like one (32 layers, K and V, 8 kv heads, head size 128, bf16,
block 16: 2 MiB a block). Request sizes run from 1 block to 8192 tokens (1 GiB), with block
ids contiguous or random on both sides. Two processes: a producer (the prefill rank) and
this process (the decode rank). For each pattern and size, in the same run:

- each installed connector pulls the request (hold on the producer, ``start_load`` + ``poll``
  here; the holds are made ahead, untimed, while loads run, so loads run back to back as the
  peers' reads do), and the bytes that arrived are checked against the bytes that left;
- baselines: ``memcpy`` of the same number of bytes inside this process (the limit on one
  machine); ``raw socket``: the producer ``sendmsg``s the connector's own descriptor list over
  one Unix socket into the same destination blocks (no protocol, no threads), and ``raw socket
  (spliced)``: the same with the pages spliced in (``Splicer``, as the tcp plane serves a Unix
  socket by default); with ucxx
  installed, ``raw ucxx``: the same bytes as one tag message, and the same pieces one message
  each (64 in flight);
- with ``--peers``: NIXL (UCX backend) and Mooncake (TCP) reading the same pieces. NIXL runs
  on three sets of UCX transports: its best on one host (``nixl``: CMA copies, as the cma
  plane's), TCP only (``nixl-tcp``: the tcp plane's wire) and the ucx plane's set, everything
  but CMA (``nixl-nocma``); a table after the main one sets each kvxfer plane against NIXL on
  its own wire and on NIXL's best (JSON: ``against_nixl``).

Each connector row also says where a load's time went (``stages``, from ``Connector.stats()``
differenced over the trials, per load): queue (start_load until the consumer worker took it),
plan (planning, until the first read is issued), transfer (until the last read came back),
complete (repack, done notices queued, until finished), handoff (finished until ``poll``
returned it to the engine). The engine thread waits in ``poll(timeout_s=...)`` (``--poll
wait``) or calls ``poll()`` in a tight loop (``--poll busy``, as NIXL's callers do).

``--concurrency N --blocks K``: N requests of K random blocks each in flight at once through
each connector (start_load all, then poll until all finished) against one request of the
same N*K blocks: aggregate GB/s, its ratio to the one request, per-request latency p50/p99.

``--busy-engine``: every case again with a Python thread spinning in pure Python in this
(consumer) process, and in the producer process (peers too, in their own process pair):
busy/idle ratios of GB/s and p50 latency, for each poll style. A third row, ``cpu``, spins
in a process of its own: the same lost core without any GIL, the control that tells what a
busy engine costs through its GIL from what it costs by taking a core (on a 2-core machine,
a spinning thread takes half of it).

``--rounds R`` (3): the conditions of each ratio (idle and the three busy rows; one request and
many) run in R alternating rounds of ``--budget-s``/R each, their trials pooled
(:mod:`kvxfer.bench.rounds`), so the machine's drift falls on both sides. The busy table's idle
figure is measured in those rounds, not taken from the main table. Each round has its own
warm-up load and at least 3 trials.

``--gap-ms G``: every trial of every row (connectors, peers, baselines) starts after G ms idle,
as requests arrive in serving, instead of back to back. On a VM a process that idled for
milliseconds runs its next steps from cold caches and a sleeping CPU: a row's back-to-back and
spaced figures differ by that, for kvxfer (whose agents sleep between loads) and NIXL alike.

Each connector's ``ratio`` is against its own transport's raw baseline (tcp: raw socket
(spliced); tcp-copy and Mooncake: raw socket; ucx and NIXL: raw ucxx, one message when
contiguous, the pieces when random); ``x memcpy`` is against memcpy. Times are medians over
trials run until a time budget.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from kvxfer.agent.priority import nice_refusal
from kvxfer.bench import peers as peer_mod
from kvxfer.bench.held_ahead import HeldAhead
from kvxfer.bench.peer_rows import run_peer
from kvxfer.bench.rounds import in_rounds
from kvxfer.bench.transfer_args import add_arguments
from kvxfer.bench.transfer_cases import (
    BLOCK,
    Conn,
    Spinner,
    UcxRaw,
    bench_cache,
    check_arrived,
    clear,
    make_cfg,
    piece_views,
    plane_of,
    producer,
    region_views,
    stage_breakdown,
    start_cpu_spinner,
    stat,
    timed,
    ucx_runtime_plane,
)

# tests import STAGES from here (and bench_cache, check_arrived, make_cfg, stage_breakdown, used above)
from kvxfer.bench.transfer_cases import STAGES as STAGES
from kvxfer.bench.transfer_report import HEADER, format_row, nixl_comparisons, print_tables, write_json, write_plots
from kvxfer.cache import spec_from_config
from kvxfer.connector import Connector, Descriptors, available_data_planes, load_data_plane
from kvxfer.progress import Progress
from kvxfer.protocol import KVTransferParams
from kvxfer.topology import ParallelLayout, remote_sources
from kvxfer.transfer.planner import SideLayout, plan_direct

BUSY_SIDES = ("consumer", "producer", "cpu")  # where --busy-engine spins (Bench._spin)


def _unusable(name: str, data_path: str | None) -> str | None:
    """None when data plane ``name`` starts here; else why not (e.g. ucx without its extra)."""
    cfg = make_cfg("decode", name, 1, data_path)
    why = nice_refusal(cfg.connector.agent_nice) if cfg.connector.agent_nice else None
    if why is not None:
        return why
    try:
        Connector.from_config(cfg).close()
    except Exception as e:
        hint = " (pip install 'kvxfer[ucx]')" if plane_of(name) == "ucx" else ""
        return f"cannot start: {type(e).__name__}: {e}{hint}"
    return None


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.polls = {"wait": ["wait"], "busy": ["busy"], "both": ["wait", "busy"]}[
            args.poll or ("both" if args.busy_engine else "wait")]
        self.poll = self.polls[0]  # the poll style of the main table and of --concurrency
        self.max_blocks = max(args.tokens) // BLOCK
        self.num_blocks = max(self.max_blocks, args.concurrency * args.blocks) + 64
        installed = available_data_planes()
        self.skipped: dict[str, str] = {}
        self.names = []
        for name in args.connectors or sorted(installed):
            if plane_of(name) not in installed:
                self.skipped[name] = f"not installed (installed: {', '.join(sorted(installed))})"
            elif not load_data_plane(plane_of(name)).cross_process:
                self.skipped[name] = "in-process only; nothing to measure between two processes"
            elif (why := _unusable(name, args.data_path)) is not None:
                self.skipped[name] = why
            else:
                self.names.append(name)
        self.peers = list(peer_mod.PEERS) if args.peers else []
        self.records: list[dict[str, Any]] = []
        self.busy_records: list[dict[str, Any]] = []
        self.concurrency_records: list[dict[str, Any]] = []
        self.cases: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, Descriptors]] = {}
        self.baselines: dict[tuple[str, int], dict[str, dict[str, float]]] = {}
        from kvxfer.connectors.tcp.splice import splice_works

        self.splice_refused = splice_works()  # why this host's Unix sockets take no spliced pages, or None
        self.spinner = Spinner()
        self.gap_s = args.gap_ms / 1000
        self.bare_planes: list[Any] = []  # made for the raw ucxx baseline (see ucx_runtime_plane)
        cfg = make_cfg("decode", "tcp", self.num_blocks)
        self.layout = ParallelLayout.from_config(cfg)
        self.bytes_per_block = spec_from_config(cfg).bytes_per_block
        self.conc: tuple[list[np.ndarray], list[np.ndarray]] | None = None  # --concurrency's requests
        self._ahead: list[HeldAhead] = []  # holds made ahead, per measurement

    def run(self) -> list[dict[str, Any]]:
        args = self.args
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        proc = ctx.Process(target=producer, args=(self.names, self.num_blocks, child, args.data_path), daemon=True)
        proc.start()
        self.producer_proc = proc
        try:
            raw_path = self._recv()
            self.cache = bench_cache(self.num_blocks, fill=False)
            self.side = SideLayout.from_cache(self.cache)  # both sides': the same geometry
            self.conns: dict[str, Conn] = {}
            for name in self.names:
                self.conns[name] = Connector.from_config(make_cfg("decode", name, self.num_blocks, args.data_path))
                self.conns[name].register_kv_caches(self.cache)
            self.raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.raw.connect(raw_path)
            self.views = region_views(self.cache)
            self.memcpy_src = torch.empty(self.max_blocks * self.cache.spec.bytes_per_block, dtype=torch.uint8)
            self.memcpy_src.fill_(1)
            self.memcpy_dst = torch.empty_like(self.memcpy_src)
            ucx_rows = [n for n in self.conns if plane_of(n) == "ucx"]
            self.ucx_raw = self._ucx_raw(ucx_rows[0]) if ucx_rows else None
            cases = [(p, t) for p in args.patterns for t in args.tokens]
            progress = Progress(len(cases), "cases")
            rng = np.random.default_rng(0)
            for i, (pat, tokens) in enumerate(cases):
                progress.update(i)
                nblocks = -(-tokens // BLOCK)
                if pat == "contiguous":
                    src, dst = np.arange(8, 8 + nblocks), np.arange(40, 40 + nblocks)
                else:
                    src = rng.permutation(self.num_blocks)[:nblocks]
                    dst = rng.permutation(self.num_blocks)[:nblocks]
                self._case(pat, tokens, src, dst)
            progress.update(len(cases))
            if args.concurrency:
                n, k = args.concurrency, args.blocks
                src, dst = rng.permutation(self.num_blocks)[: n * k], rng.permutation(self.num_blocks)[: n * k]
                self.conc = ([src[i * k : (i + 1) * k] for i in range(n)], [dst[i * k : (i + 1) * k] for i in range(n)])
                for name, conn in self.conns.items():
                    self._concurrency(name, conn)
            self._close_consumers()  # before the producer: a ucx endpoint closed after its peer left logs errors
            self.pipe.send(("stop",))
            proc.join(timeout=60)
        finally:
            self.spinner.set(False)
            if proc.is_alive():
                proc.kill()
            self._close_consumers()
        for name in self.peers:
            run_peer(self, name)
        return self.records

    def _close_consumers(self) -> None:
        """Close this side's raw ucxx endpoint, connectors and bare planes (once)."""
        raw, self.ucx_raw = getattr(self, "ucx_raw", None), None
        if raw is not None:
            raw.close()
        conns, self.conns = getattr(self, "conns", {}), {}
        for c in conns.values():
            c.close()
        planes, self.bare_planes = self.bare_planes, []
        for p in planes:
            p.close()

    # -------------------------------------------------------------- loads through a connector
    def _wait_all(self, name: str, conn: Conn, pending: dict[str, float], poll: str) -> dict[str, float]:
        """Poll (``poll``: "wait" or "busy") until every request in ``pending`` (id -> its
        perf_counter start) finished; each one's latency, start to the poll that reported it."""
        lat: dict[str, float] = {}
        deadline = time.monotonic() + 120
        busy = poll == "busy"
        while pending:
            f = conn.poll() if busy else conn.poll(timeout_s=1.0)
            if f:
                now = time.perf_counter()
                if f.failed:
                    raise RuntimeError(f"{name}: load failed: {f.errors}")
                for rid in f.receiving:
                    if (t := pending.pop(rid, None)) is not None:
                        lat[rid] = now - t
            elif time.monotonic() > deadline:
                raise TimeoutError(f"{name}: {len(pending)} loads not done in 120s")
        return lat

    def _load_fn(self, name: str, conn: Conn, src: np.ndarray, dst: np.ndarray, poll: str) -> Callable[[], float]:
        dst_ids = dst.tolist()
        ahead = HeldAhead(name, src.tolist(), len(src) * BLOCK)
        self._ahead.append(ahead)  # what the measurement leaves unused is released after it

        def load() -> float:
            """One pull, timed from start_load to the poll that reported it. The producer's holds are
            made ahead and not counted (``HeldAhead``), so loads run back to back, as the peers'
            reads do: a hold on a busy producer waits for its engine's GIL (ms), and on these VMs a
            load that follows ms of idleness runs every stage at about half speed (cold caches),
            which would measure the pacing, not the transfer (see docs/benchmarks.md, session 10)."""
            params = ahead.next(self)
            t0 = time.perf_counter()
            conn.start_load(params.request_id, params, dst_ids)
            self._wait_all(name, conn, {params.request_id: t0}, poll)
            return time.perf_counter() - t0

        return load

    def _many_fn(self, name: str, conn: Conn, srcs: list[np.ndarray], dsts: list[np.ndarray], poll: str,
                 lats: list[float]) -> Callable[[], float]:
        src_ids, dst_ids = [s.tolist() for s in srcs], [d.tolist() for d in dsts]
        tokens = len(srcs[0]) * BLOCK

        def load() -> float:
            """Every request held, then all started and polled until all finished: the time for all."""
            self.pipe.send(("holds", name, src_ids, tokens))
            params = [KVTransferParams.from_bytes(b) for b in self._recv()]
            pending: dict[str, float] = {}
            t0 = time.perf_counter()
            for p, ids in zip(params, dst_ids, strict=True):
                pending[p.request_id] = time.perf_counter()
                conn.start_load(p.request_id, p, ids)
            lats.extend(self._wait_all(name, conn, pending, poll).values())
            return time.perf_counter() - t0

        return load

    def _measure(self, conn: Conn, fn: Callable[[], object], on_warm: Callable[[], object] | None = None,
                 min_trials: int = 3, budget_s: float | None = None) -> tuple[list[float], dict[str, float] | None]:
        """Trials of ``fn`` over ``budget_s`` (default ``--budget-s``), and the stages of the loads
        they made (warm-up not counted)."""
        before: dict[str, float] = {}

        def warm() -> None:
            before.update(conn.stats())
            if on_warm is not None:
                on_warm()

        budget = self.args.budget_s if budget_s is None else budget_s
        times = timed(fn, budget, min_trials, on_warm=warm, gap_s=self.gap_s)
        self._release_ahead()
        return times, stage_breakdown(before, conn.stats())

    def _release_ahead(self) -> None:
        """Release the holds made ahead (``_load_fn``) that no trial used, so none waits out its lease."""
        for ahead in self._ahead:
            ahead.collect(self)
            if ahead.ready:
                self.pipe.send(("release", ahead.name, [p.request_id for p in ahead.ready]))
                self._recv()
                ahead.ready.clear()
        self._ahead.clear()

    @contextmanager
    def _spin(self, where: str, pair: peer_mod.PeerPair | None = None) -> Iterator[None]:
        """A Python thread spinning in ``where``: "consumer" (this process; a peer's consumer
        spins itself), "producer" (the producer process), "cpu" (a process of its own, waited for
        until it spins), or "idle" (none)."""
        cpu = start_cpu_spinner() if where == "cpu" else None
        if where == "consumer" and pair is None:
            self.spinner.set(True)
        elif where == "producer":
            if pair is not None:
                pair.spin_producer(True)
            else:
                self.pipe.send(("spin", True))
                assert self._recv() == "ok"
        try:
            yield
        finally:
            if cpu is not None:
                cpu.kill()
                cpu.wait()
                if cpu.stdout is not None:
                    cpu.stdout.close()
            if where == "consumer" and pair is None:
                self.spinner.set(False)
            elif where == "producer":
                if pair is not None:
                    pair.spin_producer(False)
                else:
                    self.pipe.send(("spin", False))
                    assert self._recv() == "ok"

    def _busy_rows(self, name: str, kind: str, pat: str, tokens: int, nbytes: int, polls: list[str],
                   measure: Callable[[str, str, float], tuple[list[float], dict[str, float] | None]]) -> None:
        """--busy-engine: for each poll style, idle, a spinning thread in the consumer, one in the
        producer, and a spinning process (``cpu``), in alternating rounds (``rounds.py``); a record
        per busy side, against the idle trials of the same rounds."""
        for poll in polls:
            def measure_poll(where: str, budget_s: float, poll: str = poll
                             ) -> tuple[list[float], dict[str, float] | None]:
                return measure(poll, where, budget_s)

            got = in_rounds(("idle", *BUSY_SIDES), measure_poll, self.args.budget_s, self.args.rounds)
            base = got["idle"]
            i = stat(base[0], nbytes)
            for where in BUSY_SIDES:
                times, stages = got[where]
                b = stat(times, nbytes)
                self.busy_records.append({
                    "connector": name, "kind": kind, "pattern": pat, "tokens": tokens, "blocks": tokens // BLOCK,
                    "bytes": nbytes, "poll": poll, "busy": where, "idle_gbps": i["gbps"], "busy_gbps": b["gbps"],
                    "gbps_ratio": b["gbps"] / i["gbps"], "idle_p50_us": i["p50_us"], "busy_p50_us": b["p50_us"],
                    "p50_ratio": b["p50_us"] / i["p50_us"], "idle_p99_us": i["p99_us"], "busy_p99_us": b["p99_us"],
                    "idle_trials": i["trials"], "busy_trials": b["trials"], "idle_stages": base[1],
                    "busy_stages": stages, "checked": True})

    def _recv(self, timeout_s: float = 300.0) -> Any:
        """The producer process's next answer; one that exited (its traceback is above) or is
        silent for ``timeout_s`` raises at once."""
        deadline = time.monotonic() + timeout_s
        while not self.pipe.poll(0.5):
            if not self.producer_proc.is_alive():
                raise RuntimeError(f"the producer process exited (code {self.producer_proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the producer process did not answer in {timeout_s:g}s")
        return self.pipe.recv()

    def _ucx_raw(self, row: str) -> UcxRaw:
        """Endpoints both ways: the producer sends on its own, this process receives on its own
        (on the UCX runtime of connector row ``row``, a ucx one)."""
        plane, bare = ucx_runtime_plane(self.conns[row])
        if bare:
            self.bare_planes.append(plane)
        self.pipe.send(("ucx_connect", plane.rt.address, self.max_blocks * self.cache.spec.bytes_per_block, row))
        return UcxRaw(plane, self._recv())

    # -------------------------------------------------------------- one pattern x size
    def _case(self, pat: str, tokens: int, src: np.ndarray, dst: np.ndarray) -> None:
        budget = self.args.budget_s
        base = {"pattern": pat, "tokens": tokens, "blocks": len(src)}
        descs = self._plan(src, dst)
        nbytes = descs.nbytes
        results: dict[str, dict[str, Any]] = {}
        for name, conn in self.conns.items():

            def measure(poll: str, where: str, budget_s: float | None = None, name: str = name,
                        conn: Conn = conn) -> tuple[list[float], dict[str, float] | None]:
                clear(self.cache, dst)
                with self._spin(where):  # warm-up: the handshake
                    out = self._measure(conn, self._load_fn(name, conn, src, dst, poll), budget_s=budget_s)
                check_arrived(self.cache, src, dst, name)
                return out

            times, stages = measure(self.poll, "idle")
            results[name] = {**stat(times, nbytes), "descriptors": len(descs), "poll": self.poll, "stages": stages,
                             "checked": True}
            if self.args.busy_engine:
                self._busy_rows(name, "connector", pat, tokens, nbytes, self.polls, measure)
        baselines = {"memcpy": stat(timed(lambda: self.memcpy_dst[:nbytes].copy_(self.memcpy_src[:nbytes]),
                                          budget, gap_s=self.gap_s), nbytes)}
        baselines["raw socket"] = stat(self._raw_socket(descs, budget, spliced=False), nbytes)
        if self.splice_refused is None:  # else the tcp plane copies too (it logged why): no such baseline
            baselines["raw socket (spliced)"] = stat(self._raw_socket(descs, budget, spliced=True), nbytes)
        if self.ucx_raw is not None:
            baselines.update(self._raw_ucxx(descs, budget))
        self.cases[(pat, tokens)] = (src, dst, descs)
        self.baselines[(pat, tokens)] = baselines
        memcpy = baselines["memcpy"]["gbps"]
        for name, b in baselines.items():
            self.records.append({"connector": name, "kind": "baseline", **base, "bytes": nbytes, **b,
                                 "descriptors": len(descs), "baseline": None, "baseline_gbps": None,
                                 "ratio": None, "memcpy_gbps": memcpy, "x_memcpy": b["gbps"] / memcpy})
        for name, r in results.items():
            self._add(name, "connector", pat, tokens, src, descs, r)
        self._print_case(pat, tokens)

    def _concurrency(self, name: str, conn: Conn) -> None:
        """--concurrency: one request of N*K blocks and N requests of K blocks in flight at once,
        in alternating rounds (``rounds.py``)."""
        assert self.conc is not None
        srcs, dsts = self.conc
        src, dst = np.concatenate(srcs), np.concatenate(dsts)
        lats: list[float] = []

        def measure(which: str, budget_s: float) -> tuple[list[float], dict[str, float] | None]:
            clear(self.cache, dst)
            if which == "one":
                out = self._measure(conn, self._load_fn(name, conn, src, dst, self.poll), budget_s=budget_s)
            else:
                round_lats: list[float] = []  # this round's, the warm-up's dropped
                out = self._measure(conn, self._many_fn(name, conn, srcs, dsts, self.poll, round_lats),
                                    on_warm=round_lats.clear, budget_s=budget_s)
                lats.extend(round_lats)
            check_arrived(self.cache, src, dst, name)
            return out

        got = in_rounds(("one", "many"), measure, self.args.budget_s, self.args.rounds)
        (one, one_stages), (many, many_stages) = got["one"], got["many"]
        self._add_concurrency(name, "connector", self.poll, len(src) * self.bytes_per_block, one, one_stages,
                              many, lats, many_stages)

    def _add_concurrency(self, name: str, kind: str, poll: str, nbytes: int, one: list[float],
                         one_stages: dict[str, float] | None, many: list[float], lats: list[float],
                         many_stages: dict[str, float] | None) -> None:
        single, conc = stat(one, nbytes), stat(many, nbytes)
        rec = {"connector": name, "kind": kind, "pattern": "random", "requests": self.args.concurrency,
               "blocks_per_request": self.args.blocks, "bytes": nbytes, "poll": poll, "gbps": conc["gbps"],
               "single_gbps": single["gbps"], "ratio": conc["gbps"] / single["gbps"], "all_p50_us": conc["p50_us"],
               "single_p50_us": single["p50_us"], "latency_p50_us": float(np.percentile(lats, 50)) * 1e6,
               "latency_p99_us": float(np.percentile(lats, 99)) * 1e6, "trials": conc["trials"],
               "single_trials": single["trials"], "stages": many_stages, "single_stages": one_stages,
               "checked": True}
        self.concurrency_records.append(rec)

    def _add(self, name: str, kind: str, pat: str, tokens: int, src: np.ndarray, descs: Descriptors,
             r: dict[str, Any]) -> None:
        baselines = self.baselines[(pat, tokens)]
        bname = self._baseline_of(name, pat, baselines)
        bg, memcpy = baselines[bname]["gbps"], baselines["memcpy"]["gbps"]
        self.records.append({"connector": name, "kind": kind, "pattern": pat, "tokens": tokens, "blocks": len(src),
                             "bytes": descs.nbytes, "descriptors": len(descs), **r, "baseline": bname,
                             "baseline_gbps": bg, "ratio": r["gbps"] / bg, "memcpy_gbps": memcpy,
                             "x_memcpy": r["gbps"] / memcpy})

    def _baseline_of(self, name: str, pat: str, baselines: dict[str, Any]) -> str:
        if (plane_of(name) == "ucx" or peer_mod.engine_of(name) == "nixl") and "raw ucxx (one message)" in baselines:
            return "raw ucxx (one message)" if pat == "contiguous" else "raw ucxx (pieces)"
        # the tcp plane splices its Unix sockets' pages in by default (unix_send): its wire's limit is the spliced send
        if plane_of(name) == "tcp" and name != "tcp-copy" and "raw socket (spliced)" in baselines:
            return "raw socket (spliced)"
        return "raw socket"

    def _plan(self, src: np.ndarray, dst: np.ndarray) -> Descriptors:
        """The coalesced descriptor list a connector plans for this request (same cache geometry
        on both sides): what every baseline and peer moves."""
        (sl,) = remote_sources(self.layout, 0, 0, self.layout)
        return plan_direct(self.side, self.side, sl, src, dst, 0, len(dst) * BLOCK)

    def _raw_socket(self, d: Descriptors, budget: float, spliced: bool) -> list[float]:
        from kvxfer.connectors.tcp import recv_pieces

        self.pipe.send(("raw", d.remote_region.tobytes(), d.remote_offset.tobytes(), d.length.tobytes(), spliced))
        assert self._recv() == "ready"
        local = piece_views(self.views, d.local_region, d.local_offset, d.length)

        def one() -> None:
            self.raw.sendall(b"g")
            recv_pieces(self.raw, local, time.monotonic() + 120)

        try:
            return timed(one, budget, gap_s=self.gap_s)
        finally:
            self.raw.sendall(b"s")

    def _raw_ucxx(self, d: Descriptors, budget: float) -> dict[str, dict[str, float]]:
        raw = self.ucx_raw
        assert raw is not None
        nbytes = d.nbytes
        buf = self.memcpy_dst[:nbytes].numpy()

        def one() -> None:
            fut = raw.recv_one(buf)
            self.pipe.send(("ucx_one", nbytes))
            fut.result(120)
            self._recv()

        views = [np.frombuffer(v, np.uint8) for v in piece_views(self.views, d.local_region, d.local_offset, d.length)]
        packed = (d.remote_region.tobytes(), d.remote_offset.tobytes(), d.length.tobytes())

        def pieces() -> None:
            fut = raw.recv_pieces(views)
            self.pipe.send(("ucx_pieces", *packed))
            fut.result(300)
            self._recv()

        return {"raw ucxx (one message)": stat(timed(one, budget, gap_s=self.gap_s), nbytes),
                "raw ucxx (pieces)": stat(timed(pieces, budget / 2, min_trials=2, gap_s=self.gap_s), nbytes)}

    def _print_case(self, pat: str, tokens: int) -> None:
        for r in self.records:
            if r["pattern"] == pat and r["tokens"] == tokens:
                print(format_row(r), flush=True)


def run(args: argparse.Namespace) -> int:
    for t in args.tokens:
        if t < 1 or t % BLOCK:
            print(f"error: --tokens: expected multiples of {BLOCK} (whole blocks), got {t}", file=sys.stderr)
            return 1
    if args.gap_ms < 0:
        print(f"error: --gap-ms: expected >= 0, got {args.gap_ms:g}", file=sys.stderr)
        return 1
    if args.rounds < 1:
        print(f"error: --rounds: expected at least 1, got {args.rounds}", file=sys.stderr)
        return 1
    if args.concurrency < 0 or args.blocks < 1:
        print("error: --concurrency and --blocks: expected positive counts", file=sys.stderr)
        return 1
    bench = Bench(args)
    machine = f"{platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}"
    print(f"kvxfer bench transfer: Llama-3-8B-like cache (32 layers, K+V, 8 kv heads, head 128, bf16, block 16); "
          f"{machine}")
    print(f"connectors: {', '.join(bench.names) or 'none'}; peers: {', '.join(bench.peers) or 'off (--peers)'}; "
          f"poll: {bench.poll}; data path: {args.data_path or 'default'}"
          + (f"; {args.gap_ms:g} ms idle before each trial" if args.gap_ms else "")
          + (f"; busy/idle and concurrency ratios in {args.rounds} alternating rounds"
             if args.busy_engine or args.concurrency else ""))
    print(HEADER)
    print("-" * len(HEADER))
    records = bench.run()
    comparisons = nixl_comparisons(records)
    print_tables(bench.skipped, bench.busy_records, bench.concurrency_records, args.concurrency, args.blocks,
                 comparisons)
    if args.json:
        write_json(args.json, {"machine": machine, "skipped": bench.skipped, "records": records,
                               "against_nixl": comparisons,
                               "poll": bench.poll, "data_path": args.data_path, "gap_ms": args.gap_ms,
                               "rounds": args.rounds,
                               "busy_engine": bench.busy_records, "concurrency": bench.concurrency_records})
    if args.plot:
        write_plots(args.plot, f"kvxfer bench transfer, two processes on one host ({machine})", records,
                    bench.busy_records)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer bench transfer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))
