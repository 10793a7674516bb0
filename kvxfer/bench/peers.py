"""Other KV transfer engines measured beside kvxfer in the same run, when installed
(``pip install 'kvxfer[peers]'``): NIXL (UCX backend, DRAM to DRAM, one agent per process)
and Mooncake's transfer engine (TCP, P2P handshake).

NIXL runs three times, on three sets of UCX transports, so each kvxfer plane meets it on the
wire that plane uses as well as on NIXL's best: ``nixl`` (UCX picks among shared memory, CMA
and TCP: on one host its reads are CMA copies, as kvxfer's cma plane's are), ``nixl-tcp``
(``UCX_TLS=tcp``: the wire kvxfer's tcp plane uses, and NIXL's between hosts without RDMA)
and ``nixl-nocma`` (the transports kvxfer's ucx plane lets UCX use: everything but CMA and
CUDA). Comparing the tcp plane with ``nixl`` alone would set a socket against a memory copy.

Each peer has a producer half, which registers the producer's cache tensors and returns
what the consumer needs to reach them (msgspec-encodable), and a consumer half, which
registers the consumer's cache and reads a descriptor list (remote region, remote offset,
local region, local offset, length) into it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch

logger = logging.getLogger(__name__)

PEERS = ("nixl", "nixl-tcp", "nixl-nocma", "mooncake")
# kvxfer's plane (or a bench row that is not its plane's wire) -> the NIXL variant on the same transports;
# ucx reads this host's producer with CMA (same_host: cma, its default), as NIXL's UCX does; the rows on
# UCX's own wire (same_host: ucx) meet NIXL without CMA
SAME_WIRE = {"cma": "nixl", "tcp": "nixl-tcp", "tcp-copy": "nixl-tcp", "ucx": "nixl",
             **{c: "nixl-nocma" for c in ("ucx-nocma", "ucx-nocma-nice", "ucx-2s", "ucx-native")}}
MOONCAKE_BATCH = 256
_MODULES = {"nixl": "nixl_cu12._api", "mooncake": "mooncake.engine"}


def engine_of(name: str) -> str:
    """The engine a peer variant runs: "nixl-tcp" -> "nixl"."""
    return name.split("-", 1)[0]


def forced_tls(name: str) -> str | None:
    """The UCX_TLS a NIXL variant runs with whatever the user set (None: the user's, or NIXL's best)."""
    if name == "nixl-tcp":
        return "tcp"
    if name == "nixl-nocma":
        from kvxfer.connectors.ucx import DEFAULT_TLS  # no ucxx import: the string only

        return DEFAULT_TLS
    return None


def missing_reason(name: str) -> str | None:
    """None when peer ``name`` can run here; else why not (for the table)."""
    try:
        importlib.import_module(_MODULES[engine_of(name)])
    except Exception as e:  # ImportError, or a missing system library (OSError inside the import)
        return f"not installed ({type(e).__name__}: {str(e)[:80]}); pip install 'kvxfer[peers]'"
    return None


def _bases(tensors: list[torch.Tensor]) -> list[int]:
    return [t.data_ptr() for t in tensors]


NIXL_UCX_TLS = "sm,self,cma,tcp"
# UCX settings as the user started the bench: kvxfer's ucx plane (and ucxx, which sets
# UCX_RNDV_FRAG_MEM_TYPE=cuda among others) changes the process environment, and a peer's
# spawned processes would inherit that
USER_UCX_ENV = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}


def use_peer_env(name: str, user_ucx_env: dict[str, str]) -> None:
    """Give this (peer) process the user's UCX environment. ``nixl`` also gets its best
    transports on one host unless the user chose: its one-sided reads need CMA, named
    explicitly (without it, or with ucxx's settings inherited, they ran at 0.5-0.7 GB/s
    here against 4.7). kvxfer's own plane leaves CMA out on purpose (see connectors/ucx).
    The other NIXL variants get their transports whatever the user set (their names say them)."""
    for k in [k for k in os.environ if k.startswith("UCX_")]:
        del os.environ[k]
    os.environ.update(user_ucx_env)
    if (tls := forced_tls(name)) is not None:
        os.environ["UCX_TLS"] = tls
    elif name == "nixl":
        os.environ.setdefault("UCX_TLS", NIXL_UCX_TLS)


class NixlProducer:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent("kvxfer-bench-producer", nixl_agent_config(backends=["UCX"]))
        self.agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), 0, "") for t in tensors], "DRAM")
        self.info = {"metadata": self.agent.get_agent_metadata(), "bases": _bases(tensors)}


class NixlConsumer:
    def __init__(self, tensors: list[torch.Tensor], info: dict[str, Any]) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent("kvxfer-bench-consumer", nixl_agent_config(backends=["UCX"]))
        self.agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), 0, "") for t in tensors], "DRAM")
        self.remote = self.agent.add_remote_agent(info["metadata"])
        self.remote_bases = np.asarray(info["bases"], dtype=np.int64)
        self.local_bases = np.asarray(_bases(tensors), dtype=np.int64)

    def read(self, rr: np.ndarray, ro: np.ndarray, lr: np.ndarray, lo: np.ndarray, ln: np.ndarray,
             timeout_s: float = 120.0) -> None:
        zeros = np.zeros_like(ln)
        local = np.stack([self.local_bases[lr] + lo, ln, zeros], axis=1)
        remote = np.stack([self.remote_bases[rr] + ro, ln, zeros], axis=1)
        handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                            self.agent.get_xfer_descs(remote, "DRAM"), self.remote)
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nixl: read not done in {timeout_s:g}s")
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"nixl: transfer state {state}")
        finally:
            self.agent.release_xfer_handle(handle)

    def read_many(self, reqs: list[tuple[np.ndarray, ...]], timeout_s: float = 120.0) -> list[float]:
        """Every request's transfer in flight at once (each: rr, ro, lr, lo, ln), polled in one
        tight loop as NIXL's callers do; each request's latency, from its own start to seen DONE."""
        handles: list[Any] = []
        starts: list[float] = []
        try:
            for rr, ro, lr, lo, ln in reqs:
                starts.append(time.perf_counter())
                zeros = np.zeros_like(ln)
                local = np.stack([self.local_bases[lr] + lo, ln, zeros], axis=1)
                remote = np.stack([self.remote_bases[rr] + ro, ln, zeros], axis=1)
                handles.append(self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                                          self.agent.get_xfer_descs(remote, "DRAM"), self.remote))
                if (state := self.agent.transfer(handles[-1])) not in ("PROC", "DONE"):
                    raise RuntimeError(f"nixl: transfer state {state}")
            lat = [0.0] * len(handles)
            pending = list(range(len(handles)))
            deadline = time.monotonic() + timeout_s
            while pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nixl: {len(pending)} reads not done in {timeout_s:g}s")
                left = []
                for i in pending:
                    state = self.agent.check_xfer_state(handles[i])
                    if state == "DONE":
                        lat[i] = time.perf_counter() - starts[i]
                    elif state == "PROC":
                        left.append(i)
                    else:
                        raise RuntimeError(f"nixl: transfer state {state}")
                pending = left
            return lat
        finally:
            for h in handles:
                self.agent.release_xfer_handle(h)


def _mooncake_engine(tensors: list[torch.Tensor]) -> Any:
    """A TCP transfer engine on loopback (P2P handshake: no metadata server) with ``tensors`` registered."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""):
        raise RuntimeError("mooncake: initialize failed")
    for t in tensors:
        if engine.register_memory(t.data_ptr(), t.numel() * t.element_size()):
            raise RuntimeError("mooncake: register_memory failed")
    return engine


class MooncakeProducer:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.engine = _mooncake_engine(tensors)
        self.info = {"target": f"127.0.0.1:{self.engine.get_rpc_port()}", "bases": _bases(tensors)}


class MooncakeConsumer:
    def __init__(self, tensors: list[torch.Tensor], info: dict[str, Any]) -> None:
        self.engine = _mooncake_engine(tensors)
        self.target = info["target"]
        self.remote_bases = np.asarray(info["bases"], dtype=np.int64)
        self.local_bases = np.asarray(_bases(tensors), dtype=np.int64)

    def read(self, rr: np.ndarray, ro: np.ndarray, lr: np.ndarray, lo: np.ndarray, ln: np.ndarray,
             timeout_s: float = 120.0) -> None:
        local, remote = (self.local_bases[lr] + lo).tolist(), (self.remote_bases[rr] + ro).tolist()
        lengths = ln.tolist()
        # its TCP transport rejects batches larger than its lane queues (seen: "queue-full" at 16384 pieces)
        for i in range(0, len(lengths), MOONCAKE_BATCH):
            j = i + MOONCAKE_BATCH
            rc = self.engine.batch_transfer_sync_read(self.target, local[i:j], remote[i:j], lengths[i:j])
            if rc:
                raise RuntimeError(f"mooncake: batch read failed ({rc})")


PRODUCERS: dict[str, type[NixlProducer | MooncakeProducer]] = {"nixl": NixlProducer, "mooncake": MooncakeProducer}
CONSUMERS: dict[str, type[NixlConsumer | MooncakeConsumer]] = {"nixl": NixlConsumer, "mooncake": MooncakeConsumer}


# ------------------------------------------------------------------ a process pair per peer

def producer_main(name: str, make_cache: Callable[[], Any], ucx_env: dict[str, str], conn: Any) -> None:
    """The peer's producer process: the cache, registered; its info; then serve ("spin", on)
    (a Python thread spinning here, as a busy engine thread would) until None."""
    from kvxfer.bench.transfer_cases import Spinner

    use_peer_env(name, ucx_env)
    cache = make_cache()
    try:
        peer = PRODUCERS[engine_of(name)](cache.tensors)
        conn.send(("ok", msgspec.msgpack.encode(peer.info)))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    spinner = Spinner()
    try:
        while conn.poll(3600):
            msg = conn.recv()
            if msg is None:
                return
            if msg[0] == "spin":
                spinner.set(msg[1])
                conn.send(("ok", None))
    finally:
        spinner.set(False)


def _read_many(peer: NixlConsumer, reqs: list[tuple[np.ndarray, ...]], lats: list[float]) -> float:
    t0 = time.perf_counter()
    lats.extend(peer.read_many(reqs))
    return time.perf_counter() - t0


def consumer_main(name: str, make_cache: Callable[[], Any], ucx_env: dict[str, str], info: bytes,
                  conn: Any) -> None:
    """The peer's consumer process: for each case sent, time its reads and check the bytes.

    A case is a dict: ``op`` "read" (``descs``: rr, ro, lr, lo, ln; one request) or "many"
    (``reqs``: one such tuple per request, all in flight at once); ``src`` and ``dst`` (every
    block, to check on arrival), ``budget``, ``gap_s`` (idle before each trial), and ``spin`` (a
    Python thread spinning in this process meanwhile). Answers ("ok", {"times": [...], "lats": [...]})
    or ("error", why)."""
    from kvxfer.bench.transfer_cases import Spinner, check_arrived, clear, timed

    use_peer_env(name, ucx_env)
    cache = make_cache()
    try:
        peer = CONSUMERS[engine_of(name)](cache.tensors, msgspec.msgpack.decode(info))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", None))
    spinner = Spinner()
    while True:
        case = conn.recv()
        if case is None:
            return
        try:
            clear(cache, case["dst"])
            lats: list[float] = []
            if case["op"] == "many":
                if not isinstance(peer, NixlConsumer):
                    raise NotImplementedError(f"{name}: no concurrent reads in this bench")
                measure: Callable[[], object] = functools.partial(_read_many, peer, case["reqs"], lats)
            else:
                measure = functools.partial(peer.read, *case["descs"])
            spinner.set(case.get("spin", False))
            try:
                times = timed(measure, case["budget"], on_warm=lats.clear, gap_s=case.get("gap_s", 0.0))
            finally:
                spinner.set(False)
            check_arrived(cache, case["src"], case["dst"], name)
            conn.send(("ok", {"times": times, "lats": lats}))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class PeerPair:
    """Producer and consumer processes of one peer; a crash in either is reported, not fatal."""

    def __init__(self, name: str, make_cache: Callable[[], Any], timeout_s: float = 300.0) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.name, self.timeout_s = name, timeout_s
        self.ppipe, child = ctx.Pipe()
        # the parent's snapshot: a spawned child that imports this module sees the changed environment
        self.pproc = ctx.Process(target=producer_main, args=(name, make_cache, USER_UCX_ENV, child), daemon=True)
        self.pproc.start()
        self.cproc: Any = None
        status, info = self._recv(self.ppipe, self.pproc)
        if status != "ok":
            self.close()
            raise RuntimeError(f"producer side: {info}")
        self.cpipe, child = ctx.Pipe()
        self.cproc = ctx.Process(target=consumer_main, args=(name, make_cache, USER_UCX_ENV, info, child),
                                 daemon=True)
        self.cproc.start()
        status, why = self._recv(self.cpipe, self.cproc)
        if status != "ok":
            self.close()
            raise RuntimeError(f"consumer side: {why}")

    def _recv(self, pipe: Any, proc: Any) -> tuple[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        while not pipe.poll(0.2):
            if not proc.is_alive():
                return "error", f"its process died (exit code {proc.exitcode})"
            if time.monotonic() > deadline:
                return "error", f"no answer in {self.timeout_s:g}s"
        return pipe.recv()

    def measure(self, case: dict[str, Any]) -> tuple[str, Any]:
        self.cpipe.send(case)
        return self._recv(self.cpipe, self.cproc)

    def spin_producer(self, on: bool) -> None:
        """Start or stop a Python thread spinning in the producer process."""
        self.ppipe.send(("spin", on))
        status, why = self._recv(self.ppipe, self.pproc)
        if status != "ok":
            raise RuntimeError(f"producer side: {why}")

    def alive(self) -> bool:
        return self.pproc.is_alive() and self.cproc is not None and self.cproc.is_alive()

    def close(self) -> None:
        for pipe_name, proc in (("cpipe", self.cproc), ("ppipe", self.pproc)):
            if proc is None:
                continue
            with contextlib.suppress(Exception):
                getattr(self, pipe_name).send(None)
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
