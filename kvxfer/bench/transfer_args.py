"""The command line of ``kvxfer bench transfer`` (:mod:`kvxfer.bench.transfer` runs it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvxfer.bench.transfer_cases import TOKENS


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--connectors", nargs="+", default=None, metavar="NAME",
                    help="data planes to measure (default: every installed one that works across processes); "
                         "ucx-nocma: the ucx plane with same_host: ucx (UCX's own wire on this host too; by default "
                         "it reads this host's producers with CMA); tcp-copy: the tcp plane with unix_send: copy "
                         "(sendmsg on this host's Unix sockets, two copies; by default the producer splices its pages "
                         "in); ucx-2s: with reads: two-sided (every producer "
                         "over UCX); ucx-native: same_host: ucx, rma_progress: native; cma-agent: the cma plane with "
                         "engine_copy_bytes: 0 (every load through the transfer agent; by default the engine's "
                         "thread copies a small load itself); tcp-noswitch, ucx-noswitch, cma-noswitch: "
                         "gil_switch_interval_s: 0 (CPython's own switch interval while loads are in flight); "
                         "tcp-nowaitswitch, ucx-nowaitswitch, cma-nowaitswitch: gil_wait_switch_interval_s: 0 (a "
                         "poll that waits keeps the in-flight interval); "
                         "tcp-nice, ucx-nice, cma-nice, ucx-nocma-nice: agent_nice: -10 (the transfer agents preempt a "
                         "spinning engine)")
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS, help="request sizes in tokens (16 per block)")
    ap.add_argument("--patterns", nargs="+", choices=["contiguous", "random"], default=["contiguous", "random"])
    ap.add_argument("--peers", action="store_true",
                    help="also measure NIXL (on three transport sets: nixl, nixl-tcp, nixl-nocma) and Mooncake "
                         "when installed")
    ap.add_argument("--budget-s", type=float, default=1.0, help="time spent on each measurement's trials")
    ap.add_argument("--gap-ms", type=float, default=0.0, metavar="MS",
                    help="idle time before every trial of every row, peers and baselines too (default 0: back to "
                         "back): requests that arrive spaced, as a serving engine's do")
    ap.add_argument("--concurrency", type=int, nargs="?", const=64, default=0, metavar="N",
                    help="also N requests (default 64) of --blocks random blocks each in flight at once, against "
                         "one request of all their blocks")
    ap.add_argument("--blocks", type=int, default=2, metavar="K", help="blocks per request for --concurrency")
    ap.add_argument("--rounds", type=int, default=3, metavar="R",
                    help="--busy-engine and --concurrency measure each ratio's conditions in R alternating rounds "
                         "of --budget-s/R each (each with its own warm-up load and at least 3 trials), trials "
                         "pooled: drift of the machine's speed falls on both sides (default 3)")
    ap.add_argument("--busy-engine", action="store_true",
                    help="also every case with a Python thread spinning in the consumer, in the producer process, "
                         "and a spinning process of its own (cpu)")
    ap.add_argument("--poll", choices=["wait", "busy", "both"], default=None,
                    help="how the engine thread waits: poll(timeout_s=...) (wait) or poll() in a tight loop (busy); "
                         "both: the main table waits, --busy-engine has rows for both (its default)")
    ap.add_argument("--data-path", choices=["auto", "agent", "engine"], default=None,
                    help="connector.data_path of every connector measured (default: the config's default)")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH")
    ap.add_argument("--plot", type=Path, default=None, metavar="PATH",
                    help="PNG: GB/s against request size (with --busy-engine also PATH-busy.png)")
