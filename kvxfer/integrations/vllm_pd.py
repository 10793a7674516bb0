"""Run a vLLM prefill/decode pair and send it requests (no vLLM import: vLLM runs in child processes).

Used by ``examples/vllm_pd``, the vLLM tests and ``kvxfer bench vllm``. A request goes to the
prefill server with ``max_tokens=1`` and ``do_remote_decode``; the ``kv_transfer_params`` it
returns go with the same prompt to the decode server, which loads the prompt's KV and decodes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAX_NUM_SEQS = 8  # sequences a server runs at once (--max-num-seqs)
START_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
# vLLM's engine core, when a worker has not taken its last step's input for a minute (logged at INFO)
_STALLED = "No available shared memory broadcast block"
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit)\b.*:")  # "RuntimeError: ...", "ucxx.x.UCXError: ..."


_FIRST_FIXED_PORT = 20000
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A free TCP port for a server this process will start, below the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` is free only until some other socket asks for one:
    a server started a second later (vLLM's own ZMQ and torch ports, a side channel) may be given
    it first. Ports below the ephemeral range are never given out that way, and none is returned
    twice by this process."""
    low = _FIRST_FIXED_PORT
    high = _ephemeral_range()[0] - 1
    if high - low < 1000:
        low, high = 1024, 65535
    for _ in range(200):
        port = random.randint(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"free_port: no free port found in {low}-{high} after 200 tries")


def kv_transfer_config(connector: str, role: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for ``connector`` "kvxfer" or "nixl" and role prefill, decode or
    both (``kv_both``: one server that prefills for others and decodes from others)."""
    roles = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
    if role not in roles:
        raise ValueError(f"role: expected one of {sorted(roles)}, got {role!r}")
    kv_role = roles[role]
    cfg: dict[str, Any] = {"kv_role": kv_role, "kv_load_failure_policy": "recompute"}
    if connector == "kvxfer":
        cfg["kv_connector"] = "KvxferConnector"
    elif connector == "nixl":
        cfg.update(kv_connector="NixlConnector", kv_buffer_device="cpu")
    else:
        raise ValueError(f"connector: expected kvxfer or nixl, got {connector!r}")
    if extra:
        cfg["kv_connector_extra_config"] = dict(extra)
    return cfg


class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process; its output goes to ``log``."""

    def __init__(self, model: str | Path, port: int, role: str, connector: str = "kvxfer",
                 extra: Mapping[str, Any] | None = None, dtype: str = "bfloat16", cpu: str | None = None,
                 log: str | Path | None = None, env: Mapping[str, str] | None = None,
                 served_name: str = "tiny", max_model_len: int = 1024, args: Sequence[str] = (),
                 prefix_caching: bool = False, eager: bool = True) -> None:
        """``args``: more of vLLM's command line (``--block-size 64``); ``prefix_caching``: vLLM's
        default is on, off here unless asked (a test of transfers wants every prompt moved);
        ``eager``: ``--enforce-eager`` (quick to start). vLLM 0.32's CPU build needs it off for
        ``--pipeline-parallel-size`` > 1: an eager CPU worker skips the warm-up run that allocates
        the buffers a later pipeline stage receives into, and the first request fails
        (``assert self.intermediate_tensors is not None``)."""
        self.port = port
        self.role = role
        self.log_path = Path(log) if log else Path(f"/tmp/kvxfer-vllm-{role}-{port}.log")
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", dtype, *(["--enforce-eager"] if eager else []), "--max-model-len", str(max_model_len),
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
                "--max-num-seqs", str(MAX_NUM_SEQS),
                "--kv-transfer-config", json.dumps(kv_transfer_config(connector, role, extra)), *args]
        e = dict(os.environ)
        e.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                  "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        if cpu is not None:
            e["VLLM_CPU_OMP_THREADS_BIND"] = cpu
        if connector == "nixl":  # NIXL's UCX over loopback on one host
            e.setdefault("UCX_TLS", "sm,self,tcp")
            e.setdefault("UCX_NET_DEVICES", "lo")
            e["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        e.update(env or {})
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=e,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM {self.role} server exited with {self.proc.returncode} while starting; "
                                   f"errors in {self.log_path}:\n{self.errors()}\nlast lines:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM {self.role} server not ready within {timeout_s:g}s; errors in {self.log_path}:\n"
                           f"{self.errors()}\nlast lines:\n{self.tail()}")

    def errors(self, n: int = 30) -> str:
        """The log's error lines and exception messages: the root cause of a failed start sits far above its tail,
        in the engine core's output."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        hits = [ln for ln in lines if " ERROR " in ln or _EXCEPTION_LINE.match(ln.strip())]
        return "\n".join(list(dict.fromkeys(hits))[:n])

    def problems(self, n: int = 15) -> str:
        """The last ``n`` kvxfer warnings and error lines of the log, named by log file: why a load
        failed (a test's failure message; CI keeps no temp dirs to read the logs from)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        hits = [ln.strip() for ln in lines if (" WARNING " in ln and "kvxfer" in ln) or " ERROR " in ln
                or _STALLED in ln][-n:]
        return "\n".join(f"{self.log_path.name}: {ln}" for ln in hits)

    def stacks(self, frames: int = 8) -> str:
        """Where each of the server's processes is now, compactly (a CI log keeps only so much of a
        failure message): one line per thread, its innermost ``frames`` frames, native ones included
        (a wait inside a C library shows as that wait), identical threads counted once; workers first,
        the engine core, agents, then the rest. By ``py-spy dump``, where py-spy is installed; empty
        if it is missing or the server is gone."""
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(spy).exists() or self.proc.poll() is not None:
            return ""
        dumps = []
        for pid in self.pids():
            title = _title(pid)
            if "resource_tracker" in title:
                continue
            dumps.append((_process_rank(title), f"{self.log_path.name} pid {pid} {title[:100]}:\n"
                          f"{_dump(spy, pid, frames)}"))
        return "\n".join(text for _, text in sorted(dumps, key=lambda d: d[0]))

    def pids(self) -> list[str]:
        """Every process of the server's group (API server, engine core, workers, agents); [] if unknown."""
        try:
            return subprocess.run(["pgrep", "-g", str(self.proc.pid)], capture_output=True, text=True,
                                  timeout=10).stdout.split()
        except (OSError, subprocess.SubprocessError):
            return []

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples, ``name{labels}`` -> value."""
        return prometheus_samples(self.url + "/metrics")

    def kill(self) -> None:
        """SIGKILL the whole server (API process and engine core): a crashed instance."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; returns the exit status (negative: killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("vLLM %s server ignored SIGTERM for %gs; killing it", self.role, STOP_TIMEOUT_S)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        # children of the engine, if any survived, go with the group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
        return int(self.proc.returncode)


def _title(pid: str) -> str:
    """A process's command line (vLLM renames its processes: ``VLLM::Worker_TP0``); '' if it is gone."""
    try:
        return " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
    except OSError:
        return ""


def _process_rank(title: str) -> int:
    """Where a process goes in ``stacks``: the worker that hangs a step is what a reader looks for."""
    for i, key in enumerate(("Worker", "EngineCore", "kvxfer.agent")):
        if key in title:
            return i
    return 3


def _dump(spy: str, pid: str, frames: int) -> str:
    """One process's threads by ``py-spy dump --json`` (with native frames where py-spy can unwind them)."""
    err = ""
    for native in (["--native"], []):
        try:
            r = subprocess.run([spy, "dump", "--json", *native, "--pid", pid], capture_output=True, text=True,
                               timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            return f"  no dump ({e})"
        if r.returncode == 0:
            try:
                return _innermost(json.loads(r.stdout), frames)
            except (ValueError, KeyError, TypeError) as e:
                err = f"unreadable dump: {e}"
                continue
        err = r.stderr.strip().splitlines()[0][-300:] if r.stderr.strip() else f"exit {r.returncode}"
    return f"  no dump ({err})"  # e.g. ptrace refused


def _innermost(threads: list[dict[str, Any]], frames: int) -> str:
    """``py-spy dump --json``'s threads, a line each: state, name, innermost ``frames`` frames
    (innermost first, ``<``-joined); threads with the same state and frames counted on one line."""
    lines: dict[str, list[str]] = {}
    for t in threads:
        shown = [f for f in t["frames"] if not str(f["name"]).startswith("0x")][:frames]
        stack = " < ".join(f"{f['name']} ({f['short_filename']}:{f['line']})" if f["line"] else str(f["name"])
                           for f in shown)
        state = ("active" if t.get("active") else "idle") + ("+gil" if t.get("owns_gil") else "")
        lines.setdefault(f"{state}: {stack}", []).append(str(t.get("thread_name") or t.get("os_thread_id")))
    return "\n".join(f"  {min(names)!r}{f' (+{len(names) - 1} alike)' if len(names) > 1 else ''} {key}"
                     for key, names in lines.items())


def prometheus_samples(url: str) -> dict[str, float]:
    """A Prometheus endpoint's samples, ``name{labels}`` -> value."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def metric_totals(url: str) -> dict[str, float]:
    """A Prometheus endpoint's samples summed per metric name, over every label set."""
    out: dict[str, float] = {}
    for key, value in prometheus_samples(url).items():
        name = key.split("{")[0]
        out[name] = out.get(name, 0.0) + value
    return out


def post(url: str, body: Mapping[str, Any], timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None


def completion_body(prompt: list[int] | str, max_tokens: int, kv_transfer_params: Mapping[str, Any] | None = None,
                    model: str = "tiny") -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    return body


def prefill(prefill_url: str, prompt: list[int] | str, model: str = "tiny") -> dict[str, Any]:
    """Run the prompt on the prefill server; returns its ``kv_transfer_params`` for the decode side."""
    out = post(prefill_url + "/v1/completions",
               completion_body(prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False}, model))
    params = out.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"the prefill server returned no kv_transfer_params: {json.dumps(out)[:500]}")
    return params


def disaggregated(prefill_url: str, decode_url: str, prompt: list[int] | str, max_tokens: int,
                  model: str = "tiny") -> dict[str, Any]:
    """Prefill on one server, decode on the other; returns the decode server's completion."""
    params = prefill(prefill_url, prompt, model)
    return post(decode_url + "/v1/completions", completion_body(prompt, max_tokens, params, model))


def local(url: str, prompt: list[int] | str, max_tokens: int, model: str = "tiny") -> dict[str, Any]:
    """The same request computed entirely on one server (the reference)."""
    return post(url + "/v1/completions", completion_body(prompt, max_tokens, None, model))


def token_ids(completion: Mapping[str, Any]) -> list[int]:
    choice = completion["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        raise RuntimeError("the server returned no token_ids (needs vLLM with return_token_ids)")
    return list(ids)
