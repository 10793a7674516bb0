"""CPU a vLLM server's processes spend while it holds a finished prompt's KV for a reader that never comes.

vLLM steps without pause while a request's blocks are held for a connector; kvxfer's adapter makes
such empty steps wait in ``poll`` (``IDLE_STEP_WAIT_S``). One ``kv_both`` TP 1 server (tcp, the
tiny test model), in the same run: CPU seconds of each process over ``--window-s`` idle (the
baseline), then the same window while one 300-token prompt is held. Prints a table, writes JSON.

    python benchmarks/vllm_hold_cpu.py --json benchmarks/results/issue16/session27/hold_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvxfer.integrations.vllm_pd import VllmServer, free_port, prefill

ROOT = Path(__file__).resolve().parent.parent


def cpu_by_process(server: VllmServer) -> dict[str, float]:
    """CPU seconds (user + system) of each process of the server, by its command's name."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in server.pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # gone meanwhile
        name = ("agent" if "kvxfer.agent" in argv else "api server" if "vllm.entrypoints.openai.api_server" in argv
                else "resource tracker" if any("resource_tracker" in a for a in argv) else argv[0].strip())
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def window(server: VllmServer, seconds: float) -> dict[str, float]:
    before = cpu_by_process(server)
    time.sleep(seconds)
    after = cpu_by_process(server)
    return {k: round(after[k] - before.get(k, 0.0), 2) for k in sorted(after)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        subprocess.run([sys.executable, str(ROOT / "examples/vllm_pd/tiny_model.py"), str(model), "--seed", "0"],
                       check=True, capture_output=True, timeout=300)
        cfg = {"connector": {"name": "tcp", "timeouts": {"lease_s": max(60.0, 3 * args.window_s)}}}
        server = VllmServer(model, free_port(), "both", extra=cfg, dtype="float32", cpu="0",
                            log=Path(tmp) / "server.log")
        try:
            print("starting the vLLM server ...", file=sys.stderr)
            server.wait_ready()
            time.sleep(3)
            idle = window(server, args.window_s)
            prefill(server.url, list(range(1, 301)))  # held for a decode side that never reads it
            time.sleep(1)
            holding = window(server, args.window_s)
        finally:
            server.stop()
    print(f"CPU seconds per {args.window_s:g} s")
    print(f"{'process':<20} {'idle':>8} {'holding':>8}")
    for name in sorted(set(idle) | set(holding)):
        print(f"{name:<20} {idle.get(name, 0.0):>8.2f} {holding.get(name, 0.0):>8.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"window_s": args.window_s, "idle": idle, "holding": holding}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
