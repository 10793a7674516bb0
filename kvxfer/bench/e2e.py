"""``kvxfer bench e2e``: time to first token and inter-token latency with and without
disaggregation, at several prompt lengths, through the launcher's processes.

The launch file's instances and router serve the disaggregated run; the baseline, in the
same run, is one monolithic instance (the decode instance's config, one rank, role both)
given the same requests. Requests go one at a time (``--concurrency 1``, the default), so
the figures are latencies, not queueing; raise it to see the effect of load.

``--modes pull push`` runs the same workload in each transfer mode (``connector.mode`` of every
instance set to it; push streams each layer as the prefill computes it). ``--shape-mbit R``
also runs every mode on a shaped link: the prefill instance runs in a network namespace of its
own, joined to this one by a veth pair held to R Mbit/s each way (``tc`` tbf; needs root;
removed at the end), with TCP data planes and shared-secret auth, so that moving a prompt's KV
can take about as long as computing it. TTFT is when the decode instance has the prompt's KV
and the first token.

``--rounds R`` runs each mode R times on fresh instances, alternating the order (pull push, push
pull, ...), and pools every round's requests into one p50 per mode: a slow spell of a shared
machine then falls on both modes alike instead of on whichever ran during it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvxfer.config import AuthConfig, InstanceConfig, LaunchConfig, load_instance_config, load_launch_config, to_yaml
from kvxfer.engine import messages as m
from kvxfer.engine.launcher import _addr, _pct, run_workload, started, verify_config, wait_ready
from kvxfer.engine.router import RoutedGenerated


class Samples:
    """Per-request figures of one (mode, link, prompt length), pooled over rounds."""

    def __init__(self) -> None:
        self.ttft_ms: list[float] = []
        self.itl_ms: list[float] = []
        self.kv_bytes = 0
        self.loaded = 0

    def stats(self) -> dict[str, float]:
        return {"ttft_p50_ms": _pct(self.ttft_ms, 50), "ttft_p90_ms": _pct(self.ttft_ms, 90),
                "itl_p50_ms": _pct(self.itl_ms, 50), "itl_p90_ms": _pct(self.itl_ms, 90),
                "kv_bytes": float(self.kv_bytes), "loaded": float(self.loaded)}


def _measure(addr: str, requests: list[m.Generate], concurrency: int, label: str, into: Samples) -> None:
    results: dict[str, RoutedGenerated] = {}
    for i in range(0, len(requests), concurrency):
        results.update(run_workload(addr, requests[i : i + concurrency], 600, f"{label} [{i + 1}/{len(requests)}]"))
    errors = [r.result.error for r in results.values() if r.result.error]
    if errors:
        raise RuntimeError(f"{label}: {len(errors)} requests failed: {errors[:3]}")
    into.ttft_ms += [r.ttft_s * 1e3 for r in results.values()]
    into.itl_ms += [float(d) * 1e3 for r in results.values() for d in np.diff(r.result.token_times)]
    into.kv_bytes += sum(r.result.kv_bytes for r in results.values())
    into.loaded += sum(r.result.loaded for r in results.values())


# the shaped link is not loopback: both sides authenticate (a KVXFER_ name would read as a config override)
SECRET_ENV = "KV_BENCH_SECRET"


class ShapedLink:
    """A second host for the prefill instance: a network namespace joined to this one by a veth
    pair whose both ends are held to ``mbit`` Mbit/s by a token bucket (tbf), as
    ``tests/test_netcut.py`` does. Needs root; removed by ``close``."""

    P_IP, D_IP = "10.214.0.1", "10.214.0.2"

    def __init__(self, mbit: float) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns, self.here, self.there = f"kvxe{tag}", f"kve{tag}", f"kvf{tag}"
        burst = max(64 * 1024, int(mbit * 1e6 / 8 / 250))  # about 4 ms of the rate
        steps = [
            ["ip", "netns", "add", self.ns],
            ["ip", "link", "add", self.here, "type", "veth", "peer", "name", self.there],
            ["ip", "link", "set", self.there, "netns", self.ns],
            ["ip", "addr", "add", f"{self.D_IP}/30", "dev", self.here],
            ["ip", "-n", self.ns, "addr", "add", f"{self.P_IP}/30", "dev", self.there],
            ["ip", "link", "set", self.here, "up"],
            ["ip", "-n", self.ns, "link", "set", self.there, "up"],
            ["ip", "-n", self.ns, "link", "set", "lo", "up"],
            ["tc", "qdisc", "add", "dev", self.here, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
             "latency", "2s"],
            ["ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.there, "root", "tbf", "rate",
             f"{mbit}mbit", "burst", str(burst), "latency", "2s"],
        ]
        for step in steps:
            r = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if r.returncode:
                self.close()
                raise RuntimeError(f"--shape-mbit: cannot make the shaped link ({' '.join(step)}: "
                                   f"{r.stderr.strip()}); it needs root, ip and tc")

    @property
    def wrap(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.here], capture_output=True, timeout=30)


def mode_configs(instances: list[InstanceConfig], mode: str, link: ShapedLink | None) -> list[InstanceConfig]:
    """The launch file's instances in ``mode``; with a shaped ``link``, the prefill instance
    listens in its namespace and the decode side channel on its end of the link, both on TCP
    (a Unix socket would bypass the link), with shared-secret auth."""
    out = []
    for c in instances:
        conn = msgspec.structs.replace(c.connector, mode=mode)
        server = c.server
        if link is not None and c.role != "both":
            if c.connector.name != "tcp":
                raise ValueError(f"--shape-mbit: instance {c.engine_id} must use the tcp data plane (cma and a "
                                 f"Unix socket would not cross the shaped link), got {c.connector.name}")
            host = link.P_IP if c.role == "prefill" else link.D_IP
            conn = msgspec.structs.replace(
                conn, side_channel=msgspec.structs.replace(c.connector.side_channel, host=host),
                data_plane={**c.connector.data_plane, "transport": "tcp", "host": host},
                auth=AuthConfig(secret_env=SECRET_ENV))
            if c.role == "prefill":
                server = msgspec.structs.replace(c.server, host=link.P_IP)
        out.append(msgspec.structs.replace(c, connector=conn, server=server))
    return out


def _write_launch(run_dir: Path, launch: LaunchConfig, cfgs: list[InstanceConfig], tag: str) -> tuple[Path, list[str]]:
    paths = []
    for c in cfgs:
        path = run_dir / f"{c.engine_id}-{tag}.yaml"
        path.write_text(to_yaml(c))
        paths.append(str(path))
    lpath = run_dir / f"launch-{tag}.yaml"
    lpath.write_text(to_yaml(msgspec.structs.replace(launch, instances=paths)))
    return lpath, paths


def run_order(modes: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, mode) in the order they run: each round reverses the last (A B, B A, A B, ...)."""
    return [(r, mode) for r in range(rounds) for mode in (modes if r % 2 == 0 else modes[::-1])]


WARM_UP = 2  # requests each server set takes before it is measured (first calls pay imports and allocation)


def _warm_up(addr: str, rng: np.random.Generator, vocab: int, plen: int, output: int, label: str) -> None:
    reqs = [m.Generate(request_id=f"warm-{label}-{i}", prompt=rng.integers(0, vocab, plen).tolist(),
                       max_tokens=output) for i in range(WARM_UP)]
    _measure(addr, reqs, 1, f"warm-up {label}", Samples())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer bench e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch", default="configs/demo.yaml", help="launch file (default: %(default)s)")
    ap.add_argument("--prompts", nargs="+", type=int, default=[128, 512, 1024, 2048], help="prompt lengths")
    ap.add_argument("--requests", type=int, default=8, help="requests per prompt length")
    ap.add_argument("--output", type=int, default=16, help="output tokens per request")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run each mode this many times on fresh instances, in alternating order (pull push, push "
                         "pull, ...), and pool the requests: drift on a noisy machine then hits both modes alike")
    ap.add_argument("--modes", nargs="+", choices=["pull", "push"], default=None,
                    help="transfer modes to run (default: the launch file's own)")
    ap.add_argument("--shape-mbit", type=float, default=None, metavar="R",
                    help="also run on a link shaped to R Mbit/s (tc on loopback; root)")
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
    if args.rounds < 1 or args.requests < 1:
        print("error: --rounds and --requests: expected >= 1", file=sys.stderr)
        return 1
    if len(set(args.modes or [])) != len(args.modes or []):
        print(f"error: --modes {' '.join(args.modes)}: a mode named twice (use --rounds to repeat)", file=sys.stderr)
        return 1
    if args.shape_mbit is not None and args.shape_mbit <= 0:
        print("error: --shape-mbit: expected > 0", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    vocab = decode.model.vocab_size
    modes = args.modes or [next(c for c in instances if c.role == "prefill").connector.mode if any(
        c.role == "prefill" for c in instances) else "pull"]
    links = ["unshaped"] + (["shaped"] if args.shape_mbit is not None else [])
    prompts = {plen: [rng.integers(0, vocab, plen).tolist() for _ in range(args.requests)] for plen in args.prompts}
    with started() as run:
        mono = verify_config(launch, decode)
        mono_path = run.logdir / "monolithic.yaml"
        mono_path.write_text(to_yaml(mono))
        mono_child = run.start(mono.engine_id, ["serve", str(mono_path)])
        wait_ready(run, [(mono_child, _addr(mono.server.host, mono.server.port))], launch.ready_timeout_s)
        _warm_up(_addr(mono.server.host, mono.server.port), rng, vocab, min(args.prompts), args.output, "mono")
        baseline: dict[int, Samples] = {}
        for plen in args.prompts:  # fresh prompts: the disaggregated runs' would hit its prefix cache
            reqs = [m.Generate(request_id=f"mono-{plen}-{i}", prompt=rng.integers(0, vocab, plen).tolist(),
                               max_tokens=args.output) for i in range(args.requests)]
            baseline[plen] = Samples()
            _measure(_addr(mono.server.host, mono.server.port), reqs, args.concurrency,
                     f"monolithic, prompt {plen}", baseline[plen])
        samples = {(mode, link, plen): Samples() for link in links for mode in modes for plen in args.prompts}
        for link in links:
            shaped = ShapedLink(args.shape_mbit) if link == "shaped" and args.shape_mbit else None
            if shaped is not None:
                os.environ.setdefault(SECRET_ENV, secrets.token_hex(16))  # the children inherit it
            try:
                for rnd, mode in run_order(modes, args.rounds):
                    cfgs = mode_configs(instances, mode, shaped)
                    tag = f"{mode}-{link}-{rnd}"
                    lpath, paths = _write_launch(run.logdir, launch, cfgs, tag)
                    with started(run.logdir / tag) as sub:
                        targets = [(sub.start(c.engine_id, ["serve", p], wrap=shaped.wrap if shaped is not None
                                              and c.role == "prefill" else None), _addr(c.server.host, c.server.port))
                                   for c, p in zip(cfgs, paths, strict=True)]
                        targets.append((sub.start("router", ["route", str(lpath)]),
                                        _addr(launch.router.host, launch.router.port)))
                        wait_ready(sub, targets, launch.ready_timeout_s)
                        _warm_up(_addr(launch.router.host, launch.router.port), rng, vocab, min(args.prompts),
                                 args.output, tag)
                        for plen in args.prompts:
                            reqs = [m.Generate(request_id=f"e2e-{tag}-{plen}-{i}", prompt=p, max_tokens=args.output)
                                    for i, p in enumerate(prompts[plen])]
                            _measure(_addr(launch.router.host, launch.router.port), reqs, args.concurrency,
                                     f"{mode}, {link} link, round {rnd + 1}/{args.rounds}, prompt {plen}",
                                     samples[mode, link, plen])
            finally:
                if shaped is not None:
                    shaped.close()
    records: list[dict[str, Any]] = []
    for (mode, link, plen), got in samples.items():
        dis, mon = got.stats(), baseline[plen].stats()
        records.append({"mode": mode, "link": link, "shape_mbit": args.shape_mbit if link == "shaped" else None,
                        "prompt_tokens": plen, "output_tokens": args.output, "requests": args.requests * args.rounds,
                        "rounds": args.rounds, "concurrency": args.concurrency, "disaggregated": dis,
                        "monolithic": mon, "ttft_p50_ms": dis["ttft_p50_ms"], "ttft_p90_ms": dis["ttft_p90_ms"],
                        "itl_p50_ms": dis["itl_p50_ms"], "itl_p90_ms": dis["itl_p90_ms"], "kv_bytes": dis["kv_bytes"],
                        "ttft_ratio": dis["ttft_p50_ms"] / mon["ttft_p50_ms"],
                        "itl_ratio": dis["itl_p50_ms"] / mon["itl_p50_ms"]})
    header = (f"{'mode':>4} {'link':>8} {'prompt':>6} {'TTFT p50 disagg':>16} {'TTFT p50 mono':>14} {'ratio':>6} "
              f"{'ITL p50 disagg':>15} {'ITL p50 mono':>13} {'ratio':>6} {'KV MiB/req':>10} {'TTFT/pull':>9}")
    print(f"kvxfer bench e2e {args.launch}: {args.requests} requests per length and round, {args.rounds} "
          f"round(s) per mode ({' '.join(md for _, md in run_order(modes, args.rounds))}, pooled), {args.output} "
          f"output tokens, concurrency {args.concurrency}; baseline: one monolithic instance, same run")
    print(header)
    print("-" * len(header))
    pull = {(r["link"], r["prompt_tokens"]): r["ttft_p50_ms"] for r in records if r["mode"] == "pull"}
    for r in records:
        d, mo = r["disaggregated"], r["monolithic"]
        base = pull.get((r["link"], r["prompt_tokens"]))
        r["ttft_vs_pull"] = r["ttft_p50_ms"] / base if base else None
        vs = f"{r['ttft_vs_pull']:9.2f}" if r["ttft_vs_pull"] is not None else f"{'-':>9}"
        print(f"{r['mode']:>4} {r['link']:>8} {r['prompt_tokens']:>6} {d['ttft_p50_ms']:13.1f} ms "
              f"{mo['ttft_p50_ms']:11.1f} ms {r['ttft_ratio']:6.2f} "
              f"{d['itl_p50_ms']:12.2f} ms {mo['itl_p50_ms']:10.2f} ms {r['itl_ratio']:6.2f} "
              f"{d['kv_bytes'] / r['requests'] / 2**20:10.2f} {vs}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"launch": args.launch, "modes": modes, "links": links,
                                         "shape_mbit": args.shape_mbit, "rounds": args.rounds,
                                         "records": records}, indent=2))
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

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    runs = sorted({(r["mode"], r["link"]) for r in records}, key=lambda t: (t[1], t[0]))
    for ax, key, what in ((a, "ttft_p50_ms", "time to first token"), (b, "itl_p50_ms", "inter-token latency")):
        for mode, link in runs:
            rs = [r for r in records if r["mode"] == mode and r["link"] == link]
            ax.plot([r["prompt_tokens"] for r in rs], [r["disaggregated"][key] for r in rs],
                    "o-" if mode == "push" else "s-", alpha=1.0 if link == "shaped" else 0.6,
                    label=f"{mode}, {link} link")
        first = [r for r in records if (r["mode"], r["link"]) == runs[0]]
        x = [r["prompt_tokens"] for r in first]
        ax.plot(x, [r["monolithic"][key] for r in first], "k:", label="monolithic (baseline)")
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
