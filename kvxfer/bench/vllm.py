"""``kvxfer bench vllm``: a real vLLM prefill/decode pair, with vLLM's own NixlConnector and
with KvxferConnector (tcp, ucx and cma), given the same prompts in one run.

Per connector: two vLLM servers on this machine (one core each), a warm-up, then requests one
at a time: the prompt on the prefill server (``max_tokens=1``), then the decode server streams
the output. Reported per connector:

- time to first token, at the client: prefill request plus the decode server's first token;
- KV transfer time per request on the decode side: NIXL's ``vllm:nixl_xfer_time_seconds``
  (post to completion of its reads) and kvxfer's ``kvxfer_transfer_seconds`` (start of the
  load to its end, planning included); the mean over the measured requests;
- the ratio of each to NIXL's, measured in the same run.

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
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvxfer.engine.launcher import _pct
from kvxfer.integrations.vllm_pd import VllmServer, completion_body, free_port, metric_totals, prefill
from kvxfer.progress import Progress

CONNECTORS = ("nixl", "kvxfer-tcp", "kvxfer-ucx", "kvxfer-cma")


def _stream_first_token(url: str, body: dict[str, Any]) -> tuple[float, float]:
    """(seconds to the first streamed token, seconds to the end) of one decode request."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the decode server streamed no token")
    return first, time.perf_counter() - t0


def run_pair(connector: str, model: Path, prompts: list[list[int]], warmup: int, output: int, dtype: str,
             logdir: Path, cpus: tuple[str | None, str | None] = ("0", "1")) -> dict[str, Any]:
    kind = "nixl" if connector == "nixl" else "kvxfer"
    extra = None
    mport = free_port()
    if kind == "kvxfer":
        extra = {"connector": {"name": connector.split("-", 1)[1]}, "metrics_port": mport}
    length = max(1024, max(len(q) for q in prompts) + output + 1)
    p = VllmServer(model, free_port(), "prefill", kind, extra and {**extra, "metrics_port": free_port()}, dtype,
                   cpu=cpus[0], log=logdir / f"{connector}-prefill.log", max_model_len=length)
    d = VllmServer(model, free_port(), "decode", kind, extra, dtype, cpu=cpus[1],
                   log=logdir / f"{connector}-decode.log", max_model_len=length)
    metrics_url = f"http://127.0.0.1:{mport}/metrics" if kind == "kvxfer" else d.url + "/metrics"
    hist = "kvxfer_transfer_seconds" if kind == "kvxfer" else "vllm:nixl_xfer_time_seconds"
    try:
        p.wait_ready()
        d.wait_ready()
        print(f"{connector}: servers ready; {warmup} warm-up and {len(prompts) - warmup} measured requests",
              file=sys.stderr)
        bar = Progress(len(prompts), "requests")
        ttft, e2e = [], []
        before: dict[str, float] = {}
        for i, prompt in enumerate(prompts):
            if i == warmup:
                before = metric_totals(metrics_url)
            t0 = time.perf_counter()
            params = prefill(p.url, prompt)
            t_prefill = time.perf_counter() - t0
            first, total = _stream_first_token(d.url, completion_body(prompt, output, params))
            if i >= warmup:
                ttft.append((t_prefill + first) * 1e3)
                e2e.append((t_prefill + total) * 1e3)
            bar.update(i + 1)
        after = metric_totals(metrics_url)
        n = after.get(f"{hist}_count", 0) - before.get(f"{hist}_count", 0)
        xfer_ms = (after.get(f"{hist}_sum", 0) - before.get(f"{hist}_sum", 0)) / n * 1e3 if n else float("nan")
        failed_key = "kvxfer_loads_failed_total" if kind == "kvxfer" else "vllm:nixl_num_failed_transfers_total"
        failed = after.get(failed_key, 0) - before.get(failed_key, 0)
    finally:
        p.stop()
        d.stop()
    return {"connector": connector, "requests": len(ttft), "transfers_measured": n, "failed_transfers": failed,
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p90_ms": _pct(ttft, 90), "e2e_p50_ms": _pct(e2e, 50),
            "transfer_mean_ms": xfer_ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer bench vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None,
                    help="model folder (default: a random-weight Llama, 8 layers, 8 KV heads of 64, written here)")
    ap.add_argument("--connectors", nargs="+", choices=CONNECTORS, default=list(CONNECTORS))
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=8, help="measured requests per connector")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--output", type=int, default=8, help="output tokens per request")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--cpus", nargs=2, default=["0", "1"], metavar=("PREFILL", "DECODE"),
                    help="VLLM_CPU_OMP_THREADS_BIND of each server ('none': unbound); default: one core each")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH")
    ap.add_argument("--plot", type=Path, default=None, metavar="PATH", help="PNG: TTFT and transfer time per connector")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        print("error: vLLM is not installed here (pip install -c constraints.txt -e '.[vllm-test]')", file=sys.stderr)
        return 1
    missing = {}
    if "nixl" in args.connectors and importlib.util.find_spec("nixl") is None:
        missing["nixl"] = "not installed: pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1"
    work = Path(tempfile.mkdtemp(prefix="kvxfer-bench-vllm-"))
    model = args.model
    if model is None:
        from kvxfer.integrations.tiny_llama import write_tiny_llama

        model = write_tiny_llama(work / "model", num_layers=8, hidden=512, heads=8, kv_heads=8)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_tokens)] for _ in range(args.warmup + args.requests)]
    rows = []
    for c in args.connectors:
        if c in missing:
            continue
        cpus = tuple(None if x == "none" else x for x in args.cpus)
        rows.append(run_pair(c, model, prompts, args.warmup, args.output, args.dtype, work, cpus))  # type: ignore[arg-type]
    base = next((r for r in rows if r["connector"] == "nixl"), None)
    for r in rows:
        r["ttft_ratio_to_nixl"] = r["ttft_p50_ms"] / base["ttft_p50_ms"] if base else None
        r["transfer_ratio_to_nixl"] = r["transfer_mean_ms"] / base["transfer_mean_ms"] if base else None
    print(f"kvxfer bench vllm: {model}, {args.prompt_tokens}-token prompts, {args.requests} requests "
          f"(+{args.warmup} warm-up), {args.output} output tokens, {args.dtype}; baseline NixlConnector, same run")
    header = (f"{'connector':<12} {'TTFT p50':>10} {'TTFT p90':>10} {'xfer mean':>10} {'TTFT/NIXL':>10} "
              f"{'xfer/NIXL':>10} {'failed':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        tr = f"{r['ttft_ratio_to_nixl']:10.2f}" if base else f"{'-':>10}"
        xr = f"{r['transfer_ratio_to_nixl']:10.2f}" if base else f"{'-':>10}"
        print(f"{r['connector']:<12} {r['ttft_p50_ms']:7.1f} ms {r['ttft_p90_ms']:7.1f} ms "
              f"{r['transfer_mean_ms']:7.2f} ms {tr} {xr} {int(r['failed_transfers']):>6}")
    for c, why in missing.items():
        print(f"{c:<12} {why}")
    print(f"server logs: {work}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": str(model), "prompt_tokens": args.prompt_tokens,
                                         "dtype": args.dtype, "rows": rows, "missing": missing}, indent=2))
        print(f"wrote {args.json}")
    if args.plot and rows:
        _plot(rows, args.plot, args.prompt_tokens)
        print(f"wrote {args.plot}")
    return 0


def _plot(rows: list[dict[str, Any]], path: Path, prompt_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["connector"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, what in ((a, "ttft_p50_ms", "time to first token, p50 (ms)"),
                          (b, "transfer_mean_ms", "KV transfer per request, mean (ms)")):
        bars = ax.bar(names, [r[key] for r in rows], color=["#888" if n == "nixl" else "#1f77b4" for n in names])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_ylabel(what)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"vLLM 1P1D, {prompt_tokens}-token prompts: NixlConnector (grey) vs KvxferConnector", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
