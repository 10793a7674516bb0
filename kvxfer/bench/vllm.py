"""``kvxfer bench vllm``: a real vLLM prefill/decode pair, with vLLM's own NixlConnector and
with KvxferConnector (tcp, ucx and cma), given the same prompts in one run.

Per connector: two vLLM servers on this machine (one core each), a warm-up, then requests one
at a time: the prompt on the prefill server (``max_tokens=1``), then the decode server streams
the output. Reported per connector:

- time to first token, at the client: prefill request plus the decode server's first token;
- KV transfer time per request on the decode side: NIXL's ``vllm:nixl_xfer_time_seconds``
  (post to completion of its reads) and kvxfer's ``kvxfer_transfer_seconds`` (start of the
  load to its end, planning included); the mean over the measured requests;
- the ratio of each to NIXL's, measured in the same run, on the same transports. NixlConnector
  runs as vLLM documents it for CPU (``nixl``: ``UCX_TLS=sm,self,tcp``; ``sm`` names every shared
  memory transport, CMA among them, so on one host its reads are CMA copies: 16 MiB at CMA's
  speed, as ``nixl-cma``, which names CMA explicitly), without CMA (``nixl-nocma``: the
  transports kvxfer's ucx plane lets UCX use, ``kvxfer.connectors.ucx.DEFAULT_TLS``) and over
  TCP only (``nixl-tcp``: kernel sockets, the wire of kvxfer's tcp plane). Each kvxfer row is
  compared with its own (column ``vs``): cma with ``nixl-cma``, tcp (and ``kvxfer-tcp-copy``, its
  Unix sockets served with sendmsg, not spliced pages) with ``nixl-tcp``, ucx (its
  default reads this host's producer with CMA) with ``nixl``, the ucx rows on UCX's own wire
  (``kvxfer-ucx-nocma``, ``-2s``, ``-native``, ``-adaptive``) with ``nixl-nocma``; with ``nixl``
  when its own did not run. Column ``xfer/dflt`` sets every row
  against ``nixl`` as well: NixlConnector as a user starts it, whatever its wire.
- the CPU each pair spends: cores used by both servers' processes (vLLM's and kvxfer's agents)
  for a few seconds with no request (``idle CPU``), and over the measured requests (``load
  CPU``). A connector can buy transfer time with CPU: NixlConnector's UCX progress thread polls
  without sleeping in each vLLM worker, idle or not.

With ``--busy-decode N`` each connector's measured requests run twice on the same servers: first
with the decode server otherwise idle, then while N other requests keep it decoding (each a short
prompt of its own, decoded for ``--busy-output`` tokens and sent again when it ends). The table
then gives the busy transfer time, busy/idle, and the busy ratio to NIXL's busy figure.

NIXL needs ``pip install nixl-cu12==1.5.1`` and ``pip install --no-deps nixl==1.5.1``; without
it the table says so and kvxfer's rows stand alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvxfer.config import ConnectorConfig
from kvxfer.connectors.ucx import DEFAULT_TLS as UCX_DEFAULT_TLS  # the string only: no ucxx import
from kvxfer.engine.launcher import _pct
from kvxfer.integrations.vllm_pd import (
    MAX_NUM_SEQS,
    VllmServer,
    completion_body,
    free_port,
    metric_totals,
    post,
    prefill,
)
from kvxfer.progress import Progress

from .session_cpu import CpuWindow

CONNECTORS = ("nixl", "nixl-cma", "nixl-nocma", "nixl-tcp", "kvxfer-tcp", "kvxfer-tcp-copy", "kvxfer-ucx",
              "kvxfer-ucx-nocma", "kvxfer-ucx-2s", "kvxfer-ucx-native", "kvxfer-ucx-adaptive", "kvxfer-cma")
DEFAULT_CONNECTORS = ("nixl", "nixl-cma", "nixl-nocma", "nixl-tcp", "kvxfer-tcp", "kvxfer-ucx", "kvxfer-cma")
# kvxfer rows that are not just a plane: the tcp plane serving this host's Unix sockets with sendmsg (by default
# it splices the producer's pages in); the ucx plane on UCX's own wire on this host too (its default reads
# this host's producer with CMA, same_host: cma), two-sided, and with its RMA workers progressed either way
KVXFER_PLANES = {"kvxfer-tcp-copy": ("tcp", {"unix_send": "copy"}),
                 "kvxfer-ucx-nocma": ("ucx", {"same_host": "ucx"}),
                 "kvxfer-ucx-2s": ("ucx", {"reads": "two-sided"}),
                 "kvxfer-ucx-native": ("ucx", {"rma_progress": "native", "same_host": "ucx"}),
                 "kvxfer-ucx-adaptive": ("ucx", {"rma_progress": "adaptive", "same_host": "ucx"})}
# UCX_TLS of each NixlConnector variant (``sm`` includes CMA: ``nixl`` reads with CMA on one host)
NIXL_TLS = {"nixl": "sm,self,tcp", "nixl-cma": "sm,self,cma,tcp", "nixl-nocma": UCX_DEFAULT_TLS, "nixl-tcp": "tcp"}
# the NIXL row a kvxfer row meets (else nixl)
SAME_WIRE = {"kvxfer-cma": "nixl-cma",
             **{c: "nixl-nocma" for c in KVXFER_PLANES},
             "kvxfer-tcp": "nixl-tcp", "kvxfer-tcp-copy": "nixl-tcp",
             "kvxfer-ucx": "nixl"}  # this host's producer read with CMA, as vLLM's documented NIXL reads it


def baseline_of(connector: str, ran: set[str]) -> str | None:
    """The NIXL row ``connector`` is compared with: its same-wire variant, else ``nixl``, if it ran."""
    for name in (SAME_WIRE.get(connector, "nixl"), "nixl"):
        if name in ran:
            return name
    return None
REQUEST_TIMEOUT_S = 300.0
BUSY_PROMPT_TOKENS = 32  # a background request's prompt: short, so it is decoding nearly all its life
BUSY_SETTLE_S = 1.0
# seconds after the warm-up with no request anywhere: the pair's idle CPU (column 'idle CPU')
IDLE_CPU_S = 3.0
IDLE_SETTLE_S = 2.0


def _stream_first_token(url: str, body: dict[str, Any]) -> tuple[float, float]:
    """(seconds to the first streamed token, seconds to the end) of one decode request."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        for line in r:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the decode server streamed no token")
    return first, time.perf_counter() - t0


class BusyDecode:
    """``n`` threads that keep a vLLM server decoding: each sends a short prompt of its own
    (served locally, no KV transfer) for ``output`` tokens, and again when it ends, until the
    ``with`` block ends. ``done`` and ``errors`` are written by those threads under ``_lock`` and
    read by the caller after the block."""

    def __init__(self, url: str, n: int, output: int, seed: int) -> None:
        self.url, self.output = url, output
        self._stop = threading.Event()
        self.done = 0  # background requests completed (a sanity check that the server was busy)
        self.errors: list[str] = []
        self._lock = threading.Lock()
        rng = random.Random(seed)
        self._threads = [threading.Thread(target=self._loop, args=(rng.randrange(1 << 30),), daemon=True,
                                          name=f"busy-decode-{i}") for i in range(n)]

    def __enter__(self) -> BusyDecode:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        deadline = time.monotonic() + REQUEST_TIMEOUT_S  # one limit for all: each ends its current request
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _loop(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            prompt = [rng.randrange(3, 1000) for _ in range(BUSY_PROMPT_TOKENS)]
            try:
                post(self.url + "/v1/completions", completion_body(prompt, self.output), timeout_s=REQUEST_TIMEOUT_S)
                with self._lock:
                    self.done += 1
            except Exception as e:  # reported in the row; the measurement goes on
                with self._lock:
                    self.errors.append(f"{type(e).__name__}: {e}")
                self._stop.wait(1.0)


def _phase(p: VllmServer, d: VllmServer, prompts: list[list[int]], output: int, metrics_url: str, hist: str,
           failed_key: str, bar: Progress, done: int) -> dict[str, Any]:
    """The measured requests of one phase, one at a time; TTFT and the transfer histogram's mean."""
    before = metric_totals(metrics_url)
    ttft, e2e = [], []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        params = prefill(p.url, prompt)
        t_prefill = time.perf_counter() - t0
        first, total = _stream_first_token(d.url, completion_body(prompt, output, params))
        ttft.append((t_prefill + first) * 1e3)
        e2e.append((t_prefill + total) * 1e3)
        bar.update(done + i + 1)
    after = metric_totals(metrics_url)
    n = after.get(f"{hist}_count", 0) - before.get(f"{hist}_count", 0)
    xfer_ms = (after.get(f"{hist}_sum", 0) - before.get(f"{hist}_sum", 0)) / n * 1e3 if n else float("nan")
    return {"requests": len(ttft), "transfers_measured": n,
            "failed_transfers": after.get(failed_key, 0) - before.get(failed_key, 0),
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p90_ms": _pct(ttft, 90), "e2e_p50_ms": _pct(e2e, 50),
            "transfer_mean_ms": xfer_ms, "stages_us": _stages(before, after)}


def _stages(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """kvxfer's mean microseconds per load in each stage over the phase (its metrics' stage sums:
    queue, plan, transfer, complete; handoff, to the engine's poll); None for NIXL."""
    def delta(key: str) -> float:
        return after.get(f"kvxfer_{key}_total", 0.0) - before.get(f"kvxfer_{key}_total", 0.0)

    loads, handoffs = delta("stage_loads"), delta("stage_handoffs")
    if not loads:
        return None
    out = {s: delta(f"stage_{s}_s") / loads * 1e6 for s in ("queue", "plan", "transfer", "complete")}
    out["handoff"] = delta("stage_handoff_s") / handoffs * 1e6 if handoffs else float("nan")
    return out


def bound_cpus(bind: str) -> set[int] | None:
    """The CPUs a ``VLLM_CPU_OMP_THREADS_BIND`` value names (``0``, ``0-3``, ``0,2``); None for
    ``none``/``auto`` or anything else this does not read."""
    cpus: set[int] = set()
    for part in bind.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            return None
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus or None


def default_agent_cpus(binds: list[str]) -> str:
    """``connector.agent_cpus`` for this layout, as docs/vllm.md advises: ``engine`` when every
    server is bound to cores no other server has (an agent anywhere else lands on the other
    server's core and waits behind its busy loop, in that server's session; on its worker's core
    it competes inside its own, as NIXL's progress thread does); else the connector's default
    (``any``: unbound servers, or more workers than cores)."""
    sets = [s for s in (bound_cpus(b) for b in binds) if s is not None]
    if len(sets) == len(binds) and len(set().union(*sets)) == sum(len(s) for s in sets):
        return "engine"
    return ConnectorConfig().agent_cpus


def run_pair(connector: str, model: Path, prompts: list[list[int]], warmup: int, output: int, dtype: str,
             logdir: Path, cpus: tuple[str | None, str | None] = ("0", "1"), busy_decode: int = 0,
             busy_prompts: list[list[int]] | None = None, busy_output: int = 128,
             agent_cpus: str | None = None, agent_nice: int = 0) -> dict[str, Any]:
    """One connector's row: its servers, the warm-up, the idle phase and (``busy_decode`` > 0) the
    busy phase over ``busy_prompts``."""
    kind = "nixl" if connector in NIXL_TLS else "kvxfer"
    extra = None
    mport = free_port()
    env = {"UCX_TLS": NIXL_TLS[connector]} if kind == "nixl" else None
    if kind == "kvxfer":
        name, plane = KVXFER_PLANES.get(connector, (connector.split("-", 1)[1], {}))
        extra = {"connector": {"name": name, **({"data_plane": plane} if plane else {}),
                               **({"agent_cpus": agent_cpus} if agent_cpus else {}),
                               **({"agent_nice": agent_nice} if agent_nice else {})}, "metrics_port": mport}
    busy_prompts = busy_prompts or []
    length = max(1024, max(len(q) for q in prompts + busy_prompts) + output + 1,
                 BUSY_PROMPT_TOKENS + busy_output + 1)
    p = VllmServer(model, free_port(), "prefill", kind, extra and {**extra, "metrics_port": free_port()}, dtype,
                   cpu=cpus[0], log=logdir / f"{connector}-prefill.log", max_model_len=length, env=env)
    d = VllmServer(model, free_port(), "decode", kind, extra, dtype, cpu=cpus[1],
                   log=logdir / f"{connector}-decode.log", max_model_len=length, env=env)
    metrics_url = f"http://127.0.0.1:{mport}/metrics" if kind == "kvxfer" else d.url + "/metrics"
    hist = "kvxfer_transfer_seconds" if kind == "kvxfer" else "vllm:nixl_xfer_time_seconds"
    failed_key = "kvxfer_loads_failed_total" if kind == "kvxfer" else "vllm:nixl_num_failed_transfers_total"
    try:
        p.wait_ready()
        d.wait_ready()
        measured = len(prompts) - warmup + (len(busy_prompts) if busy_decode else 0)
        print(f"{connector}: servers ready; {warmup} warm-up and {measured} measured requests"
              + (f" ({len(busy_prompts)} while {busy_decode} others decode)" if busy_decode else ""), file=sys.stderr)
        bar = Progress(len(prompts) + (len(busy_prompts) if busy_decode else 0), "requests")
        _phase(p, d, prompts[:warmup], output, metrics_url, hist, failed_key, bar, 0)
        sessions = (p.proc.pid, d.proc.pid)
        time.sleep(IDLE_SETTLE_S)  # the warm-up's tail: its blocks released on both sides
        idle = CpuWindow(sessions).start()
        time.sleep(IDLE_CPU_S)  # no request anywhere: what the pair spends waiting for one
        idle_cores = idle.cores()
        window = CpuWindow(sessions).start()
        row: dict[str, Any] = {"connector": connector, **_phase(p, d, prompts[warmup:], output, metrics_url, hist,
                                                                 failed_key, bar, warmup)}
        row.update(idle_cores=idle_cores, phase_cores=window.cores())
        if busy_decode:
            with BusyDecode(d.url, busy_decode, busy_output, seed=len(prompts)) as busy:
                time.sleep(BUSY_SETTLE_S)  # the background requests are admitted and decoding
                row["busy"] = _phase(p, d, busy_prompts, output, metrics_url, hist, failed_key, bar, len(prompts))
            row["busy"].update(decode_requests=busy_decode, background_done=busy.done,
                               background_errors=busy.errors[:5])
    finally:
        p.stop()
        d.stop()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer bench vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None,
                    help="model folder (default: a random-weight Llama, 8 layers, 8 KV heads of 64, written here)")
    ap.add_argument("--connectors", nargs="+", choices=CONNECTORS, default=list(DEFAULT_CONNECTORS),
                    help="kvxfer-ucx-2s: the ucx plane with reads: two-sided; kvxfer-ucx-native: with "
                         "rma_progress: native (neither in the default set)")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=8, help="measured requests per connector")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--output", type=int, default=8, help="output tokens per request")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--cpus", nargs=2, default=["0", "1"], metavar=("PREFILL", "DECODE"),
                    help="VLLM_CPU_OMP_THREADS_BIND of each server ('none': unbound); default: one core each")
    ap.add_argument("--agent-cpus", choices=["any", "engine"], default=None,
                    help="kvxfer's connector.agent_cpus: 'engine' keeps each transfer agent on its worker's core "
                         "(default: engine where --cpus gives the two servers cores of their own, as docs/vllm.md "
                         "advises for that layout; else the connector's default, any)")
    ap.add_argument("--agent-nice", type=int, default=0, metavar="N",
                    help="kvxfer's connector.agent_nice: each transfer agent's nice value (-10: its threads preempt "
                         "its worker's busy ones; needs CAP_SYS_NICE); default 0")
    ap.add_argument("--busy-decode", type=int, default=0, metavar="N",
                    help="also measure the requests again while N other requests keep the decode server decoding "
                         f"(1 to {MAX_NUM_SEQS - 1}; 0: idle only)")
    ap.add_argument("--busy-output", type=int, default=128, help="tokens each background request decodes")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH")
    ap.add_argument("--plot", type=Path, default=None, metavar="PATH",
                    help="PNG: TTFT, transfer time and CPU per connector")
    args = ap.parse_args(argv)
    if not 0 <= args.busy_decode < MAX_NUM_SEQS:
        ap.error(f"--busy-decode: expected 0 to {MAX_NUM_SEQS - 1} (the servers run {MAX_NUM_SEQS} sequences at "
                 f"once and the measured request needs one), got {args.busy_decode}")
    if args.busy_output < 1 or args.requests < 1 or args.warmup < 0:
        ap.error("--busy-output and --requests must be at least 1, --warmup at least 0")
    if importlib.util.find_spec("vllm") is None:
        print("error: vLLM is not installed here (pip install -c constraints.txt -e '.[vllm-test]')", file=sys.stderr)
        return 1
    missing = {}
    if importlib.util.find_spec("nixl") is None:
        for c in args.connectors:
            if c in NIXL_TLS:
                missing[c] = "not installed: pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1"
    work = Path(tempfile.mkdtemp(prefix="kvxfer-bench-vllm-"))
    model = args.model
    if model is None:
        from kvxfer.integrations.tiny_llama import write_tiny_llama

        model = write_tiny_llama(work / "model", num_layers=8, hidden=512, heads=8, kv_heads=8)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_tokens)] for _ in range(args.warmup + args.requests)]
    busy_prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_tokens)]
                    for _ in range(args.requests if args.busy_decode else 0)]
    agent_cpus = args.agent_cpus or default_agent_cpus(args.cpus)
    rows = []
    for c in args.connectors:
        if c in missing:
            continue
        cpus = tuple(None if x == "none" else x for x in args.cpus)
        try:
            rows.append(run_pair(c, model, prompts, args.warmup, args.output, args.dtype, work,
                                 cpus,  # type: ignore[arg-type]
                                 args.busy_decode, busy_prompts, args.busy_output, agent_cpus, args.agent_nice))
        except (TimeoutError, OSError, RuntimeError) as e:  # one pair's failure (NIXL's engine died here once)
            missing[c] = f"failed: {type(e).__name__}: {e} (its servers' logs: {work}/{c}-*.log)"
            print(f"{c}: {missing[c]}", file=sys.stderr)
    by_name = {r["connector"]: r for r in rows}
    for r in rows:
        base_name = r["connector"] if r["connector"] in NIXL_TLS else baseline_of(r["connector"], set(by_name))
        base = by_name.get(base_name) if base_name else None
        r["nixl_baseline"] = base_name
        r["ttft_ratio_to_nixl"] = r["ttft_p50_ms"] / base["ttft_p50_ms"] if base else None
        r["transfer_ratio_to_nixl"] = r["transfer_mean_ms"] / base["transfer_mean_ms"] if base else None
        dflt = by_name.get("nixl")  # NixlConnector as vLLM documents it, whatever the row's wire
        r["transfer_ratio_to_nixl_default"] = r["transfer_mean_ms"] / dflt["transfer_mean_ms"] if dflt else None
        if "busy" in r:
            b = r["busy"]
            b["transfer_busy_over_idle"] = b["transfer_mean_ms"] / r["transfer_mean_ms"]
            b["transfer_ratio_to_nixl"] = (b["transfer_mean_ms"] / base["busy"]["transfer_mean_ms"]
                                           if base and "busy" in base else None)
            b["transfer_ratio_to_nixl_default"] = (b["transfer_mean_ms"] / dflt["busy"]["transfer_mean_ms"]
                                                   if dflt and "busy" in dflt else None)
    print(f"kvxfer bench vllm: {model}, {args.prompt_tokens}-token prompts, {args.requests} requests "
          f"(+{args.warmup} warm-up), {args.output} output tokens, {args.dtype}, kvxfer agent_cpus: {agent_cpus}, "
          f"agent_nice: {args.agent_nice}; "
          "baseline NixlConnector on the same transports (column 'vs'), same run")
    _table(rows, any(r["nixl_baseline"] for r in rows))
    for c, why in missing.items():
        print(f"{c:<12} {why}")
    print(f"server logs: {work}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": str(model), "prompt_tokens": args.prompt_tokens,
                                         "dtype": args.dtype, "agent_cpus": agent_cpus,
                                         "agent_nice": args.agent_nice, "rows": rows,
                                         "missing": missing}, indent=2))
        print(f"wrote {args.json}")
    if args.plot and rows:
        _plot(rows, args.plot, args.prompt_tokens)
        print(f"wrote {args.plot}")
    return 0


def _ratio(x: float | None) -> str:
    return f"{x:10.2f}" if x is not None else f"{'-':>10}"


def _table(rows: list[dict[str, Any]], with_nixl: bool) -> None:
    busy = any("busy" in r for r in rows)
    w = max([12, *(len(r["connector"]) for r in rows)])
    header = (f"{'connector':<{w}} {'vs':<10} {'TTFT p50':>10} {'TTFT p90':>10} {'xfer mean':>10} {'TTFT/NIXL':>10} "
              f"{'xfer/NIXL':>10} {'xfer/dflt':>10} {'failed':>6} {'idle CPU':>8} {'load CPU':>8}")
    if busy:
        header += f" | {'busy xfer':>10} {'busy/idle':>10} {'busy/NIXL':>10} {'busy/dflt':>10} {'failed':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        line = (f"{r['connector']:<{w}} {r['nixl_baseline'] or '-':<10} {r['ttft_p50_ms']:7.1f} ms "
                f"{r['ttft_p90_ms']:7.1f} ms "
                f"{r['transfer_mean_ms']:7.2f} ms {_ratio(r['ttft_ratio_to_nixl'])} "
                f"{_ratio(r['transfer_ratio_to_nixl'])} {_ratio(r.get('transfer_ratio_to_nixl_default'))} "
                f"{int(r['failed_transfers']):>6} {r['idle_cores']:8.2f} "
                f"{r['phase_cores']:8.2f}")
        if "busy" in r:
            b = r["busy"]
            line += (f" | {b['transfer_mean_ms']:7.2f} ms {_ratio(b['transfer_busy_over_idle'])} "
                     f"{_ratio(b['transfer_ratio_to_nixl'])} {_ratio(b.get('transfer_ratio_to_nixl_default'))} "
                     f"{int(b['failed_transfers']):>6}")
        print(line)
    for r in rows:
        for phase, ph in (("idle", r), ("busy", r.get("busy"))):
            st = ph and ph.get("stages_us")
            if st:
                print(f"{r['connector']:<{w}} {phase} stages, us per load: " + ", ".join(f"{k} {v:.0f}"
                                                                                      for k, v in st.items()))
    if busy:
        print("busy: the same number of requests again while other requests keep the decode server decoding "
              "(background requests completed: "
              + ", ".join(f"{r['connector']} {r['busy']['background_done']}" for r in rows if "busy" in r) + ")")
    print(f"idle CPU: cores both servers' processes used (vLLM's and kvxfer's agents) over {IDLE_CPU_S:g} s with no "
          f"request, {IDLE_SETTLE_S:g} s after the warm-up; load CPU: the same over the idle phase's requests "
          "(prefill and decode compute included)")
    print("xfer/NIXL: against the NIXL row on the row's own transports (column 'vs'); xfer/dflt: against 'nixl', "
          "NixlConnector as vLLM documents it for CPU (UCX_TLS=sm,self,tcp, which reads with CMA on one host)")
    if not with_nixl:
        print("(no NixlConnector row in this run: no ratios)")


def _plot(rows: list[dict[str, Any]], path: Path, prompt_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r["connector"] for r in rows]
    busy = all("busy" in r for r in rows)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15 if busy else 14, 4))
    x = np.arange(len(names))
    w = 0.4 if busy else 0.8
    for ax, key, what in ((a, "ttft_p50_ms", "time to first token, p50 (ms)"),
                          (b, "transfer_mean_ms", "KV transfer per request, mean (ms; log scale)")):
        colors = ["#888" if n in NIXL_TLS else "#1f77b4" for n in names]
        bars = ax.bar(x - (w / 2 if busy else 0), [r[key] for r in rows], w, color=colors, label="decode idle")
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        if busy:
            bars = ax.bar(x + w / 2, [r["busy"][key] for r in rows], w, color=colors, hatch="//", alpha=0.6,
                          label=f"decode busy ({rows[0]['busy']['decode_requests']} others decoding)")
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
            ax.legend(fontsize=8)
        ax.set_xticks(x, names)
        if key == "transfer_mean_ms":  # one stalled phase is 100x the rest: a linear axis hides them
            ax.set_yscale("log")
        ax.set_ylabel(what)
        ax.grid(True, axis="y", alpha=0.3)
    if all("idle_cores" in r for r in rows):  # what each pair spends for its transfer times
        bars = c.bar(x - 0.2, [r["idle_cores"] for r in rows], 0.4, color="#bbb", label="no request (idle CPU)")
        c.bar_label(bars, fmt="%.2f", fontsize=8)
        bars = c.bar(x + 0.2, [r["phase_cores"] for r in rows], 0.4, color="#555", label="during the requests")
        c.bar_label(bars, fmt="%.2f", fontsize=8)
        c.set_xticks(x, names)
        c.set_ylabel("cores used by both servers")
        c.legend(fontsize=8)
        c.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"vLLM 1P1D, {prompt_tokens}-token prompts: NixlConnector (grey) vs KvxferConnector", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
