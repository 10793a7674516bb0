"""``kvxfer bench transfer``: every installed connector, the peers, and the baselines, moving
the same KV between the same two processes in one run.

The cache is the Llama-3-8B-like one (32 layers, K and V, 8 kv heads, head size 128, bf16,
block 16: 2 MiB a block). Request sizes run from 1 block to 8192 tokens (1 GiB), with block
ids contiguous or random on both sides. Two processes: a producer (the prefill rank) and
this process (the decode rank). For each pattern and size, in the same run:

- each installed connector pulls the request (hold on the producer, ``start_load`` + ``poll``
  here), and the bytes that arrived are checked against the bytes that left;
- baselines: ``memcpy`` of the same number of bytes inside this process (the limit on one
  machine); ``raw socket``: the producer ``sendmsg``s the connector's own descriptor list over
  one Unix socket into the same destination blocks (no protocol, no threads); with ucxx
  installed, ``raw ucxx``: the same bytes as one tag message, and the same pieces one message
  each (64 in flight);
- with ``--peers``: NIXL (UCX backend) and Mooncake (TCP) reading the same pieces.

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
(consumer) process, then in the producer process (peers too, in their own process pair):
busy/idle ratios of GB/s and p50 latency, for each poll style. A third row, ``cpu``, spins
in a process of its own: the same lost core without any GIL, the control that tells what a
busy engine costs through its GIL from what it costs by taking a core (on a 2-core machine,
a spinning thread takes half of it).

Each connector's ``ratio`` is against its own transport's raw baseline (tcp and Mooncake:
raw socket; ucx and NIXL: raw ucxx, one message when contiguous, the pieces when random);
``x memcpy`` is against memcpy. Times are medians over trials run until a time budget.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from kvxfer.bench import peers as peer_mod
from kvxfer.cache import KVCache, allocate_kv_cache, spec_from_config
from kvxfer.config import CacheConfig, ConnectorConfig, InstanceConfig, ModelConfig, Role, SideChannelConfig
from kvxfer.connector import Connector, Descriptors, available_data_planes, load_data_plane
from kvxfer.progress import Progress
from kvxfer.protocol import KVTransferParams
from kvxfer.topology import ParallelLayout, remote_sources
from kvxfer.transfer.aggregator import Finished
from kvxfer.transfer.planner import SideLayout, plan_direct

TOKENS = [16, 64, 256, 1024, 4096, 8192]
BLOCK = 16
RAW_TAG = 0x7A11_0000_0000_0001
INFLIGHT = 64


class Conn(Protocol):
    """What the bench calls on a connector (what ``Connector.from_config`` returns): the engine's API."""

    def register_kv_caches(self, cache: KVCache) -> None: ...
    def hold(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVTransferParams: ...
    def start_load(self, request_id: str, params: KVTransferParams, local_block_ids: list[int]) -> None: ...
    def poll(self, timeout_s: float = 0.0) -> Finished: ...
    def stats(self) -> dict[str, float]: ...
    def close(self) -> None: ...


def make_cfg(role: Role, connector: str, num_blocks: int, data_path: str | None = None) -> InstanceConfig:
    """``data_path``: where the connector's data path runs (``connector.data_path``; None: its default)."""
    extra: dict[str, Any] = {} if data_path is None else {"data_path": data_path}
    return InstanceConfig(
        role=role, engine_id=f"bench-{role}-{connector}",
        model=ModelConfig(name="llama3-8b-like", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                          head_size=128, intermediate_size=14336, vocab_size=128256),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, dtype="bfloat16"),
        connector=ConnectorConfig(name=connector, side_channel=SideChannelConfig(port=0), **extra),
    )


class Spinner:
    """A Python thread spinning in pure Python while on: an engine thread busy with Python work
    (it takes the GIL from every other thread of its process for a switch interval at a time)."""

    def __init__(self) -> None:
        self.stop = True
        self.thread: threading.Thread | None = None

    def _spin(self) -> None:
        x = 0
        while not self.stop:
            x += 1

    def set(self, on: bool) -> None:
        if on and self.thread is None:
            self.stop = False
            self.thread = threading.Thread(target=self._spin, name="kvxfer-bench-spin", daemon=True)
            self.thread.start()
        elif not on and self.thread is not None:
            self.stop = True
            self.thread.join()
            self.thread = None


def fill_pattern(cache: KVCache) -> None:
    """Block b of region r holds int32 words (r << 16 | b): cheap to check on arrival."""
    for r, t in enumerate(cache.tensors):
        words = t.view(t.shape[0], -1).view(torch.int32)
        words.copy_((torch.arange(t.shape[0], dtype=torch.int32)[:, None] + (r << 16)).expand_as(words))


def check_arrived(cache: KVCache, src: np.ndarray, dst: np.ndarray, who: str) -> None:
    for r, t in enumerate(cache.tensors):
        words = t.view(t.shape[0], -1).view(torch.int32)[torch.as_tensor(dst)]
        want = torch.as_tensor(src, dtype=torch.int32)[:, None] + (r << 16)
        if not torch.equal(words, want.expand_as(words)):
            raise RuntimeError(f"{who}: region {r}: the bytes that arrived are not the bytes that left")


def clear(cache: KVCache, dst: np.ndarray) -> None:
    ids = torch.as_tensor(dst)
    for t in cache.tensors:
        t[ids] = 0


def _views(cache: KVCache) -> dict[int, memoryview]:
    return {r.region_id: t.view(-1).view(torch.uint8).numpy().data
            for r, t in zip(cache.regions, cache.tensors, strict=True)}


def _pieces(views: dict[int, memoryview], regions: np.ndarray, offsets: np.ndarray,
            lengths: np.ndarray) -> list[memoryview]:
    return [views[r][o : o + n] for r, o, n in zip(regions.tolist(), offsets.tolist(), lengths.tolist(), strict=True)]


class UcxRaw:
    """Raw ucxx between the two processes, on the ucx plane's own worker and loop thread: tag
    messages over an endpoint, progressed the way the plane progresses its own (continuously
    while a transfer is in flight; an idle worker must not spin a core through the others'
    measurements)."""

    def __init__(self, plane: Any, peer_worker: bytes, max_bytes: int = 0) -> None:
        self.rt = plane.rt
        ucxx = self.rt.ucxx
        self.tag = ucxx.types.Tag(RAW_TAG)
        self.big = np.ones(max_bytes, dtype=np.uint8)

        async def connect() -> Any:
            return await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(peer_worker),
                                                                 endpoint_error_handling=False)

        self.ep = self.rt.submit(connect()).result(30)

    def _run(self, coro_fn: Callable[[], Any]) -> Any:
        async def go() -> None:
            async with self.rt.active():
                await coro_fn()

        return self.rt.submit(go())

    def send_one(self, nbytes: int) -> None:
        self._run(lambda: self.ep.send(self.big[:nbytes], tag=self.tag, force_tag=True)).result(120)

    def send_pieces(self, views: list[memoryview]) -> None:
        import asyncio

        async def go() -> None:
            for i in range(0, len(views), INFLIGHT):
                await asyncio.gather(*(self.ep.send(np.frombuffer(v, np.uint8), tag=self.tag, force_tag=True)
                                       for v in views[i : i + INFLIGHT]))

        self._run(go).result(300)

    def recv_one(self, buf: np.ndarray) -> Any:
        return self._run(lambda: self.ep.recv(buf, tag=self.tag, force_tag=True))

    def recv_pieces(self, views: list[np.ndarray]) -> Any:
        import asyncio

        async def go() -> None:
            for i in range(0, len(views), INFLIGHT):
                await asyncio.gather(*(self.ep.recv(v, tag=self.tag, force_tag=True) for v in views[i : i + INFLIGHT]))

        return self._run(go)


def ucx_runtime_plane(conn: Conn) -> tuple[Any, bool]:
    """A ucx plane of this process for the raw ucxx baseline (its ucxx runtime is outside the
    DataPlane API): the connector's own when its data path runs here, else a bare one made
    with the same defaults (the connector's runs in its transfer agent); True: bare, close it."""
    plane = getattr(conn, "plane", None)
    if getattr(plane, "rt", None) is not None:
        return plane, False
    return load_data_plane("ucx")({}), True


# ------------------------------------------------------------------ producer process

def bench_cache(num_blocks: int, fill: bool) -> KVCache:
    cache = allocate_kv_cache(spec_from_config(make_cfg("prefill", "tcp", num_blocks)), num_blocks)
    if fill:
        fill_pattern(cache)
    return cache


def producer(names: list[str], num_blocks: int, conn: Any, data_path: str | None = None) -> None:
    cache = bench_cache(num_blocks, fill=True)
    conns: dict[str, Conn] = {}
    for name in names:
        conns[name] = Connector.from_config(make_cfg("prefill", name, num_blocks, data_path))
        conns[name].register_kv_caches(cache)
    views = _views(cache)
    path = os.path.join(tempfile.gettempdir(), f"kvxfer-bench-{os.getpid()}.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    conn.send(path)
    raw: socket.socket | None = None
    ucx_raw: UcxRaw | None = None
    n = 0
    spinner = Spinner()
    bare_planes: list[Any] = []
    from kvxfer.connectors.tcp import send_pieces

    try:
        while True:
            cmd = conn.recv()
            op = cmd[0]
            if op == "hold":
                n += 1
                conn.send(conns[cmd[1]].hold(f"r{n}", cmd[2], cmd[3]).to_bytes())
            elif op == "holds":  # one hold per block id list, all at once
                out = []
                for ids in cmd[2]:
                    n += 1
                    out.append(conns[cmd[1]].hold(f"r{n}", ids, cmd[3]).to_bytes())
                conn.send(out)
            elif op == "spin":  # the producer's engine thread busy in Python (a thread standing in for it)
                spinner.set(cmd[1])
                conn.send("ok")
            elif op == "poll":
                for c in conns.values():
                    c.poll()
                conn.send("ok")
            elif op == "raw":  # the pieces, then one "go" byte per trial over the raw socket
                pieces = _pieces(views, *(np.frombuffer(b, dtype=np.int64) for b in cmd[1:]))
                if raw is None:
                    raw, _ = srv.accept()
                conn.send("ready")
                while raw.recv(1) == b"g":
                    send_pieces(raw, pieces)
            elif op == "ucx_connect":
                ucx_plane, bare = ucx_runtime_plane(conns["ucx"])
                if bare:
                    bare_planes.append(ucx_plane)
                ucx_raw = UcxRaw(ucx_plane, cmd[1], cmd[2])
                conn.send(ucx_plane.rt.address)
            elif op == "ucx_one":
                assert ucx_raw is not None
                ucx_raw.send_one(cmd[1])
                conn.send("ok")
            elif op == "ucx_pieces":
                assert ucx_raw is not None
                ucx_raw.send_pieces(_pieces(views, *(np.frombuffer(b, dtype=np.int64) for b in cmd[1:])))
                conn.send("ok")
            elif op == "stop":
                break
    finally:
        spinner.set(False)
        for c in conns.values():
            c.close()
        for p in bare_planes:
            p.close()
        srv.close()
        os.unlink(path)


# ------------------------------------------------------------------ this process

def timed(fn: Callable[[], object], budget_s: float, min_trials: int = 3,
          max_trials: int = 200, on_warm: Callable[[], object] | None = None) -> list[float]:
    """Run ``fn`` once to warm up (then ``on_warm``), then until the budget is spent (at least
    ``min_trials``). A trial lasts as long as ``fn`` ran, or, when it returns a float, that many
    seconds (the part it times itself)."""
    fn()
    if on_warm is not None:
        on_warm()
    times: list[float] = []
    start = time.monotonic()
    while len(times) < max_trials and (len(times) < min_trials or time.monotonic() - start < budget_s):
        t0 = time.perf_counter()
        took = fn()
        times.append(took if isinstance(took, float) else time.perf_counter() - t0)
    return times


def stat(times: list[float], nbytes: int) -> dict[str, float]:
    med = statistics.median(times)
    return {"gbps": nbytes / med / 1e9, "p50_us": med * 1e6, "p99_us": float(np.percentile(times, 99)) * 1e6,
            "trials": len(times)}


STAGES = ("queue", "plan", "request", "bytes", "transfer", "complete", "handoff")


def stage_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """Mean seconds per load (as ``<stage>_us``) of each stage ``Connector.stats()`` sums
    (``stage_<stage>_s``), between two snapshots; None when no load finished in between (or the
    connector counts no stages)."""
    n = after.get("stage_loads", 0.0) - before.get("stage_loads", 0.0)
    if n <= 0:
        return None
    out: dict[str, float] = {"loads": n}
    for k in STAGES:
        key = f"stage_{k}_s"
        if key not in after:
            continue
        over = after.get("stage_handoffs", 0.0) - before.get("stage_handoffs", 0.0) if k == "handoff" else n
        if over > 0:
            out[f"{k}_us"] = (after[key] - before.get(key, 0.0)) / over * 1e6
    return out


def format_stages(st: dict[str, float] | None) -> str:
    return "/".join(f"{st[f'{k}_us']:.0f}" for k in STAGES if f"{k}_us" in st) if st else ""


def _unusable(name: str, data_path: str | None) -> str | None:
    """None when data plane ``name`` starts here; else why not (e.g. ucx without its extra)."""
    try:
        Connector.from_config(make_cfg("decode", name, 1, data_path)).close()
    except Exception as e:
        hint = " (pip install 'kvxfer[ucx]')" if name == "ucx" else ""
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
            if name not in installed:
                self.skipped[name] = f"not installed (installed: {', '.join(sorted(installed))})"
            elif not load_data_plane(name).cross_process:
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
        self.spinner = Spinner()
        self.bare_planes: list[Any] = []  # made for the raw ucxx baseline (see ucx_runtime_plane)
        cfg = make_cfg("decode", "tcp", self.num_blocks)
        self.layout = ParallelLayout.from_config(cfg)
        self.bytes_per_block = spec_from_config(cfg).bytes_per_block
        self.conc: tuple[list[np.ndarray], list[np.ndarray]] | None = None  # --concurrency's requests

    def run(self) -> list[dict[str, Any]]:
        args = self.args
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        proc = ctx.Process(target=producer, args=(self.names, self.num_blocks, child, args.data_path), daemon=True)
        proc.start()
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
            self.views = _views(self.cache)
            self.memcpy_src = torch.empty(self.max_blocks * self.cache.spec.bytes_per_block, dtype=torch.uint8)
            self.memcpy_src.fill_(1)
            self.memcpy_dst = torch.empty_like(self.memcpy_src)
            self.ucx_raw = self._ucx_raw() if "ucx" in self.conns else None
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
            self.pipe.send(("stop",))
            proc.join(timeout=60)
        finally:
            self.spinner.set(False)
            if proc.is_alive():
                proc.kill()
            for c in getattr(self, "conns", {}).values():
                c.close()
            for p in self.bare_planes:
                p.close()
        for name in self.peers:
            self._run_peer(name)
        return self.records

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
        src_ids, dst_ids, tokens = src.tolist(), dst.tolist(), len(src) * BLOCK

        def load() -> float:
            """One pull, timed from start_load to the poll that reported it (the producer's hold is not counted)."""
            self.pipe.send(("hold", name, src_ids, tokens))
            params = KVTransferParams.from_bytes(self._recv())
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
                 min_trials: int = 3) -> tuple[list[float], dict[str, float] | None]:
        """Trials of ``fn`` over the budget, and the stages of the loads they made (warm-up not counted)."""
        before: dict[str, float] = {}

        def warm() -> None:
            before.update(conn.stats())
            if on_warm is not None:
                on_warm()

        times = timed(fn, self.args.budget_s, min_trials, on_warm=warm)
        return times, stage_breakdown(before, conn.stats())

    @contextmanager
    def _spin(self, where: str, pair: peer_mod.PeerPair | None = None) -> Iterator[None]:
        """A Python thread spinning in ``where``: "consumer" (this process; a peer's consumer
        spins itself), "producer" (the producer process), or "idle" (none)."""
        cpu = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if where == "cpu" else None
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
            if where == "consumer" and pair is None:
                self.spinner.set(False)
            elif where == "producer":
                if pair is not None:
                    pair.spin_producer(False)
                else:
                    self.pipe.send(("spin", False))
                    assert self._recv() == "ok"

    def _busy_rows(self, name: str, kind: str, pat: str, tokens: int, nbytes: int, polls: list[str],
                   measure: Callable[[str, str], tuple[list[float], dict[str, float] | None]],
                   idle: dict[str, tuple[list[float], dict[str, float] | None]]) -> None:
        """--busy-engine: for each poll style, idle (``idle`` has those measured already), then
        a spinning thread in the consumer, then in the producer; a record per busy side."""
        for poll in polls:
            base = idle[poll] if poll in idle else measure(poll, "idle")
            i = stat(base[0], nbytes)
            for where in ("consumer", "producer", "cpu"):
                times, stages = measure(poll, where)
                b = stat(times, nbytes)
                self.busy_records.append({
                    "connector": name, "kind": kind, "pattern": pat, "tokens": tokens, "blocks": tokens // BLOCK,
                    "bytes": nbytes, "poll": poll, "busy": where, "idle_gbps": i["gbps"], "busy_gbps": b["gbps"],
                    "gbps_ratio": b["gbps"] / i["gbps"], "idle_p50_us": i["p50_us"], "busy_p50_us": b["p50_us"],
                    "p50_ratio": b["p50_us"] / i["p50_us"], "idle_p99_us": i["p99_us"], "busy_p99_us": b["p99_us"],
                    "idle_trials": i["trials"], "busy_trials": b["trials"], "idle_stages": base[1],
                    "busy_stages": stages, "checked": True})

    def _run_peer(self, name: str) -> None:
        """A peer in its own process pair, after kvxfer's: its threads must not load the cores
        while anything else is measured, and a crash in it must not end the run."""
        why = peer_mod.missing_reason(name)
        if why is not None:
            self.skipped[name] = why
            return
        print(f"{name}: starting its own producer and consumer processes", file=sys.stderr)
        try:
            pair = peer_mod.PeerPair(name, functools.partial(bench_cache, self.num_blocks, True))
        except RuntimeError as e:
            self.skipped[name] = f"failed to start: {e}"
            return
        progress = Progress(len(self.cases), f"{name} cases")
        try:
            for i, ((pat, tokens), (src, dst, d)) in enumerate(self.cases.items()):
                progress.update(i)
                descs = (d.remote_region, d.remote_offset, d.local_region, d.local_offset, d.length)

                def measure(poll: str, where: str, src: np.ndarray = src, dst: np.ndarray = dst,
                            descs: tuple[np.ndarray, ...] = descs) -> tuple[list[float], None]:
                    with self._spin(where, pair):
                        status, r = pair.measure({"op": "read", "src": src, "dst": dst, "descs": descs,
                                                  "budget": self.args.budget_s, "spin": where == "consumer"})
                    if status != "ok":
                        raise RuntimeError(r)
                    return r["times"], None

                try:
                    idle = measure("busy", "idle")
                    self._add(name, "peer", pat, tokens, src, d, {**stat(idle[0], d.nbytes), "poll": "busy",
                                                                  "stages": None, "checked": True})
                    print(format_row(self.records[-1]), flush=True)
                    if self.args.busy_engine:  # a peer polls its own way (NIXL: a tight loop)
                        self._busy_rows(name, "peer", pat, tokens, d.nbytes, ["busy"], measure, {"busy": idle})
                except RuntimeError as e:
                    self.skipped[name] = f"failed at {pat} {tokens} tokens: {e}"
                    if not pair.alive():
                        break
            if self.conc is not None and pair.alive():
                self._peer_concurrency(name, pair)
            progress.update(len(self.cases))
        finally:
            pair.close()

    def _peer_concurrency(self, name: str, pair: peer_mod.PeerPair) -> None:
        assert self.conc is not None
        srcs, dsts = self.conc
        src, dst = np.concatenate(srcs), np.concatenate(dsts)
        whole = self._plan(src, dst)
        parts = [self._plan(s, t) for s, t in zip(srcs, dsts, strict=True)]

        def tup(d: Descriptors) -> tuple[np.ndarray, ...]:
            return d.remote_region, d.remote_offset, d.local_region, d.local_offset, d.length

        budget = self.args.budget_s
        status, one = pair.measure({"op": "read", "src": src, "dst": dst, "descs": tup(whole), "budget": budget})
        if status == "ok":
            status, many = pair.measure({"op": "many", "src": src, "dst": dst, "reqs": [tup(p) for p in parts],
                                         "budget": budget})
        if status != "ok":
            self.skipped[f"{name} --concurrency"] = str(one if status != "ok" and not isinstance(one, dict) else many)
            return
        self._add_concurrency(name, "peer", "busy", whole.nbytes, one["times"], None, many["times"], many["lats"], None)

    def _recv(self, timeout_s: float = 300.0) -> Any:
        if not self.pipe.poll(timeout_s):
            raise TimeoutError(f"the producer process did not answer in {timeout_s:g}s")
        return self.pipe.recv()

    def _ucx_raw(self) -> UcxRaw:
        """Endpoints both ways: the producer sends on its own, this process receives on its own."""
        plane, bare = ucx_runtime_plane(self.conns["ucx"])
        if bare:
            self.bare_planes.append(plane)
        self.pipe.send(("ucx_connect", plane.rt.address, self.max_blocks * self.cache.spec.bytes_per_block))
        return UcxRaw(plane, self._recv())

    # -------------------------------------------------------------- one pattern x size
    def _case(self, pat: str, tokens: int, src: np.ndarray, dst: np.ndarray) -> None:
        budget = self.args.budget_s
        base = {"pattern": pat, "tokens": tokens, "blocks": len(src)}
        descs = self._plan(src, dst)
        nbytes = descs.nbytes
        results: dict[str, dict[str, Any]] = {}
        for name, conn in self.conns.items():

            def measure(poll: str, where: str, name: str = name,
                        conn: Conn = conn) -> tuple[list[float], dict[str, float] | None]:
                clear(self.cache, dst)
                with self._spin(where):
                    out = self._measure(conn, self._load_fn(name, conn, src, dst, poll))  # warm-up: the handshake
                check_arrived(self.cache, src, dst, name)
                return out

            times, stages = measure(self.poll, "idle")
            results[name] = {**stat(times, nbytes), "descriptors": len(descs), "poll": self.poll, "stages": stages,
                             "checked": True}
            if self.args.busy_engine:
                self._busy_rows(name, "connector", pat, tokens, nbytes, self.polls, measure,
                                {self.poll: (times, stages)})
        baselines = {"memcpy": stat(timed(lambda: self.memcpy_dst[:nbytes].copy_(self.memcpy_src[:nbytes]),
                                          budget), nbytes)}
        baselines["raw socket"] = stat(self._raw_socket(descs, budget), nbytes)
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
        """--concurrency: one request of N*K blocks, then N requests of K blocks in flight at once."""
        assert self.conc is not None
        srcs, dsts = self.conc
        src, dst = np.concatenate(srcs), np.concatenate(dsts)
        clear(self.cache, dst)
        one, one_stages = self._measure(conn, self._load_fn(name, conn, src, dst, self.poll))
        check_arrived(self.cache, src, dst, name)
        clear(self.cache, dst)
        lats: list[float] = []
        many, many_stages = self._measure(conn, self._many_fn(name, conn, srcs, dsts, self.poll, lats),
                                          on_warm=lats.clear)
        check_arrived(self.cache, src, dst, name)
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
        if name in ("ucx", "nixl") and "raw ucxx (one message)" in baselines:
            return "raw ucxx (one message)" if pat == "contiguous" else "raw ucxx (pieces)"
        return "raw socket"

    def _plan(self, src: np.ndarray, dst: np.ndarray) -> Descriptors:
        """The coalesced descriptor list a connector plans for this request (same cache geometry
        on both sides): what every baseline and peer moves."""
        (sl,) = remote_sources(self.layout, 0, 0, self.layout)
        return plan_direct(self.side, self.side, sl, src, dst, 0, len(dst) * BLOCK)

    def _raw_socket(self, d: Descriptors, budget: float) -> list[float]:
        from kvxfer.connectors.tcp import recv_pieces

        self.pipe.send(("raw", d.remote_region.tobytes(), d.remote_offset.tobytes(), d.length.tobytes()))
        assert self._recv() == "ready"
        local = _pieces(self.views, d.local_region, d.local_offset, d.length)

        def one() -> None:
            self.raw.sendall(b"g")
            recv_pieces(self.raw, local, time.monotonic() + 120)

        try:
            return timed(one, budget)
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

        views = [np.frombuffer(v, np.uint8) for v in _pieces(self.views, d.local_region, d.local_offset, d.length)]
        packed = (d.remote_region.tobytes(), d.remote_offset.tobytes(), d.length.tobytes())

        def pieces() -> None:
            fut = raw.recv_pieces(views)
            self.pipe.send(("ucx_pieces", *packed))
            fut.result(300)
            self._recv()

        return {"raw ucxx (one message)": stat(timed(one, budget), nbytes),
                "raw ucxx (pieces)": stat(timed(pieces, budget / 2, min_trials=2), nbytes)}

    def _print_case(self, pat: str, tokens: int) -> None:
        for r in self.records:
            if r["pattern"] == pat and r["tokens"] == tokens:
                print(format_row(r), flush=True)


HEADER = (f"{'connector':<24} {'pattern':<10} {'tokens':>6} {'MiB':>7} {'pieces':>6} {'GB/s':>6} {'p50 us':>9} "
          f"{'p99 us':>9}  {'baseline':<22} {'base GB/s':>9} {'ratio':>6} {'x memcpy':>8}  "
          f"stages us: queue/plan/transfer/complete/handoff")


def format_row(r: dict[str, Any]) -> str:
    name = r["connector"] if r["kind"] != "baseline" else f"  ({r['connector']})"
    base = (f"{r['baseline']:<22} {r['baseline_gbps']:9.2f} {r['ratio']:6.2f}" if r["baseline"]
            else f"{'':<22} {'':>9} {'':>6}")
    return (f"{name:<24} {r['pattern']:<10} {r['tokens']:>6} {r['bytes'] / 2**20:7.1f} {r['descriptors']:>6} "
            f"{r['gbps']:6.2f} {r['p50_us']:9.0f} {r['p99_us']:9.0f}  {base} {r['x_memcpy']:8.2f}  "
            f"{format_stages(r.get('stages'))}").rstrip()


CONCURRENCY_HEADER = (f"{'connector':<24} {'requests':>8} {'blocks':>6} {'MiB':>7} {'poll':<4} {'GB/s':>6} "
                      f"{'1 req GB/s':>10} {'ratio':>6} {'lat p50 us':>10} {'lat p99 us':>10}  "
                      f"stages us (concurrent): queue/plan/transfer/complete/handoff")


def format_concurrency(r: dict[str, Any]) -> str:
    return (f"{r['connector']:<24} {r['requests']:>8} {r['blocks_per_request']:>6} {r['bytes'] / 2**20:7.1f} "
            f"{r['poll']:<4} {r['gbps']:6.2f} {r['single_gbps']:10.2f} {r['ratio']:6.2f} {r['latency_p50_us']:10.0f} "
            f"{r['latency_p99_us']:10.0f}  {format_stages(r['stages'])}").rstrip()


BUSY_HEADER = (f"{'connector':<24} {'pattern':<10} {'tokens':>6} {'poll':<4} {'busy':<8} {'idle GB/s':>9} "
               f"{'busy GB/s':>9} {'GB/s ratio':>10} {'idle p50':>9} {'busy p50':>9} {'p50 ratio':>9}  "
               f"stages us (busy): queue/plan/transfer/complete/handoff")


def format_busy(r: dict[str, Any]) -> str:
    return (f"{r['connector']:<24} {r['pattern']:<10} {r['tokens']:>6} {r['poll']:<4} {r['busy']:<8} "
            f"{r['idle_gbps']:9.2f} {r['busy_gbps']:9.2f} {r['gbps_ratio']:10.2f} {r['idle_p50_us']:9.0f} "
            f"{r['busy_p50_us']:9.0f} {r['p50_ratio']:9.2f}  {format_stages(r['busy_stages'])}").rstrip()


def plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    patterns = sorted({r["pattern"] for r in records}, key=["contiguous", "random"].index)
    fig, axes = plt.subplots(1, len(patterns), figsize=(6.5 * len(patterns), 4.8), sharey=True, squeeze=False)
    names = list(dict.fromkeys(r["connector"] for r in records))
    for ax, pat in zip(axes[0], patterns, strict=True):
        for i, name in enumerate(names):
            rows = sorted((r for r in records if r["connector"] == name and r["pattern"] == pat),
                          key=lambda r: r["bytes"])
            if not rows:
                continue
            baseline = rows[0]["kind"] == "baseline"
            ax.plot([r["bytes"] / 2**20 for r in rows], [r["gbps"] for r in rows],
                    linestyle="--" if baseline else "-", marker="o" if not baseline else ".",
                    linewidth=1.2 if baseline else 2.2, color=f"C{i}",
                    label=f"{name} (baseline)" if baseline else name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # memcpy of a cache-resident 2 MiB is 10x the rest: a linear axis hides them
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_title(f"{pat} block ids")
        ax.set_xlabel("request size (MiB of KV; 2 MiB = one 16-token block)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("throughput (GB/s, median; log scale)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=min(4, len(labels)), frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * ((len(labels) - 1) // 4), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_busy(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bars: busy/idle GB/s ratio of each connector, per case and poll style, one panel per busy side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = ["consumer", "producer", "cpu"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8), sharey=True, squeeze=False)
    names = list(dict.fromkeys(r["connector"] for r in records))
    cases = list(dict.fromkeys((r["pattern"], r["tokens"], r["poll"]) for r in records))
    width = 0.8 / max(1, len(names))
    for ax, side in zip(axes[0], sides, strict=True):
        for i, name in enumerate(names):
            by_case = {(r["pattern"], r["tokens"], r["poll"]): r["gbps_ratio"] for r in records
                       if r["connector"] == name and r["busy"] == side}
            xs = [j + (i - (len(names) - 1) / 2) * width for j, c in enumerate(cases) if c in by_case]
            ax.bar(xs, [by_case[c] for c in cases if c in by_case], width, color=f"C{i}", label=name)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_yscale("log")  # a spinning thread costs 100x in places and gains a little in others
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{p[:4]} {t}\n{poll} poll" for p, t, poll in cases], fontsize=7)
        ax.set_title(f"a Python thread spinning in the {side} process" if side != "cpu" else
                     "a process of its own spinning (a core lost, no GIL)")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("GB/s busy / GB/s idle")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=min(6, len(labels)), frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--connectors", nargs="+", default=None, metavar="NAME",
                    help="data planes to measure (default: every installed one that works across processes)")
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS, help="request sizes in tokens (16 per block)")
    ap.add_argument("--patterns", nargs="+", choices=["contiguous", "random"], default=["contiguous", "random"])
    ap.add_argument("--peers", action="store_true", help="also measure NIXL and Mooncake when installed")
    ap.add_argument("--budget-s", type=float, default=1.0, help="time spent on each measurement's trials")
    ap.add_argument("--concurrency", type=int, nargs="?", const=64, default=0, metavar="N",
                    help="also N requests (default 64) of --blocks random blocks each in flight at once, against "
                         "one request of all their blocks")
    ap.add_argument("--blocks", type=int, default=2, metavar="K", help="blocks per request for --concurrency")
    ap.add_argument("--busy-engine", action="store_true",
                    help="also every case with a Python thread spinning in the consumer, then the producer process")
    ap.add_argument("--poll", choices=["wait", "busy", "both"], default=None,
                    help="how the engine thread waits: poll(timeout_s=...) (wait) or poll() in a tight loop (busy); "
                         "both: the main table waits, --busy-engine has rows for both (its default)")
    ap.add_argument("--data-path", choices=["auto", "agent", "engine"], default=None,
                    help="connector.data_path of every connector measured (default: the config's default)")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH")
    ap.add_argument("--plot", type=Path, default=None, metavar="PATH",
                    help="PNG: GB/s against request size (with --busy-engine also PATH-busy.png)")


def run(args: argparse.Namespace) -> int:
    for t in args.tokens:
        if t < 1 or t % BLOCK:
            print(f"error: --tokens: expected multiples of {BLOCK} (whole blocks), got {t}", file=sys.stderr)
            return 1
    if args.concurrency < 0 or args.blocks < 1:
        print("error: --concurrency and --blocks: expected positive counts", file=sys.stderr)
        return 1
    bench = Bench(args)
    machine = f"{platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}"
    print(f"kvxfer bench transfer: Llama-3-8B-like cache (32 layers, K+V, 8 kv heads, head 128, bf16, block 16); "
          f"{machine}")
    print(f"connectors: {', '.join(bench.names) or 'none'}; peers: {', '.join(bench.peers) or 'off (--peers)'}; "
          f"poll: {bench.poll}; data path: {args.data_path or 'default'}")
    print(HEADER)
    print("-" * len(HEADER))
    records = bench.run()
    for name, why in bench.skipped.items():
        print(f"{name:<24} {why}")
    if bench.busy_records:
        print(f"\nbusy engine: a Python thread spinning in the consumer or producer process, against idle "
              f"(peers poll their own way)\n{BUSY_HEADER}\n{'-' * len(BUSY_HEADER)}")
        for r in bench.busy_records:
            print(format_busy(r))
    if bench.concurrency_records:
        print(f"\nconcurrency: {args.concurrency} requests of {args.blocks} random blocks in flight at once, against "
              f"one request of all of them\n{CONCURRENCY_HEADER}\n{'-' * len(CONCURRENCY_HEADER)}")
        for r in bench.concurrency_records:
            print(format_concurrency(r))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine, "skipped": bench.skipped, "records": records,
                                         "poll": bench.poll, "data_path": args.data_path,
                                         "busy_engine": bench.busy_records, "concurrency": bench.concurrency_records},
                                        indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        title = f"kvxfer bench transfer, two processes on one host ({machine})"
        plot(records, args.plot, title)
        print(f"wrote {args.plot}")
        if bench.busy_records:
            busy_png = args.plot.with_name(f"{args.plot.stem}-busy{args.plot.suffix}")
            plot_busy(bench.busy_records, busy_png, title)
            print(f"wrote {busy_png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer bench transfer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))
