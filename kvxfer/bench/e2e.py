"""``kvxfer bench e2e``: time to first token and inter-token latency with and without
disaggregation, at several prompt lengths, through the launcher's processes.

The launch file's instances and router serve the disaggregated run; the baseline, in the
same run, is one monolithic instance (the decode instance's config, one rank, role both)
given the same requests. Requests go one at a time (``--concurrency 1``, the default), so
the figures are latencies, not queueing; raise it to see the effect of load.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.config import load_instance_config, load_launch_config, to_yaml
from kvxfer.engine import messages as m
from kvxfer.engine.launcher import _addr, _pct, run_workload, started, verify_config, wait_ready
from kvxfer.engine.router import RoutedGenerated


def _measure(addr: str, requests: list[m.Generate], concurrency: int, label: str) -> dict[str, float]:
    results: dict[str, RoutedGenerated] = {}
    for i in range(0, len(requests), concurrency):
        results.update(run_workload(addr, requests[i : i + concurrency], 600, f"{label} [{i + 1}/{len(requests)}]"))
    errors = [r.result.error for r in results.values() if r.result.error]
    if errors:
        raise RuntimeError(f"{label}: {len(errors)} requests failed: {errors[:3]}")
    ttft = [r.ttft_s * 1e3 for r in results.values()]
    itl = [float(d) * 1e3 for r in results.values() for d in np.diff(r.result.token_times)]
    return {"ttft_p50_ms": _pct(ttft, 50), "ttft_p90_ms": _pct(ttft, 90), "itl_p50_ms": _pct(itl, 50),
            "itl_p90_ms": _pct(itl, 90), "kv_bytes": float(sum(r.result.kv_bytes for r in results.values())),
            "loaded": float(sum(r.result.loaded for r in results.values()))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer bench e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch", default="configs/demo.yaml", help="launch file (default: %(default)s)")
    ap.add_argument("--prompts", nargs="+", type=int, default=[128, 512, 1024, 2048], help="prompt lengths")
    ap.add_argument("--requests", type=int, default=8, help="requests per prompt length")
    ap.add_argument("--output", type=int, default=16, help="output tokens per request")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, metavar="PATH")
    ap.add_argument("--plot", type=Path, default=None, metavar="PATH", help="PNG: TTFT and ITL against prompt length")
    args = ap.parse_args(argv)
    launch = load_launch_config(args.launch)
    instances = [load_instance_config(p) for p in launch.instances]
    decode = next(c for c in instances if c.role in ("decode", "both"))
    too_long = [p for p in args.prompts if p + args.output > decode.model.max_position]
    if too_long:
        print(f"error: --prompts {too_long}: prompt + output must fit model.max_position="
              f"{decode.model.max_position}", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    vocab = decode.model.vocab_size
    records: list[dict[str, Any]] = []
    with started() as run:
        targets = [(run.start(c.engine_id, ["serve", p]), _addr(c.server.host, c.server.port))
                   for c, p in zip(instances, launch.instances, strict=True)]
        targets.append((run.start("router", ["route", args.launch]), _addr(launch.router.host, launch.router.port)))
        mono = verify_config(launch, decode)
        mono_path = run.logdir / "monolithic.yaml"
        mono_path.write_text(to_yaml(mono))
        targets.append((run.start(mono.engine_id, ["serve", str(mono_path)]),
                        _addr(mono.server.host, mono.server.port)))
        wait_ready(run, targets, launch.ready_timeout_s)
        for plen in args.prompts:
            reqs = [m.Generate(request_id=f"e2e-{plen}-{i}", prompt=rng.integers(0, vocab, plen).tolist(),
                               max_tokens=args.output) for i in range(args.requests)]
            dis = _measure(_addr(launch.router.host, launch.router.port), reqs, args.concurrency,
                           f"disaggregated, prompt {plen}")
            # the same prompts again would hit the decode instance's prefix cache: fresh ids, fresh prompts
            reqs = [m.Generate(request_id=f"mono-{plen}-{i}", prompt=rng.integers(0, vocab, plen).tolist(),
                               max_tokens=args.output) for i in range(args.requests)]
            mon = _measure(_addr(mono.server.host, mono.server.port), reqs, args.concurrency,
                           f"monolithic, prompt {plen}")
            records.append({"prompt_tokens": plen, "output_tokens": args.output, "requests": args.requests,
                            "concurrency": args.concurrency, "disaggregated": dis, "monolithic": mon,
                            "ttft_ratio": dis["ttft_p50_ms"] / mon["ttft_p50_ms"],
                            "itl_ratio": dis["itl_p50_ms"] / mon["itl_p50_ms"]})
    header = (f"{'prompt':>6} {'TTFT p50 disagg':>16} {'TTFT p50 mono':>14} {'ratio':>6} {'ITL p50 disagg':>15} "
              f"{'ITL p50 mono':>13} {'ratio':>6} {'KV MiB/req':>10}")
    print(f"kvxfer bench e2e {args.launch}: {args.requests} requests per length, {args.output} output tokens, "
          f"concurrency {args.concurrency}; baseline: one monolithic instance, same run")
    print(header)
    print("-" * len(header))
    for r in records:
        d, mo = r["disaggregated"], r["monolithic"]
        print(f"{r['prompt_tokens']:>6} {d['ttft_p50_ms']:13.1f} ms {mo['ttft_p50_ms']:11.1f} ms "
              f"{r['ttft_ratio']:6.2f} "
              f"{d['itl_p50_ms']:12.2f} ms {mo['itl_p50_ms']:10.2f} ms {r['itl_ratio']:6.2f} "
              f"{d['kv_bytes'] / r['requests'] / 2**20:10.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"launch": args.launch, "records": records}, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        _plot(records, args.plot, args.launch)
        print(f"wrote {args.plot}")
    return 0


def _plot(records: list[dict[str, Any]], path: Path, launch: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["prompt_tokens"] for r in records]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, what in ((a, "ttft_p50_ms", "time to first token"), (b, "itl_p50_ms", "inter-token latency")):
        ax.plot(x, [r["disaggregated"][key] for r in records], "o-", label="disaggregated (prefill + decode)")
        ax.plot(x, [r["monolithic"][key] for r in records], "s--", label="monolithic (baseline)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(f"{what}, p50 (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"kvxfer bench e2e ({launch})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
