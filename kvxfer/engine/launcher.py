"""``kvxfer launch FILE``: start the instances and the router of a launch file, run its
workload, print a summary, and stop everything it started (on errors and Ctrl-C too).

Children are started with a parent-death signal, so even a launcher killed with SIGKILL
leaves none behind. ``--verify`` also runs every request on a monolithic instance (the decode
instance's config with role ``both``) and compares the tokens one by one.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import zmq

from kvxfer.config import (
    InstanceConfig,
    LaunchConfig,
    ParallelConfig,
    ServerConfig,
    load_instance_config,
    load_launch_config,
    to_yaml,
)
from kvxfer.engine import messages as m
from kvxfer.engine.ranks import die_with_parent
from kvxfer.engine.router import RoutedGenerated
from kvxfer.progress import Progress


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 15) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in lines[-n:])


@dataclass
class Run:
    """Everything one launch started; ``stop`` ends it all."""

    logdir: Path
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, args: list[str], wrap: list[str] | None = None) -> Child:
        """``kvxfer ARGS`` as a child; ``wrap`` runs it through another command (``ip netns exec NS``)."""
        log = self.logdir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([*(wrap or []), sys.executable, "-m", "kvxfer", *args], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def stop(self, grace_s: float = 5.0) -> None:
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(timeout=5)


class LaunchError(RuntimeError):
    pass


def _request(addr: str, msg: m.EngineMessage, timeout_s: float) -> m.EngineMessage | None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(addr)
        s.send_multipart([b"", m.encode(msg)])
        if s.poll(int(timeout_s * 1000)):
            return m.decode(s.recv_multipart()[-1])
        return None
    finally:
        s.close(linger=0)


def _addr(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def wait_ready(run: Run, targets: list[tuple[Child, str]], timeout_s: float) -> None:
    """Ping every target until it answers; name whatever did not come up, and why."""
    deadline = time.monotonic() + timeout_s
    waiting = list(targets)
    while waiting:
        for child, addr in list(waiting):
            if child.proc.poll() is not None:
                raise LaunchError(f"{child.name} exited with status {child.proc.returncode} before it was ready; "
                                  f"its log ({child.log}):\n{child.tail()}")
            if isinstance(_request(addr, m.Ping(), 0.5), m.Pong):
                waiting.remove((child, addr))
        if waiting and time.monotonic() > deadline:
            names = ", ".join(c.name for c, _ in waiting)
            raise LaunchError(f"not ready after {timeout_s:g}s: {names}; last log lines:\n" +
                              "\n".join(f"  {c.name}:\n{c.tail()}" for c, _ in waiting))


def make_workload(launch: LaunchConfig, vocab: int) -> list[m.Generate]:
    w = launch.workload
    rng = np.random.default_rng(w.seed)
    return [m.Generate(request_id=f"req-{i}", prompt=rng.integers(0, vocab, w.prompt_tokens).tolist(),
                       max_tokens=w.output_tokens) for i in range(w.num_requests)]


def run_workload(addr: str, requests: list[m.Generate], timeout_s: float, label: str) -> dict[str, RoutedGenerated]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    results: dict[str, RoutedGenerated] = {}
    t0 = time.monotonic()
    print(f"{label}:", file=sys.stderr)
    progress = Progress(len(requests))
    try:
        for req in requests:
            s.send_multipart([b"", m.encode(req)])
        progress.update(0)
        while len(results) < len(requests):
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0 or not s.poll(int(min(left, 0.5) * 1000)):
                if left <= 0:
                    raise LaunchError(f"{label}: {len(requests) - len(results)} of {len(requests)} requests did not "
                                      f"finish within {timeout_s:g}s")
                progress.update(len(results))
                continue
            frame = s.recv_multipart()[-1]
            try:
                r = msgspec.msgpack.decode(frame, type=RoutedGenerated)
            except msgspec.ValidationError:  # a combined instance answers with a bare Generated
                g = m.decode(frame)
                if not isinstance(g, m.Generated):
                    raise LaunchError(f"{label}: unexpected answer {g!r}") from None
                r = RoutedGenerated(result=g, ttft_s=g.token_times[0] if g.token_times else 0.0, prefill_engine="",
                                    decode_engine="", fallback=False)
            results[r.result.request_id] = r
            progress.update(len(results))
    finally:
        s.close(linger=0)
    return results


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(results: dict[str, RoutedGenerated], wall_s: float) -> tuple[str, int]:
    ok = [r for r in results.values() if not r.result.error]
    failed = [r for r in results.values() if r.result.error]
    ttft = [r.ttft_s * 1e3 for r in ok]
    itl = [float(d) * 1e3 for r in ok for d in np.diff(r.result.token_times)]
    tokens = sum(len(r.result.tokens) for r in ok)
    kv = sum(r.result.kv_bytes for r in ok)
    xfer = [r.result.kv_bytes / r.result.transfer_s / 1e9 for r in ok if r.result.transfer_s > 0]
    loaded = sum(r.result.loaded for r in ok)
    fallback = sum(r.fallback for r in ok)
    rows = [
        ("requests", f"{len(ok)} ok, {len(failed)} failed; {loaded} loaded over the connector, "
                     f"{len(ok) - loaded} computed on decode ({fallback} after a prefill timeout)"),
        ("tokens generated", f"{tokens} in {wall_s:.2f}s ({tokens / wall_s:.1f} tok/s)"),
        ("time to first token",
         f"p50 {_pct(ttft, 50):.1f} ms  p90 {_pct(ttft, 90):.1f} ms  p99 {_pct(ttft, 99):.1f} ms"),
        ("inter-token latency", f"p50 {_pct(itl, 50):.2f} ms  p90 {_pct(itl, 90):.2f} ms  p99 {_pct(itl, 99):.2f} ms"),
        ("KV moved", f"{kv / 2**20:.1f} MiB"),
        ("transfer GB/s", f"median {_pct(xfer, 50):.2f} per request, KV bytes / load time including its wait in "
                          f"the decode loop (p10 {_pct(xfer, 10):.2f}, p90 {_pct(xfer, 90):.2f})"
                          if xfer else "n/a (nothing loaded)"),
    ]
    for r in failed[:5]:
        rows.append(("failed", f"{r.result.request_id}: {r.result.error}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows), len(failed)


def check_blocks(instances: list[InstanceConfig], timeout_s: float = 30.0) -> list[str]:
    """Every instance's blocks back in its pool (holds released, loads done); else what leaked."""
    problems = []
    for cfg in instances:
        deadline = time.monotonic() + timeout_s
        while True:
            st = _request(_addr(cfg.server.host, cfg.server.port), m.StatsQuery(), 5.0)
            if isinstance(st, m.Stats) and st.running == 0 and st.free_blocks == st.num_blocks:
                break
            if time.monotonic() > deadline:
                problems.append(f"{cfg.engine_id}: {st.free_blocks if isinstance(st, m.Stats) else '?'} of "
                                f"{cfg.cache.num_blocks} blocks free after the workload")
                break
            time.sleep(0.1)
    return problems


def verify_config(launch: LaunchConfig, decode: InstanceConfig) -> InstanceConfig:
    """The monolithic reference: the decode instance's model and cache, one rank, role both."""
    return msgspec.structs.replace(decode, role="both", engine_id=f"{decode.engine_id}-verify",
                                   parallel=ParallelConfig(), server=ServerConfig(host=decode.server.host,
                                                                                  port=launch.verify_port))


@contextlib.contextmanager
def started(logdir: Path | None = None) -> Iterator[Run]:
    # no socket of this process may hold up its exit with an unsent message (a ping to a
    # child that never came up, say): Ctrl-C must end the launch at once
    zmq.Context.instance().setsockopt(zmq.LINGER, 0)
    run = Run(Path(logdir or tempfile.mkdtemp(prefix="kvxfer-launch-")))
    run.logdir.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # a shell that starts us in the background hands SIGINT down as ignored; Ctrl-C must still work
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield run
    finally:
        run.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def launch(path: str, verify: bool = False, logdir: str | None = None) -> int:
    """Run a launch file end to end; 0 when every request succeeded (and agreed, with verify)."""
    cfg = load_launch_config(path)
    instances = [load_instance_config(p) for p in cfg.instances]
    decodes = [c for c in instances if c.role in ("decode", "both")]
    if not decodes:
        raise LaunchError(f"{path}: no decode (or combined) instance among {[c.engine_id for c in instances]}")
    vocab = instances[0].model.vocab_size
    status = 0
    with started(Path(logdir) if logdir else None) as run:
        print(f"kvxfer launch {path}: logs in {run.logdir}", file=sys.stderr)
        targets = []
        for c, p in zip(instances, cfg.instances, strict=True):
            child = run.start(c.engine_id, ["serve", p])
            targets.append((child, _addr(c.server.host, c.server.port)))
        router = run.start("router", ["route", path])
        targets.append((router, _addr(cfg.router.host, cfg.router.port)))
        wait_ready(run, targets, cfg.ready_timeout_s)
        requests = make_workload(cfg, vocab)
        t0 = time.monotonic()
        results = run_workload(_addr(cfg.router.host, cfg.router.port), requests, cfg.request_timeout_s,
                               f"workload: {len(requests)} requests x {cfg.workload.prompt_tokens} prompt tokens, "
                               f"{cfg.workload.output_tokens} output tokens")
        table, failures = summarize(results, time.monotonic() - t0)
        print("summary:")
        print(table)
        leaks = check_blocks(instances)
        print("  blocks after the workload  " + ("; ".join(leaks) if leaks else "every instance's pool is whole"))
        status = 1 if failures or leaks else 0
        if verify:
            vcfg = verify_config(cfg, decodes[0])
            vpath = run.logdir / "verify.yaml"
            vpath.write_text(to_yaml(vcfg))
            vchild = run.start(vcfg.engine_id, ["serve", str(vpath)])
            wait_ready(run, [(vchild, _addr(vcfg.server.host, vcfg.server.port))], cfg.ready_timeout_s)
            ref = run_workload(_addr(vcfg.server.host, vcfg.server.port), requests, cfg.request_timeout_s,
                               "verify: the same requests on one monolithic instance")
            bad = [rid for rid in results if results[rid].result.tokens != ref[rid].result.tokens
                   or results[rid].result.error or ref[rid].result.error]
            if bad:
                status = 1
                print(f"verify: {len(bad)} of {len(requests)} requests DISAGREE with the monolithic instance:")
                for rid in bad[:5]:
                    print(f"  {rid}: disaggregated {results[rid].result.tokens} vs monolithic {ref[rid].result.tokens}")
            else:
                print(f"verify: {len(requests)} of {len(requests)} requests agree token for token with a "
                      f"monolithic instance")
    return status
