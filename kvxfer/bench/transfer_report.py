"""What ``kvxfer bench transfer`` reports, apart from measuring it: the rows of its tables
(main, ``--busy-engine``, ``--concurrency``), the JSON, and the plots.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvxfer.bench.transfer_cases import STAGES

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


def format_stages(st: dict[str, float] | None) -> str:
    return "/".join(f"{st[f'{k}_us']:.0f}" for k in STAGES if f"{k}_us" in st) if st else ""


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


def nixl_comparisons(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each kvxfer plane's row against NIXL on the same transports (``SAME_WIRE``) and against
    NIXL's best (``nixl``), same case, same run: p50 and GB/s ratios (kvxfer / NIXL; a p50
    ratio under 1 and a GB/s ratio over 1 are kvxfer ahead)."""
    from kvxfer.bench.peers import SAME_WIRE
    from kvxfer.bench.transfer_cases import plane_of

    peers = {(r["connector"], r["pattern"], r["tokens"]): r for r in records if r["kind"] == "peer"}
    out = []
    for r in records:
        if r["kind"] != "connector":
            continue
        same = SAME_WIRE.get(r["connector"], SAME_WIRE.get(plane_of(r["connector"])))
        for against, peer in (("same wire", same), ("NIXL's best", "nixl" if same != "nixl" else None)):
            n = peers.get((peer, r["pattern"], r["tokens"])) if peer else None
            if n is None:
                continue
            out.append({"connector": r["connector"], "pattern": r["pattern"], "tokens": r["tokens"],
                        "against": against, "peer": peer, "p50_us": r["p50_us"], "peer_p50_us": n["p50_us"],
                        "p50_ratio": r["p50_us"] / n["p50_us"], "gbps": r["gbps"], "peer_gbps": n["gbps"],
                        "gbps_ratio": r["gbps"] / n["gbps"]})
    return out


COMPARISON_HEADER = (f"{'connector':<10} {'pattern':<10} {'tokens':>6} {'against':<12} {'peer':<11} {'p50 us':>8} "
                     f"{'peer p50':>8} {'p50 ratio':>9} {'GB/s':>6} {'peer GB/s':>9} {'GB/s ratio':>10}")


def format_comparison(c: dict[str, Any]) -> str:
    return (f"{c['connector']:<10} {c['pattern']:<10} {c['tokens']:>6} {c['against']:<12} {c['peer']:<11} "
            f"{c['p50_us']:8.0f} {c['peer_p50_us']:8.0f} {c['p50_ratio']:9.2f} {c['gbps']:6.2f} "
            f"{c['peer_gbps']:9.2f} {c['gbps_ratio']:10.2f}")


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


def print_tables(skipped: dict[str, str], busy_records: list[dict[str, Any]],
                 concurrency_records: list[dict[str, Any]], concurrency: int, blocks: int,
                 comparisons: list[dict[str, Any]] | None = None) -> None:
    """After the main table (printed case by case as it is measured): what was skipped and why,
    kvxfer against NIXL (same wire and best), then the ``--busy-engine`` and ``--concurrency`` tables."""
    for name, why in skipped.items():
        print(f"{name:<24} {why}")
    if comparisons:
        print(f"\nkvxfer against NIXL, same case and run: on the same transports (cma: CMA; tcp: UCX over TCP; "
              f"ucx: UCX without CMA) and on NIXL's best\n{COMPARISON_HEADER}\n{'-' * len(COMPARISON_HEADER)}")
        for c in comparisons:
            print(format_comparison(c))
    if busy_records:
        print(f"\nbusy engine: a Python thread spinning in the consumer or producer process, against idle "
              f"(peers poll their own way)\n{BUSY_HEADER}\n{'-' * len(BUSY_HEADER)}")
        for r in busy_records:
            print(format_busy(r))
    if concurrency_records:
        print(f"\nconcurrency: {concurrency} requests of {blocks} random blocks in flight at once, against "
              f"one request of all of them\n{CONCURRENCY_HEADER}\n{'-' * len(CONCURRENCY_HEADER)}")
        for r in concurrency_records:
            print(format_concurrency(r))


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")


def write_plots(path: Path, title: str, records: list[dict[str, Any]], busy_records: list[dict[str, Any]]) -> None:
    """``path``: GB/s against request size; with busy-engine records also ``<stem>-busy<suffix>``."""
    plot(records, path, title)
    print(f"wrote {path}")
    if busy_records:
        busy_png = path.with_name(f"{path.stem}-busy{path.suffix}")
        plot_busy(busy_records, busy_png, title)
        print(f"wrote {busy_png}")
