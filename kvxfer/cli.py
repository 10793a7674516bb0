"""The ``kvxfer`` command: check configs and launch a paired prefill/decode set."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kvxfer import __version__
from kvxfer.cache.spec import spec_from_config
from kvxfer.config import (
    ConfigError,
    InstanceConfig,
    is_launch_file,
    load_instance_config,
    load_launch_config,
    read_yaml,
    to_yaml,
)
from kvxfer.connector import available_data_planes

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_CONFIG, EXIT_UNAVAILABLE = 0, 1, 2


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def describe_instance(cfg: InstanceConfig) -> list[str]:
    """One line per PP stage: layers, KV heads per rank, bytes per block, cache size."""
    lines = []
    par = cfg.parallel
    for pp_rank in range(par.pp):
        spec = spec_from_config(cfg, pp_rank)
        lines.append(
            f"  stage {pp_rank}: layers {spec.first_layer}-{spec.first_layer + spec.num_layers - 1}, "
            f"{spec.num_kv_heads} kv head(s)/rank x {par.tp} tp rank(s), block {spec.block_size} tokens "
            f"= {spec.bytes_per_block:,} B, cache {_mib(spec.bytes_per_block * cfg.cache.num_blocks)}/rank"
        )
    return lines


def print_config_error(e: ConfigError) -> None:
    """Every error of a refused config, one ``error: FILE: PATH: MESSAGE`` line each."""
    for line in e.lines():
        print(f"error: {line}", file=sys.stderr)


def cmd_check_config(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.files:
        try:
            data = read_yaml(path)
            if is_launch_file(data):
                launch = load_launch_config(path)
                print(f"# {path}: launcher file, valid")
                print(to_yaml(launch), end="")
                for inst in launch.instances:
                    try:
                        cfg = load_instance_config(inst)
                    except ConfigError as e:
                        print_config_error(e)
                        status = EXIT_CONFIG
                        continue
                    print(f"# {inst}: {cfg.role} instance {cfg.engine_id!r}, valid")
            else:
                cfg = load_instance_config(path)
                print(f"# {path}: {cfg.role} instance {cfg.engine_id!r}, valid")
                print(to_yaml(cfg), end="")
                print("# derived:")
                for line in describe_instance(cfg):
                    print("#" + line)
                installed = available_data_planes()
                if cfg.connector.name not in installed:
                    print(f"# note: connector.name {cfg.connector.name!r} is not installed here "
                          f"(installed: {', '.join(sorted(installed)) or 'none'})")
        except ConfigError as e:
            print_config_error(e)
            status = EXIT_CONFIG
    return status


def cmd_launch(args: argparse.Namespace) -> int:
    from kvxfer.engine.launcher import LaunchError, launch

    try:
        cfg = load_launch_config(args.file)
        instances = [load_instance_config(p) for p in cfg.instances]
    except ConfigError as e:
        print_config_error(e)
        return EXIT_CONFIG
    print(f"launch plan from {args.file}:")
    for path, inst in zip(cfg.instances, instances, strict=True):
        print(f"- {inst.role} instance {inst.engine_id!r} ({os.path.relpath(path)}): "
              f"tp={inst.parallel.tp} pp={inst.parallel.pp}, connector {inst.connector.name} "
              f"({inst.connector.mode}), server {inst.server.host}:{inst.server.port}")
        for line in describe_instance(inst):
            print(line)
    try:
        return launch(args.file, verify=args.verify, logdir=args.logdir)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        print("interrupted: every process this launch started has been stopped", file=sys.stderr)
        return 130


def cmd_serve(args: argparse.Namespace) -> int:
    from kvxfer.engine.instance import serve
    from kvxfer.engine.ranks import RankError, serve_rank

    try:
        cfg = load_instance_config(args.file)
        if args.rank:
            if not 0 < args.rank < cfg.world_size or not args.store_port or not args.control_port:
                print(f"error: --rank {args.rank} needs 0 < rank < {cfg.world_size} (tp x pp), --store-port and "
                      f"--control-port; rank 0 (plain 'kvxfer serve') starts the other ranks itself",
                      file=sys.stderr)
                return EXIT_CONFIG
            serve_rank(cfg, args.rank, args.store_port, args.control_port)
        else:
            serve(cfg, args.file)
    except ConfigError as e:
        print_config_error(e)
        return EXIT_CONFIG
    except ValueError as e:
        print(f"error: {args.file}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except RankError as e:
        print(f"error: {args.file}: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return EXIT_OK


def cmd_route(args: argparse.Namespace) -> int:
    from kvxfer.engine.router import route

    try:
        route(args.file)
    except ConfigError as e:
        print_config_error(e)
        return EXIT_CONFIG
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    return EXIT_OK


BENCHES = {"transfer": "kvxfer.bench.transfer", "repack": "kvxfer.bench.repack", "e2e": "kvxfer.bench.e2e",
           "vllm": "kvxfer.bench.vllm"}


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    return int(importlib.import_module(BENCHES[args.what]).main(args.args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvxfer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvxfer {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("KVXFER_LOG_LEVEL", "WARNING"),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check-config", help="validate instance or launcher YAML files")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("launch", help="start the instances and router of a launch file, run its workload")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--verify", action="store_true",
                   help="also run every request on one monolithic instance; exit 1 on any disagreement")
    p.add_argument("--logdir", default=None, help="where the children's logs go (default: a new temp dir)")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("serve", help="run one instance (prefill, decode or both) from its YAML file")
    p.add_argument("file", metavar="CONFIG")
    # set by rank 0 when it starts the other ranks of a TP/PP instance
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--control-port", type=int, default=0, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="benchmarks with same-run baselines: transfer, repack, e2e, vllm "
                                     "(kvxfer bench WHAT --help for each)")
    p.add_argument("what", choices=sorted(BENCHES))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("route", help="run the router of a launch file")
    p.add_argument("file", metavar="FILE")
    p.set_defaults(func=cmd_route)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
