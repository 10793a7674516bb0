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
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvxfer.bench import peers as peer_mod
from kvxfer.cache import KVCache, allocate_kv_cache, spec_from_config
from kvxfer.config import CacheConfig, ConnectorConfig, InstanceConfig, ModelConfig, Role, SideChannelConfig
from kvxfer.connector import Connector, Descriptors, available_data_planes, load_data_plane
from kvxfer.progress import Progress
from kvxfer.protocol import KVTransferParams

TOKENS = [16, 64, 256, 1024, 4096, 8192]
BLOCK = 16
RAW_TAG = 0x7A11_0000_0000_0001
INFLIGHT = 64


def make_cfg(role: Role, connector: str, num_blocks: int) -> InstanceConfig:
    return InstanceConfig(
        role=role, engine_id=f"bench-{role}-{connector}",
        model=ModelConfig(name="llama3-8b-like", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                          head_size=128, intermediate_size=14336, vocab_size=128256),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, dtype="bfloat16"),
        connector=ConnectorConfig(name=connector, side_channel=SideChannelConfig(port=0)),
    )


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


# ------------------------------------------------------------------ producer process

def bench_cache(num_blocks: int, fill: bool) -> KVCache:
    cache = allocate_kv_cache(spec_from_config(make_cfg("prefill", "tcp", num_blocks)), num_blocks)
    if fill:
        fill_pattern(cache)
    return cache


def producer(names: list[str], num_blocks: int, conn: Any) -> None:
    cache = bench_cache(num_blocks, fill=True)
    conns: dict[str, Connector] = {}
    for name in names:
        conns[name] = Connector.from_config(make_cfg("prefill", name, num_blocks))
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
    from kvxfer.connectors.tcp import send_pieces

    try:
        while True:
            cmd = conn.recv()
            op = cmd[0]
            if op == "hold":
                n += 1
                conn.send(conns[cmd[1]].hold(f"r{n}", cmd[2], cmd[3]).to_bytes())
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
                # the ucx connector's plane: its runtime (ucxx, no stubs) is outside the DataPlane API
                ucx_plane: Any = conns["ucx"].plane
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
        for c in conns.values():
            c.close()
        srv.close()
        os.unlink(path)


# ------------------------------------------------------------------ this process

def timed(fn: Callable[[], object], budget_s: float, min_trials: int = 3,
          max_trials: int = 200) -> list[float]:
    """Run ``fn`` once to warm up, then until the budget is spent (at least ``min_trials``).
    A trial lasts as long as ``fn`` ran, or, when it returns a float, that many seconds (the part
    it times itself)."""
    fn()
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


def _unusable(name: str) -> str | None:
    """None when data plane ``name`` starts here; else why not (e.g. ucx without its extra)."""
    try:
        Connector.from_config(make_cfg("decode", name, 1)).close()
    except Exception as e:
        hint = " (pip install 'kvxfer[ucx]')" if name == "ucx" else ""
        return f"cannot start: {type(e).__name__}: {e}{hint}"
    return None


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.max_blocks = max(args.tokens) // BLOCK
        self.num_blocks = self.max_blocks + 64
        installed = available_data_planes()
        self.skipped: dict[str, str] = {}
        self.names = []
        for name in args.connectors or sorted(installed):
            if name not in installed:
                self.skipped[name] = f"not installed (installed: {', '.join(sorted(installed))})"
            elif not load_data_plane(name).cross_process:
                self.skipped[name] = "in-process only; nothing to measure between two processes"
            elif (why := _unusable(name)) is not None:
                self.skipped[name] = why
            else:
                self.names.append(name)
        self.peers = list(peer_mod.PEERS) if args.peers else []
        self.records: list[dict[str, Any]] = []
        self.cases: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, Descriptors]] = {}
        self.baselines: dict[tuple[str, int], dict[str, dict[str, float]]] = {}

    def run(self) -> list[dict[str, Any]]:
        args = self.args
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        proc = ctx.Process(target=producer, args=(self.names, self.num_blocks, child), daemon=True)
        proc.start()
        try:
            raw_path = self._recv()
            self.cache = bench_cache(self.num_blocks, fill=False)
            self.conns = {}
            for name in self.names:
                self.conns[name] = Connector.from_config(make_cfg("decode", name, self.num_blocks))
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
            self.pipe.send(("stop",))
            proc.join(timeout=60)
        finally:
            if proc.is_alive():
                proc.kill()
            for c in getattr(self, "conns", {}).values():
                c.close()
        for name in self.peers:
            self._run_peer(name)
        return self.records

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
                status, r = pair.measure((src, dst, d.remote_region, d.remote_offset, d.local_region,
                                          d.local_offset, d.length, self.args.budget_s))
                if status != "ok":
                    self.skipped[name] = f"failed at {pat} {tokens} tokens: {r}"
                    if not pair.alive():
                        break
                    continue
                self._add(name, "peer", pat, tokens, src, d, r)
                print(format_row(self.records[-1]), flush=True)
            progress.update(len(self.cases))
        finally:
            pair.close()

    def _recv(self, timeout_s: float = 300.0) -> Any:
        if not self.pipe.poll(timeout_s):
            raise TimeoutError(f"the producer process did not answer in {timeout_s:g}s")
        return self.pipe.recv()

    def _ucx_raw(self) -> UcxRaw:
        """Endpoints both ways: the producer sends on its own, this process receives on its own."""
        plane: Any = self.conns["ucx"].plane  # the ucx connector's: its ucxx runtime is outside the DataPlane API
        self.pipe.send(("ucx_connect", plane.rt.address, self.max_blocks * self.cache.spec.bytes_per_block))
        return UcxRaw(plane, self._recv())

    # -------------------------------------------------------------- one pattern x size
    def _case(self, pat: str, tokens: int, src: np.ndarray, dst: np.ndarray) -> None:
        budget = self.args.budget_s
        base = {"pattern": pat, "tokens": tokens, "blocks": len(src)}
        descs: Descriptors | None = None
        results: dict[str, dict[str, Any]] = {}
        for name, conn in self.conns.items():
            clear(self.cache, dst)

            def load(name: str = name, conn: Connector = conn) -> float:
                """One pull, timed from start_load to done (the hold on the producer is not counted)."""
                self.pipe.send(("hold", name, src.tolist(), tokens))
                params = KVTransferParams.from_bytes(self._recv())
                t0 = time.perf_counter()
                conn.start_load(params.request_id, params, dst.tolist())
                deadline = time.monotonic() + 120
                while not (f := conn.poll(timeout_s=1.0)):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name}: load not done in 120s")
                if f.failed:
                    raise RuntimeError(f"{name}: load failed: {f.errors}")
                return time.perf_counter() - t0

            times = timed(load, budget)  # the warm-up load also pays the handshake
            check_arrived(self.cache, src, dst, name)
            if descs is None:
                descs = self._plan(conn, src, dst)
            results[name] = {**stat(times, descs.nbytes), "descriptors": len(descs)}
        if descs is None:  # no connector: the pieces a connector would move
            descs = self._plan_without_connector(src, dst)
        nbytes = descs.nbytes
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

    def _plan(self, conn: Connector, src: np.ndarray, dst: np.ndarray) -> Descriptors:
        """The connector's own descriptor list for this request: what every baseline moves."""
        from kvxfer.topology import remote_sources
        from kvxfer.transfer.planner import plan_direct

        consumer = conn.consumer
        assert consumer is not None
        peer = next(iter(consumer._peers.values()))
        (sl,) = remote_sources(consumer.layout, 0, 0, peer.meta.layout)
        return plan_direct(peer.side, consumer.local_side, sl, src, dst, 0, len(dst) * BLOCK)

    def _plan_without_connector(self, src: np.ndarray, dst: np.ndarray) -> Descriptors:
        """One piece per block and region: what an uncoalescing mover would send."""
        regions = self.cache.regions
        n = len(src)
        rid = np.repeat(np.arange(len(regions)), n)
        stride = np.asarray([r.block_stride for r in regions])[rid]
        return Descriptors(remote_region=rid, remote_offset=np.tile(src, len(regions)) * stride,
                           local_region=rid, local_offset=np.tile(dst, len(regions)) * stride,
                           length=stride.copy())

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
          f"{'p99 us':>9}  {'baseline':<22} {'base GB/s':>9} {'ratio':>6} {'x memcpy':>8}")


def format_row(r: dict[str, Any]) -> str:
    name = r["connector"] if r["kind"] != "baseline" else f"  ({r['connector']})"
    base = (f"{r['baseline']:<22} {r['baseline_gbps']:9.2f} {r['ratio']:6.2f}" if r["baseline"]
            else f"{'':<22} {'':>9} {'':>6}")
    return (f"{name:<24} {r['pattern']:<10} {r['tokens']:>6} {r['bytes'] / 2**20:7.1f} {r['descriptors']:>6} "
            f"{r['gbps']:6.2f} {r['p50_us']:9.0f} {r['p99_us']:9.0f}  {base} {r['x_memcpy']:8.2f}")


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


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--connectors", nargs="+", default=None, metavar="NAME",
                    help="data planes to measure (default: every installed one that works across processes)")
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS, help="request sizes in tokens (16 per block)")
    ap.add_argument("--patterns", nargs="+", choices=["contiguous", "random"], default=["contiguous", "random"])
    ap.add_argument("--peers", action="store_true", help="also measure NIXL and Mooncake when installed")
    ap.add_argument("--budget-s", type=float, default=1.0, help="time spent on each measurement's trials")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH")
    ap.add_argument("--plot", type=Path, default=None, metavar="PATH", help="PNG: GB/s against request size")


def run(args: argparse.Namespace) -> int:
    for t in args.tokens:
        if t < 1 or t % BLOCK:
            print(f"error: --tokens: expected multiples of {BLOCK} (whole blocks), got {t}", file=sys.stderr)
            return 1
    bench = Bench(args)
    machine = f"{platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}"
    print(f"kvxfer bench transfer: Llama-3-8B-like cache (32 layers, K+V, 8 kv heads, head 128, bf16, block 16); "
          f"{machine}")
    print(f"connectors: {', '.join(bench.names) or 'none'}; peers: {', '.join(bench.peers) or 'off (--peers)'}")
    print(HEADER)
    print("-" * len(HEADER))
    records = bench.run()
    for name, why in bench.skipped.items():
        print(f"{name:<24} {why}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine, "skipped": bench.skipped, "records": records},
                                        indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        plot(records, args.plot, f"kvxfer bench transfer, two processes on one host ({machine})")
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer bench transfer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))
