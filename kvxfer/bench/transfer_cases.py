"""The parts of ``kvxfer bench transfer`` that are not its consumer's driver: the bench cache
and the pattern its bytes are checked by, the raw ucxx baseline's transport, the producer
process, and how trials are timed and summed up. The peers' process pairs (``peers``) use the
same cache, checks and timing, so a peer's numbers compare with kvxfer's.
"""

from __future__ import annotations

import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from kvxfer.cache import KVCache, allocate_kv_cache, spec_from_config
from kvxfer.config import CacheConfig, ConnectorConfig, InstanceConfig, ModelConfig, Role, SideChannelConfig
from kvxfer.connector import Connector, load_data_plane
from kvxfer.protocol import KVTransferParams
from kvxfer.transfer.aggregator import Finished

TOKENS = [16, 64, 256, 1024, 4096, 8192]
BLOCK = 16
RAW_TAG = 0x7A11_0000_0000_0001
INFLIGHT = 64
NICE = -10  # the *-nice rows' connector.agent_nice


class Conn(Protocol):
    """What the bench calls on a connector (what ``Connector.from_config`` returns): the engine's API."""

    def register_kv_caches(self, cache: KVCache) -> None: ...
    def hold(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVTransferParams: ...
    def release(self, request_id: str) -> bool: ...
    def start_load(self, request_id: str, params: KVTransferParams, local_block_ids: list[int]) -> None: ...
    def poll(self, timeout_s: float = 0.0) -> Finished: ...
    def stats(self) -> dict[str, float]: ...
    def close(self) -> None: ...


# connector rows that are a plane with options, not its defaults: name -> (plane, connector.data_plane)
# a bench row that runs a data plane with options: name -> (plane, data_plane options, connector options)
VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "ucx-2s": ("ucx", {"reads": "two-sided"}, {}),  # two-sided: every producer over UCX (same_host: ucx)
    "ucx-native": ("ucx", {"rma_progress": "native", "same_host": "ucx"}, {}),
    # UCX's own wire on this host too (same_host: ucx); the ucx row reads this host's producers with CMA
    "ucx-nocma": ("ucx", {"same_host": "ucx"}, {}),
    # the tcp plane's Unix sockets served with sendmsg (two copies) instead of spliced pages (one)
    "tcp-copy": ("tcp", {"unix_send": "copy"}, {}),
    # every load through the transfer agent: what the engine's own small copies (engine_copy_bytes) change
    "cma-agent": ("cma", {}, {"engine_copy_bytes": 0}),
    # the engine's copies of 4 MiB and more let the GIL go (engine_copy_release_gil_bytes)
    "cma-released": ("cma", {}, {"engine_copy_release_gil_bytes": 4 << 20}),
    # the interpreter's own switch interval kept while loads are in flight (gil_switch_interval_s: 0):
    # what the short one buys when the engine's Python is busy (--busy-engine)
    **{f"{p}-noswitch": (p, {}, {"gil_switch_interval_s": 0.0}) for p in ("tcp", "ucx", "cma")},
    # a switch interval of 0.1 ms while loads are in flight (the default is 0.5)
    **{f"{p}-switch100us": (p, {}, {"gil_switch_interval_s": 0.0001}) for p in ("tcp", "ucx", "cma")},
    # a poll(timeout_s) waits with the in-flight interval, not the wait's 50 us (gil_wait_switch_interval_s: 0)
    **{f"{p}-nowaitswitch": (p, {}, {"gil_wait_switch_interval_s": 0.0}) for p in ("tcp", "ucx", "cma")},
    # the transfer agents at nice -10 (connector.agent_nice): they preempt a spinning engine for a core
    **{f"{p}-nice": (p, {}, {"agent_nice": NICE}) for p in ("tcp", "ucx", "cma")},
    "ucx-nocma-nice": ("ucx", {"same_host": "ucx"}, {"agent_nice": NICE}),
}


def plane_of(connector: str) -> str:
    """The data plane a bench connector row runs: "ucx-2s" -> "ucx"."""
    return VARIANTS.get(connector, (connector, {}, {}))[0]


def make_cfg(role: Role, connector: str, num_blocks: int, data_path: str | None = None) -> InstanceConfig:
    """``data_path``: where the connector's data path runs (``connector.data_path``; None: its default).
    ``connector``: a data plane, or a variant of one (VARIANTS)."""
    extra: dict[str, Any] = {} if data_path is None else {"data_path": data_path}
    plane, options, connector_options = VARIANTS.get(connector, (connector, {}, {}))
    if options:
        extra["data_plane"] = dict(options)
    extra.update(connector_options)
    return InstanceConfig(
        role=role, engine_id=f"bench-{role}-{connector}",
        model=ModelConfig(name="llama3-8b-like", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                          head_size=128, intermediate_size=14336, vocab_size=128256),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, dtype="bfloat16"),
        connector=ConnectorConfig(name=plane, side_channel=SideChannelConfig(port=0), **extra),
    )


CPU_SPINNER_START_S = 30.0  # the cpu row's spinning process says it spins within this


def start_cpu_spinner() -> subprocess.Popen[bytes]:
    """A process spinning in pure Python (the ``cpu`` row), returned once it spins: the trials
    of a round (``--rounds``) must not start while its interpreter is still starting."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys\nsys.stdout.write('s')\nsys.stdout.flush()\n"
                             "while True: pass"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], CPU_SPINNER_START_S)
    if not ready or proc.stdout.read(1) != b"s":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the cpu row's spinning process did not start in {CPU_SPINNER_START_S:g}s")
    return proc


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


def region_views(cache: KVCache) -> dict[int, memoryview]:
    return {r.region_id: t.view(-1).view(torch.uint8).numpy().data
            for r, t in zip(cache.regions, cache.tensors, strict=True)}


def piece_views(views: dict[int, memoryview], regions: np.ndarray, offsets: np.ndarray,
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

    def close(self) -> None:
        """Close the endpoint now, while the peer still runs (closed after it exited, the flush fails
        and UCX logs an error)."""
        from kvxfer.connectors.ucx.runtime import close_now

        async def go() -> None:
            close_now(self.ep)

        self.rt.submit(go()).result(10)


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
    views = region_views(cache)
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
    from kvxfer.connectors.tcp import send_pieces, widen_unix_buffer
    from kvxfer.connectors.tcp.splice import Splicer

    splicer: Splicer | None = None

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
            elif op == "release":  # holds made ahead that no trial used
                for rid in cmd[2]:
                    conns[cmd[1]].release(rid)
                conn.send("ok")
            elif op == "spin":  # the producer's engine thread busy in Python (a thread standing in for it)
                spinner.set(cmd[1])
                conn.send("ok")
            elif op == "poll":
                for c in conns.values():
                    c.poll()
                conn.send("ok")
            elif op == "raw":  # the pieces, then one "go" byte per trial over the raw socket
                regions, offsets, lengths = (np.frombuffer(b, dtype=np.int64) for b in cmd[1:4])
                spliced = cmd[4]  # the pages spliced in, as the tcp plane serves a Unix socket; else sendmsg
                pieces = [] if spliced else piece_views(views, regions, offsets, lengths)
                ids = np.array(sorted(views), np.int64)
                bases = np.array([np.frombuffer(views[r], np.uint8).ctypes.data for r in ids.tolist()], np.int64)
                addresses = bases[np.searchsorted(ids, regions)] + offsets
                if raw is None:
                    raw, _ = srv.accept()
                    widen_unix_buffer(raw)  # as the tcp plane's connections: the baseline is not handicapped
                if spliced and splicer is None:
                    splicer = Splicer()
                conn.send("ready")
                while raw.recv(1) == b"g":
                    if splicer is not None and spliced:
                        splicer.send(raw, addresses, lengths)
                    else:
                        send_pieces(raw, pieces)
            elif op == "ucx_connect":
                ucx_plane, bare = ucx_runtime_plane(conns[cmd[3]])
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
                ucx_raw.send_pieces(piece_views(views, *(np.frombuffer(b, dtype=np.int64) for b in cmd[1:])))
                conn.send("ok")
            elif op == "stop":
                break
    finally:
        spinner.set(False)
        if splicer is not None:
            splicer.close()
        if ucx_raw is not None:
            ucx_raw.close()
        for c in conns.values():
            c.close()
        for p in bare_planes:
            p.close()
        srv.close()
        os.unlink(path)


# ------------------------------------------------------------------ timing

def timed(fn: Callable[[], object], budget_s: float, min_trials: int = 3,
          max_trials: int = 200, on_warm: Callable[[], object] | None = None, gap_s: float = 0.0) -> list[float]:
    """Run ``fn`` once to warm up (then ``on_warm``), then until the budget is spent (at least
    ``min_trials``). A trial lasts as long as ``fn`` ran, or, when it returns a float, that many
    seconds (the part it times itself). ``gap_s``: this long idle before each trial (not counted
    in the budget): requests that arrive spaced, as serving's do, not back to back."""
    fn()
    if on_warm is not None:
        on_warm()
    times: list[float] = []
    start, slept = time.monotonic(), 0.0
    while len(times) < max_trials and (len(times) < min_trials or time.monotonic() - start - slept < budget_s):
        if gap_s > 0:
            time.sleep(gap_s)
            slept += gap_s
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
    (``stage_<stage>_s``), between two snapshots, the handoff per handoff (``handoffs`` of them);
    None when no load finished in between (or the connector counts no stages)."""
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
            if k == "handoff":
                out["handoffs"] = over
    return out
