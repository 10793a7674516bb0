"""Transfer speed: a kvxfer connector beside a raw socket moving the same pieces, same run.

Two processes: a producer (prefill rank) and this process (decode rank). The cache is the
Llama-3-8B-like one (32 layers, K and V, 8 kv heads, head size 128, bf16, block 16); the
request sizes are 4096 tokens (256 blocks, 512 MiB) and 1 block (2 MiB). Block ids are
contiguous, or random on both sides (16384 scattered 32 KiB pieces at 4096 tokens).

Baselines, between the same two processes in the same run:
- tcp: the producer ``sendmsg``s the same pieces (the connector's own coalesced descriptor
  list) from its cache over one Unix socket and this process ``recvmsg_into``s them into the
  same destination blocks; no protocol, no validation, no threads;
- ucx: raw ucxx on the same worker-address endpoints: the same bytes as one tag message
  (the contiguous goal), and the same pieces as one message each, 64 in flight (the
  fragmented goal: batching should beat it by 2x or more).
``ratio`` = connector GB/s / baseline GB/s (for ucx: against one message when contiguous,
against the unbatched pieces when random).

    python benchmarks/transfer.py [--connector tcp] [--trials 10] [--streams 1 2 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import msgspec
import numpy as np
import torch

from kvxfer.cache import allocate_kv_cache, spec_from_config
from kvxfer.config import CacheConfig, ConnectorConfig, InstanceConfig, ModelConfig, SideChannelConfig
from kvxfer.connector import Connector, Descriptors
from kvxfer.protocol import KVTransferParams

NUM_BLOCKS = 640


def make_cfg(role: str, engine: str, connector: str, streams: int) -> InstanceConfig:
    return InstanceConfig(
        role=role, engine_id=engine,
        model=ModelConfig(name="llama3-8b-like", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                          head_size=128, intermediate_size=14336, vocab_size=128256),
        cache=CacheConfig(block_size=16, num_blocks=NUM_BLOCKS, dtype="bfloat16"),
        connector=ConnectorConfig(name=connector, side_channel=SideChannelConfig(port=0),
                                  data_plane={"streams": streams} if connector == "tcp" else {}),
    )


def pattern(cache: Any) -> None:
    """Block b of region r holds int32 words (r << 16 | b): cheap to check on arrival."""
    for r, t in enumerate(cache.tensors):
        words = t.view(t.shape[0], -1).view(torch.int32)
        words.copy_((torch.arange(t.shape[0], dtype=torch.int32)[:, None] + (r << 16)).expand_as(words))


# ------------------------------------------------------------------ producer process

def producer(cfg_json: bytes, conn: Any) -> None:
    cfg = msgspec.json.decode(cfg_json, type=InstanceConfig)
    cache = allocate_kv_cache(spec_from_config(cfg), NUM_BLOCKS)
    pattern(cache)
    c = Connector.from_config(cfg)
    c.register_kv_caches(cache)
    views = {r.region_id: memoryview(t.view(-1).view(torch.uint8).numpy()) for r, t in
             zip(cache.regions, cache.tensors, strict=True)}
    path = os.path.join(tempfile.gettempdir(), f"kvxfer-bench-{os.getpid()}.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    conn.send(path)
    n = 0
    raw: socket.socket | None = None
    pieces: list[memoryview] = []
    while True:
        cmd = conn.recv()
        if cmd[0] == "hold":
            n += 1
            conn.send(c.hold(f"r{n}", cmd[1], cmd[2]).to_bytes())
        elif cmd[0] == "pieces":  # the baseline's piece list, then one "go" byte per trial
            regions, offsets, lengths = (np.frombuffer(b, dtype=np.int64) for b in cmd[1:])
            pieces = [views[r][o : o + k] for r, o, k in zip(regions.tolist(), offsets.tolist(), lengths.tolist(),
                                                              strict=True)]
            if raw is None:
                raw, _ = srv.accept()
            conn.send("ready")
            while raw.recv(1) == b"g":
                _send_all(raw, pieces)
        elif cmd[0] == "ucx_connect":
            raw_ucx = _UcxRaw(c.plane, cmd[1])
            conn.send("ok")
        elif cmd[0] == "ucx_one":
            raw_ucx.send_one(cmd[1])
            conn.send("ok")
        elif cmd[0] == "ucx_pieces":
            regions, offsets, lengths = (np.frombuffer(b, dtype=np.int64) for b in cmd[1:])
            raw_ucx.send_pieces([views[r][o : o + k] for r, o, k in zip(regions.tolist(), offsets.tolist(),
                                                                         lengths.tolist(), strict=True)])
            conn.send("ok")
        elif cmd[0] == "poll":
            c.poll()
            conn.send("ok")
        elif cmd[0] == "stop":
            break
    c.close()
    srv.close()
    os.unlink(path)


RAW_TAG = 0x7A11_0000_0000_0001
INFLIGHT = 64


class _UcxRaw:
    """Raw ucxx on the plane's own worker and loop: the baselines for the ucx connector."""

    def __init__(self, plane: Any, peer_worker: bytes | None) -> None:
        self.rt = plane.rt
        ucxx = self.rt.ucxx
        self.tag = ucxx.types.Tag(RAW_TAG)
        if peer_worker is None:  # the receiving side: worker-level receives need no endpoint
            return
        self.big = np.ones(512 << 20, dtype=np.uint8)

        async def connect() -> Any:
            return await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(peer_worker),
                                                                 endpoint_error_handling=False)

        self.ep = self.rt.submit(connect()).result(30)

    def send_one(self, nbytes: int) -> None:
        self.rt.submit(self.ep.send(self.big[:nbytes], tag=self.tag, force_tag=True)).result(60)

    def send_pieces(self, views: list[memoryview]) -> None:
        import asyncio

        async def go() -> None:
            for i in range(0, len(views), INFLIGHT):
                await asyncio.gather(*(self.ep.send(np.frombuffer(v, np.uint8), tag=self.tag, force_tag=True)
                                       for v in views[i : i + INFLIGHT]))

        self.rt.submit(go()).result(120)

    def recv_one(self, buf: np.ndarray) -> Any:
        return self.rt.submit(self.rt.ucxx.recv(buf, tag=self.tag))

    def recv_pieces(self, views: list[np.ndarray]) -> Any:
        import asyncio

        async def go() -> None:
            for i in range(0, len(views), INFLIGHT):
                await asyncio.gather(*(self.rt.ucxx.recv(v, tag=self.tag) for v in views[i : i + INFLIGHT]))

        return self.rt.submit(go())


def _send_all(sock: socket.socket, views: list[memoryview]) -> None:
    from kvxfer.connectors.tcp import send_pieces

    send_pieces(sock, views)


# ------------------------------------------------------------------ this process

def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvxfer.connectors.tcp import recv_pieces

    ctx = mp.get_context("spawn")
    records: list[dict[str, Any]] = []
    for streams in args.streams:
        pcfg, dcfg = make_cfg("prefill", "P", args.connector, streams), make_cfg("decode", "D", args.connector,
                                                                                 streams)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=producer, args=(msgspec.json.encode(pcfg), child), daemon=True)
        proc.start()
        raw_path = parent.recv()
        cache = allocate_kv_cache(spec_from_config(dcfg), NUM_BLOCKS)
        d = Connector.from_config(dcfg)
        d.register_kv_caches(cache)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(raw_path)
        dviews = {r.region_id: memoryview(t.view(-1).view(torch.uint8).numpy()) for r, t in
                  zip(cache.regions, cache.tensors, strict=True)}
        rng = np.random.default_rng(0)
        for pat in ("contiguous", "random"):
            for nblocks in args.blocks:
                ntok = nblocks * 16
                if pat == "contiguous":
                    src, dst = np.arange(8, 8 + nblocks), np.arange(300, 300 + nblocks)
                else:
                    src, dst = rng.permutation(NUM_BLOCKS)[:nblocks], rng.permutation(NUM_BLOCKS)[:nblocks]
                trials = args.trials if nblocks > 16 else args.trials * 20
                times = []
                for i in range(trials + 1):
                    parent.send(("hold", src.tolist(), ntok))
                    params = KVTransferParams.from_bytes(parent.recv())
                    t0 = time.perf_counter()
                    d.start_load(params.request_id, params, dst.tolist())
                    while not (f := d.poll(timeout_s=1.0)):
                        pass
                    dt = time.perf_counter() - t0
                    if f.failed:
                        raise RuntimeError(f"load failed: {f.errors}")
                    if i:  # the first includes the handshake
                        times.append(dt)
                print(f"  {args.connector} streams={streams} {pat} {nblocks} blocks: done", file=sys.stderr)
                _verify(cache, src, dst)
                descs = _plan(d, params, dst)
                parent.send(("pieces", descs.remote_region.tobytes(), descs.remote_offset.tobytes(),
                             descs.length.tobytes()))
                assert parent.recv() == "ready"
                lviews = [dviews[r][o : o + k] for r, o, k in zip(descs.local_region.tolist(),
                                                                   descs.local_offset.tolist(),
                                                                   descs.length.tolist(), strict=True)]
                btimes = []
                for _ in range(trials):
                    t0 = time.perf_counter()
                    raw.sendall(b"g")
                    recv_pieces(raw, lviews, time.monotonic() + 60)
                    btimes.append(time.perf_counter() - t0)
                raw.sendall(b"s")  # leave the producer's baseline loop
                nbytes = descs.nbytes
                rec = _record(args.connector, streams, pat, nblocks, nbytes, len(descs), times, btimes)
                if args.connector == "ucx":
                    _ucx_baselines(rec, d, parent, descs, lviews, trials, pat)
                records.append(rec)
                _print_row(rec)
        parent.send(("stop",))
        proc.join(timeout=30)
        d.close()
        raw.close()
    return records


def _ucx_baselines(rec: dict[str, Any], d: Connector, parent: Any, descs: Descriptors, lviews: list[memoryview],
                   trials: int, pat: str) -> None:
    """Raw ucxx between the same processes: one message of the same bytes; the pieces unbatched."""
    global _ucx_raw
    if _ucx_raw is None:
        _ucx_raw = _UcxRaw(d.plane, None)
        parent.send(("ucx_connect", d.plane.rt.address))
        assert parent.recv() == "ok"
    raw = _ucx_raw
    nbytes = descs.nbytes
    one, pieces = [], []
    dst = np.empty(nbytes, dtype=np.uint8)
    for _ in range(trials):
        t0 = time.perf_counter()
        fut = raw.recv_one(dst)
        parent.send(("ucx_one", nbytes))
        fut.result(60)
        one.append(time.perf_counter() - t0)
        parent.recv()
    views = [np.frombuffer(v, np.uint8) for v in lviews]
    for _ in range(max(2, trials // 4)):
        t0 = time.perf_counter()
        fut = raw.recv_pieces(views)
        parent.send(("ucx_pieces", descs.remote_region.tobytes(), descs.remote_offset.tobytes(),
                     descs.length.tobytes()))
        fut.result(120)
        pieces.append(time.perf_counter() - t0)
        parent.recv()
    one_gbps = nbytes / statistics.median(one) / 1e9
    pieces_gbps = nbytes / statistics.median(pieces) / 1e9
    rec["raw_ucxx_one_message_gbps"] = one_gbps
    rec["raw_ucxx_pieces_gbps"] = pieces_gbps
    if pat == "contiguous":
        rec.update(baseline="raw ucxx, one message", baseline_gbps=one_gbps, ratio=rec["gbps"] / one_gbps)
    else:
        rec.update(baseline="raw ucxx, same pieces unbatched", baseline_gbps=pieces_gbps,
                   ratio=rec["gbps"] / pieces_gbps)
    rec["baseline_p50_us"] = nbytes / rec["baseline_gbps"] / 1e3


_ucx_raw: _UcxRaw | None = None


def _plan(d: Connector, params: KVTransferParams, dst: np.ndarray) -> Descriptors:
    """The connector's own descriptor list for this request (what the baseline must move)."""
    from kvxfer.topology import remote_sources
    from kvxfer.transfer.planner import plan_direct

    consumer = d.consumer
    assert consumer is not None
    peer = next(iter(consumer._peers.values()))
    (sl,) = remote_sources(consumer.layout, 0, 0, params.layout)
    return plan_direct(peer.side, consumer.local_side, sl, np.asarray(params.block_ids), dst, 0, params.num_tokens)


def _verify(cache: Any, src: np.ndarray, dst: np.ndarray) -> None:
    for r, t in enumerate(cache.tensors):
        words = t.view(t.shape[0], -1).view(torch.int32)[torch.as_tensor(dst)]
        want = torch.as_tensor(src, dtype=torch.int32)[:, None] + (r << 16)
        if not torch.equal(words, want.expand_as(words)):
            raise RuntimeError(f"region {r}: the bytes that arrived are not the bytes that left")


def _record(connector: str, streams: int, pat: str, nblocks: int, nbytes: int, ndesc: int, times: list[float],
            btimes: list[float]) -> dict[str, Any]:
    med, bmed = statistics.median(times), statistics.median(btimes)
    p99 = float(np.percentile(times, 99))
    return {"connector": connector, "streams": streams, "pattern": pat, "blocks": nblocks, "bytes": nbytes,
            "descriptors": ndesc, "gbps": nbytes / med / 1e9, "p50_us": med * 1e6, "p99_us": p99 * 1e6,
            "baseline": "raw unix socket, same pieces", "baseline_gbps": nbytes / bmed / 1e9,
            "baseline_p50_us": bmed * 1e6, "ratio": bmed / med, "trials": len(times)}


HEADER = (f"{'connector':>10} {'streams':>7} {'pattern':>10} {'blocks':>6} {'MiB':>6} {'pieces':>6} {'GB/s':>6} "
          f"{'p50 us':>9} {'p99 us':>9} {'raw GB/s':>8} {'raw p50':>9} {'ratio':>6}")


def _print_row(r: dict[str, Any]) -> None:
    print(f"{r['connector']:>10} {r['streams']:>7} {r['pattern']:>10} {r['blocks']:>6} {r['bytes'] / 2**20:6.0f} "
          f"{r['descriptors']:>6} {r['gbps']:6.2f} {r['p50_us']:9.0f} {r['p99_us']:9.0f} {r['baseline_gbps']:8.2f} "
          f"{r['baseline_p50_us']:9.0f} {r['ratio']:6.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", default="tcp")
    ap.add_argument("--trials", type=int, default=10, help="trials at 512 MiB (x20 for small requests)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[256, 1])
    ap.add_argument("--streams", type=int, nargs="+", default=[2])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(f"Llama-3-8B-like cache, bf16, block 16; {platform.machine()}, {os.cpu_count()} cpus")
    print(HEADER)
    print("-" * len(HEADER))
    records = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.machine(), "records": records}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
