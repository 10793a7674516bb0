"""The engine's side of a transfer agent: the ``Connector`` API, carried out in the agent.

``Connector.from_config`` returns an :class:`AgentConnector` when ``connector.data_path`` is
``agent`` (or ``auto`` with a data plane that can live in another process). The engine's
thread spends one command round trip per request (the agent checks it and answers at once)
and a non-blocking read of the event channel per ``poll``; the bytes move in the agent.

A dead or hung agent never hangs the engine: every command has a time limit; an agent that
exits, or holds a load past its deadline plus ``AGENT_GRACE_S``, is killed and reported
(``broken``), and every load it had fails with its block ids at the next ``poll``.

Threads: the engine's threads call in, no thread of its own. ``_command_lock`` orders
commands (one in flight); ``_poll_lock`` makes one ``poll`` at a time (it owns the event
channel); ``_lock`` guards the loads, holds, pending failures and ``_dead``, and is never held
across a blocking call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from kvxfer.agent.channel import Channel, ChannelClosed
from kvxfer.agent.engine_loads import EngineLoads
from kvxfer.agent.messages import (
    AbandonLoad,
    Close,
    Command,
    Done,
    Event,
    GetStats,
    Held,
    Hold,
    Push,
    Ready,
    Refused,
    Release,
    Reply,
    Reserve,
    Reserved,
    SaveLayer,
    Start,
    StartLoad,
    Stats,
    Wait,
)
from kvxfer.agent.shared import share_tensors
from kvxfer.cache.staging import copy_blocks, mirror_of, pin_for, unpin
from kvxfer.cache.tensors import KVCache
from kvxfer.config import InstanceConfig
from kvxfer.connector import check_cache, check_rank
from kvxfer.dataplane import load_data_plane
from kvxfer.metrics import ConnectorMetrics
from kvxfer.protocol import ErrorCode, KVTransferParams, PushTarget
from kvxfer.supervise import report
from kvxfer.switch_interval import SwitchInterval
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.aggregator import Finished
from kvxfer.transfer.consumer import AlreadyLoading
from kvxfer.transfer.load import EngineCopied, checked_load_ids
from kvxfer.transfer.planner import SideLayout

logger = logging.getLogger(__name__)

_sched_yield = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6").sched_yield  # PyDLL: keeps the GIL

AGENT_START_S = 120.0  # spawn, import, map the cache, register, bind the side channel
COMMAND_S = 30.0  # an agent answers commands at once; this long without an answer: hung
# past a load's deadline the agent itself fails it; this much later, we do (kill it: hung). Generous: an
# agent starved of CPU on a loaded host (seen with a load average of 50 on 2 cores) is late, not hung
AGENT_GRACE_S = 15.0
# an engine's OpenMP binding (vLLM's CPU workers set it): the agent's own OpenMP runtime would pin
# the agent's main thread to the first place; the agent keeps the engine thread's CPU mask instead
OPENMP_BINDING = frozenset({"OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"})
MAX_OUTCOMES = 4096  # finished loads whose outcome wait_layer still answers
# in a burst of loads (no poll between), the engine's thread copies this many bytes before it gives
# every other load it could copy to the agent (_share_burst): a step's few small loads stay the
# engine's (the agent's round trip would report them a poll later), a burst of many is copied on
# both sides at once
SHARE_AFTER_BYTES = 8 << 20
MAX_UNTOLD = 65536  # copied loads kept for an agent that reads none of them (stuck): then given up (logged)
COPIED_BUFFER = 4 << 20  # the copied channel's send buffer: loads told between two of the agent's reads


@dataclass
class _Load:
    """A load the agent is carrying out: its local blocks, and when it must have finished."""

    block_ids: np.ndarray
    deadline: float


class AgentMetrics(ConnectorMetrics):
    """The agent's counters, fetched when read (for ``stats()`` and the Prometheus endpoint)."""

    def __init__(self, owner: AgentConnector, engine_id: str, rank: int, plane: str) -> None:
        super().__init__(engine_id, rank, plane)
        self.owner = weakref.ref(owner)  # no cycle: a closed connector and its cache go at once
        self.last: dict[str, float] = {}
        self.handoff_s = 0.0  # event sent by the agent until poll handed it to the engine
        self.handoffs = 0
        self.copied_handoff_s = 0.0  # a load the engine copied, until poll handed it over
        self.copied_handoffs = 0

    def copied_handed_over(self, loads: int, seconds: float) -> None:
        """``loads`` loads the engine copied itself reached ``poll``, ``seconds`` after their copies (summed)."""
        with self._lock:
            self.copied_handoffs += loads
            self.copied_handoff_s += seconds

    def handed_over(self, loads: int, seconds: float) -> None:
        """``loads`` finished loads reached the engine's ``poll``, ``seconds`` after the agent sent them (summed)."""
        with self._lock:
            self.handoffs += loads
            self.handoff_s += seconds

    def snapshot(self) -> dict[str, float]:
        owner = self.owner()
        stats = owner._fetch_stats() if owner is not None else None
        if stats is not None:
            with self._lock:
                self.last = dict(stats.snapshot)
                self.failed_by_code.clear()
                self.failed_by_code.update(stats.failed_by_code)
                for h, s in ((self.handshake_latency, stats.handshake), (self.transfer_latency, stats.transfer)):
                    h.counts, h.sum, h.count = list(s.counts), s.sum, s.count
        with self._lock:
            out = dict(self.last)
            # the handoff stage ends when the engine's poll has it: the agent's event hop counts too
            out["stage_handoff_s"] = out.get("stage_handoff_s", 0.0) + self.handoff_s + self.copied_handoff_s
            out["stage_handoffs"] = out.get("stage_handoffs", 0.0) + self.copied_handoffs  # the agent's count the rest
            out["agent_handoff_s"] = self.handoff_s
            out["agent_handoffs"] = float(self.handoffs)
        engine = owner._engine_loads if owner is not None else None
        out["engine_copied_loads"] = float(engine.copied if engine is not None else 0)
        out["engine_passed_loads"] = float(engine.passed if engine is not None else 0)
        out["engine_shared_loads"] = float(engine.shared if engine is not None else 0)
        out["engine_producers"] = float(engine.producers if engine is not None else 0)
        if owner is None or owner.broken is not None:
            out["broken"] = 1.0
        return out


class AgentConnector:
    """A rank's connector whose data path runs in a transfer agent process (see the module doc)."""

    def __init__(self, config: InstanceConfig, rank: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.tp_rank, self.pp_rank = check_rank(config, rank)
        self.config = config
        self.rank = rank
        self.layout = ParallelLayout.from_config(config)
        self.clock = clock
        self.metrics = AgentMetrics(self, config.engine_id, rank, config.connector.name)
        self.cache: KVCache | None = None
        self.device_cache: KVCache | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.ready: Ready | None = None
        self._commands: Channel | None = None
        self._events: Channel | None = None
        self._copied_channel: Channel | None = None
        self._command_lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._lock = threading.Lock()  # the loads, the holds, the pending failures, _dead
        self._loads: dict[str, _Load] = {}
        self._held: set[str] = set()  # holds the agent keeps: freed (reported sending) if it dies
        self._streaming: dict[str, np.ndarray] = {}  # streaming holds: block ids (checked and staged per save)
        self._failed = Finished()  # failures found here (agent dead), reported at the next poll
        self._carry = Finished()  # events wait_layer read, reported at the next poll
        self._landed: dict[str, set[int]] = {}  # push loads in flight: layers landed so far
        self._outcomes: OrderedDict[str, bool] = OrderedDict()  # finished loads: ok or not
        self._broken: str | None = None  # the agent's own reason, from its events
        self._engine_loads: EngineLoads | None = None  # small loads this process copies itself (engine_loads.py)
        self._engine_lock = threading.Lock()  # one thread in _engine_loads at a time
        self._copied = Finished()  # loads _engine_loads copied, reported at the next poll
        self._copied_at: list[float] = []  # when each was copied (the handoff stage)
        self._untold: list[EngineCopied] = []  # copied loads the agent has not been sent yet (_tell_copied)
        # a burst: loads started with no poll between. Bytes this thread copied in it, and whether
        # the last load it could have copied since SHARE_AFTER_BYTES went to the agent (_share_burst)
        self._burst_bytes = 0
        self._burst_shared = False
        self._dead: str | None = None  # why the agent is gone
        self._closed = False
        # the interpreter's switch interval, short while loads are in flight (switch_interval.py)
        self._switch = SwitchInterval(config.connector.gil_switch_interval_s)

    # ------------------------------------------------------------------ lifecycle
    def register_kv_caches(self, cache: KVCache) -> None:
        """Share the cache's memory with a new agent, and wait until it serves the side channel."""
        if self.cache is not None or self.process is not None:
            raise RuntimeError("register_kv_caches: already registered (or a registration failed: make a new one)")
        check_cache(self.config, self.rank, cache)
        staging = self.config.connector.host_staging
        if staging == "always" or (staging == "auto" and cache.device.type != "cpu"):
            self.device_cache, cache = cache, mirror_of(cache, pin=False)  # the agent maps the host mirror
            logger.info("rank %d: staging a %s cache through a host mirror", self.rank, self.device_cache.device)
        shared = share_tensors(cache)
        if self.device_cache is not None:
            pin_for(self.device_cache, cache)  # pinned where it now lives, in shared memory
        engine_cmd, agent_cmd = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        engine_evt, agent_evt = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        engine_cp, agent_cp = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._commands = Channel(engine_cmd, Reply)
        self._events = Channel(engine_evt, Event)
        engine_cp.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, COPIED_BUFFER)  # a burst, between its reads
        self._copied_channel = Channel(engine_cp, Reply)  # EngineCopied, sent only (messages.py doc)
        fds = [agent_cmd.fileno(), agent_evt.fileno(), agent_cp.fileno(), *(t.fd for t in shared)]
        env = {k: v for k, v in os.environ.items() if k not in OPENMP_BINDING}
        env["KVXFER_AGENT_LOG_LEVEL"] = str(logging.getLogger("kvxfer").getEffectiveLevel())
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # kvxfer and plugins as the engine finds them
        try:
            any_cpu = ["--any-cpu"] if self.config.connector.agent_cpus == "any" else []
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvxfer.agent", str(agent_cmd.fileno()), str(agent_evt.fileno()),
                 str(agent_cp.fileno()), *any_cpu],
                pass_fds=fds, env=env, close_fds=True)
        except OSError as e:
            self._teardown()
            unpin(cache)
            raise RuntimeError(f"rank {self.rank}: cannot start the transfer agent: {e}") from None
        finally:
            agent_cmd.close()
            agent_evt.close()
            agent_cp.close()
        start = Start(config=msgspec.to_builtins(self.config), rank=self.rank, tensors=shared,
                      num_blocks=cache.num_blocks, sys_path=[p for p in sys.path if p])
        try:
            reply = self._call(start, AGENT_START_S)
            if isinstance(reply, Refused):
                raise (ValueError if reply.kind == "value" else RuntimeError)(
                    f"rank {self.rank}: transfer agent: {reply.message}")
            if not isinstance(reply, Ready):
                raise RuntimeError(f"rank {self.rank}: transfer agent: expected Ready, got {type(reply).__name__}")
        except BaseException:
            self._teardown()
            unpin(cache)
            raise
        self.ready = reply
        self.cache = cache
        self._engine_loads = self._make_engine_loads(cache)
        logger.info("rank %d: transfer agent pid %d serves the side channel on port %d (%s)", self.rank,
                    self.process.pid, reply.port, reply.plane)

    def _make_engine_loads(self, cache: KVCache) -> EngineLoads | None:
        """The small loads this process may copy itself, if its plane reads one-sided (engine_loads.py)."""
        conn = self.config.connector
        if (self.config.role not in ("decode", "both") or conn.engine_copy_bytes == 0 or conn.mode != "pull"
                or self.device_cache is not None):
            return None
        try:
            reads = load_data_plane(conn.name).engine_reads(conn.data_plane, cache.regions)
        except Exception as e:  # the agent loads everything, as before
            report("engine reads", e, f"rank {self.rank}: the transfer agent loads every request")
            return None
        if reads is None:
            return None
        return EngineLoads(reads, self.layout, self.tp_rank, self.pp_rank, SideLayout.from_cache(cache),
                           conn.engine_copy_bytes, cache.spec.bytes_per_block,
                           conn.engine_copy_release_gil_bytes or None, self._switch)

    @property
    def side_channel_port(self) -> int:
        if self.ready is None:
            raise RuntimeError("not registered")
        return self.ready.port

    @property
    def generation(self) -> int:
        if self.ready is None:
            raise RuntimeError("not registered")
        return self.ready.generation

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            alive = self.process is not None and self._dead is None
        try:
            self._close(alive)
        finally:
            self._switch.close()  # whatever failed above: the engine's switch interval comes back

    def _close(self, alive: bool) -> None:
        if alive:
            try:
                self._call(Close())
            except RuntimeError as e:
                logger.warning("rank %d: transfer agent did not close cleanly: %s", self.rank, e)
        with self._poll_lock:
            self._teardown(wait_s=10.0)
        with self._engine_lock:
            if self._engine_loads is not None:
                self._engine_loads.close()
                self._engine_loads = None
        if self.cache is not None:
            unpin(self.cache)  # the host mirror's pinning (a device cache's), once the agent is gone

    def _teardown(self, wait_s: float = 0.0) -> None:
        """Stop the agent (given ``wait_s`` to exit by itself) and close both channels."""
        self._reap(wait_s)
        with self._lock:
            if self._dead is None:
                self._dead = "transfer agent closed"
        for ch in (self._commands, self._events, self._copied_channel):
            if ch is not None:
                ch.close()

    def _reap(self, wait_s: float = 0.0) -> None:
        p = self.process
        if p is None:
            return
        try:
            p.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # stuck in the kernel; the loads are reported all the same
                logger.error("rank %d: transfer agent pid %d did not exit after SIGKILL", self.rank, p.pid)

    # ------------------------------------------------------------------ commands
    def _call(self, cmd: Command, timeout_s: float | None = None) -> Reply:
        """Send one command and wait for its answer; a dead or silent agent raises RuntimeError
        (and is killed: a command left unanswered would pair its reply with the next one)."""
        reply = self._exchange(cmd, COMMAND_S if timeout_s is None else timeout_s, answered=True)
        assert reply is not None
        return reply

    def _send_only(self, cmd: Command) -> None:
        """Send a command the agent does not answer (in order with the others)."""
        self._exchange(cmd, COMMAND_S, answered=False)

    def _exchange(self, cmd: Command, timeout_s: float, answered: bool) -> Reply | None:
        if self._commands is None:
            raise RuntimeError("register_kv_caches first")
        reply = None
        with self._command_lock:
            if self._dead is not None:
                raise RuntimeError(f"rank {self.rank}: {self._dead}")
            try:
                self._commands.send(cmd, timeout_s)
                if answered:
                    reply = self._commands.recv(timeout_s)
                    if reply is None:
                        self._agent_died(f"did not answer {type(cmd).__name__} within {timeout_s:g} s")
            except TimeoutError as e:
                self._agent_died(f"did not read {type(cmd).__name__}: {e}")
            except ChannelClosed as e:
                self._agent_died(f"exited ({e})")
            except BaseException:
                self._agent_died(f"was left mid-command ({type(cmd).__name__}) by an interrupt")
                raise
        if reply is None if answered else self._dead is not None:
            raise RuntimeError(f"rank {self.rank}: {self._dead}")
        return reply

    def _checked(self, reply: Reply) -> Reply:
        if isinstance(reply, Refused):
            raise (ValueError if reply.kind == "value" else RuntimeError)(reply.message)
        return reply

    def _agent_died(self, how: str) -> None:
        """The agent is gone (or made to go): kill it, fail every load it had, and free every
        hold it kept (reported as ``sending``: nobody can read those blocks any more)."""
        with self._lock:
            if self._dead is not None:
                return
            self._dead = "dying"  # no new load or hold is recorded from here on
        p = self.process
        if p is not None and p.poll() is None:
            p.kill()
        self._reap(10.0)
        code = p.returncode if p is not None else None
        why = f"transfer agent (pid {p.pid if p else '?'}) {how}" + (f"; exit code {code}" if code is not None else "")
        with self._lock:
            self._dead = why
            loads, self._loads = self._loads, {}
            for rid, load in loads.items():
                self._fail_locked(rid, load.block_ids, why)
                self._outcome_locked(rid, False)
            self._failed.sending.extend(sorted(self._held))
            self._held.clear()
        if not self._closed:
            logger.error("rank %d: %s; every load on this rank fails from now on", self.rank, why)

    def _outcome_locked(self, rid: str, ok: bool) -> None:
        self._landed.pop(rid, None)
        self._outcomes[rid] = ok
        while len(self._outcomes) > MAX_OUTCOMES:
            self._outcomes.popitem(last=False)

    def _fail_locked(self, rid: str, block_ids: np.ndarray, why: str) -> None:
        self._failed.failed[rid] = block_ids.tolist()
        self._failed.errors[rid] = f"cannot load: {why}"
        self._failed.codes[rid] = ErrorCode.PLANE_BROKEN

    # ------------------------------------------------------------------ producer
    def hold(self, request_id: str, block_ids: Sequence[int] | np.ndarray, num_tokens: int,
             streaming: bool = False) -> KVTransferParams:
        """Pin a prompt's blocks for the decode side; returns what it needs to read them
        (``streaming``: push mode, each layer readable once saved)."""
        if self.cache is None:
            raise RuntimeError("hold: register_kv_caches first")
        ids = np.asarray(block_ids, dtype=np.int64)
        need = -(-num_tokens // self.cache.spec.block_size)
        if ids.ndim != 1 or len(ids) < need:
            raise ValueError(f"request {request_id}: {num_tokens} tokens need {need} blocks, got {len(ids)}")
        if self.device_cache is not None:  # the blocks must be on the host before anyone reads them
            if ids[:need].min() < 0 or ids[:need].max() >= self.cache.num_blocks:
                raise ValueError(f"request {request_id}: block ids must be in [0, {self.cache.num_blocks})")
            if not streaming:
                copy_blocks(self.device_cache, self.cache, ids[:need])
        reply = self._checked(self._call(Hold(request_id, ids.tolist(), num_tokens, streaming)))
        if not isinstance(reply, Held):
            raise RuntimeError(f"rank {self.rank}: transfer agent answered Hold with {type(reply).__name__}")
        with self._lock:
            if self._dead is None:
                self._held.add(request_id)
                if streaming:
                    self._streaming[request_id] = ids[:need]
            else:  # died since: the hold is gone with it
                self._failed.sending.append(request_id)
        return reply.params

    def save_layer(self, request_id: str, layer: int) -> None:
        """Push mode: the forward pass wrote ``layer`` of a streaming hold; its targets read it now.

        One-way: the agent takes it in order with the other commands and does not answer, so a
        layer costs the forward pass one send, not a round trip. The arguments are checked here;
        a hold that expired in the agent meanwhile has nobody left to push to (the agent logs it)."""
        if self.cache is None:
            raise RuntimeError("save_layer: register_kv_caches first")
        layers = self.cache.spec.layers
        if layer not in layers:
            raise ValueError(f"request {request_id}: layer {layer} is not on this rank (layers {layers.start}.."
                             f"{layers.stop - 1})")
        with self._lock:
            ids = self._streaming.get(request_id)
        if ids is None:
            raise ValueError(f"request {request_id} is not a streaming hold of this rank (never held, released, "
                             "or expired)")
        if self.device_cache is not None:
            copy_blocks(self.device_cache, self.cache, ids, layer)
        self._send_only(SaveLayer(request_id, layer))

    def push(self, request_id: str, target: PushTarget) -> None:
        """Push mode: read by ``target`` (a decode side's reservation): saved layers now, the rest as saved."""
        self._checked(self._call(Push(request_id, target)))

    def release(self, request_id: str) -> bool:
        """The engine frees a hold itself (e.g. the request was cancelled)."""
        if self._dead is not None:
            return False
        reply = self._checked(self._call(Release(request_id)))
        with self._lock:
            self._held.discard(request_id)
            self._streaming.pop(request_id, None)
        return isinstance(reply, Done) and reply.value

    # ------------------------------------------------------------------ consumer
    def start_load(self, request_id: str, params: KVTransferParams, local_block_ids: Sequence[int] | np.ndarray,
                   num_cached_tokens: int = 0) -> None:
        """Begin pulling the request's blocks; ``poll`` reports it finished or failed.

        Checked here (a ValueError names what is wrong, nothing changes), then sent one-way: the
        engine's thread does not wait for the agent (a round trip, and on a busy engine a second
        wait for its own GIL). Should the agent still refuse it, the load fails at ``poll``."""
        if self.config.role not in ("decode", "both"):
            raise RuntimeError(f"this rank is a {self.config.role} instance; loading needs role decode or both")
        if self.cache is None:
            raise RuntimeError("start_load: register_kv_caches first")
        ids = checked_load_ids(request_id, params, local_block_ids, num_cached_tokens, self.cache.spec.block_size,
                               self.cache.num_blocks, self.layout)
        with self._lock:  # recorded before the command: its completion may come before the send returns
            if request_id in self._loads:
                raise AlreadyLoading(f"request {request_id} is already loading")
            if self._dead is not None:  # as a broken rank does: the load fails at the next poll
                self._fail_locked(request_id, ids, self._dead)
                return
            self._loads[request_id] = _Load(ids, self.clock() + self.config.connector.timeouts.transfer_s)
        engine = self._engine_loads
        if engine is not None and self._broken is None and engine.fits(ids, num_cached_tokens) \
                and not self._share_burst(engine) and self._copy_here(request_id, params, ids, num_cached_tokens):
            return
        self._switch.want(True)  # before the agent has it: its event may come at once
        try:
            self._send_only(StartLoad(request_id, params, ids.tolist(), num_cached_tokens))
        except RuntimeError:
            with self._lock:  # the agent died around the send: the load fails at the next poll
                load = self._loads.pop(request_id, None)
                if load is not None:
                    self._fail_locked(request_id, load.block_ids, self._dead or "transfer agent gone")

    def _share_burst(self, engine: EngineLoads) -> bool:
        """Whether this load, small enough to copy here, goes to the agent instead: in a burst
        (loads started with no ``poll`` between), once this thread has copied SHARE_AFTER_BYTES in
        it, every other one. The agent's threads then copy one load while this thread copies the
        next, where this thread alone would copy them all in turn. A load started on its own, and a
        step's few small loads, are still copied here. Counted as ``engine_shared_loads``."""
        with self._lock:
            if self._burst_bytes < SHARE_AFTER_BYTES:
                return False
            self._burst_shared = not self._burst_shared
            if self._burst_shared:
                engine.shared += 1
            return self._burst_shared

    def _copy_here(self, request_id: str, params: KVTransferParams, ids: np.ndarray, num_cached_tokens: int) -> bool:
        """A recorded load copied by this thread (engine_loads.py); False: the agent must load it
        (as it must every load once it says it is broken: it fails them, as without copies here)."""
        if self._broken is not None or not self._engine_lock.acquire(blocking=False):
            return False
        started = time.monotonic()
        try:
            engine = self._engine_loads
            got = engine.load(params, ids, num_cached_tokens) if engine is not None else None
        except Exception as e:  # a bug here must not fail a load the agent can make
            report("engine reads", e, f"request {request_id} (loaded by the transfer agent instead)")
            got = None
        except BaseException:  # interrupted: the load never started (the caller gets the exception)
            with self._lock:
                self._loads.pop(request_id, None)
            raise
        finally:
            self._engine_lock.release()
        if got is None:
            return False
        nbytes, planned = got
        copied = time.monotonic()
        with self._lock:
            if self._loads.pop(request_id, None) is None:  # failed meanwhile (the agent died): reported so
                return True
            self._copied.receiving.append(request_id)
            self._copied_at.append(copied)
            self._burst_bytes += nbytes
            self._outcome_locked(request_id, True)
            self._untold.append(EngineCopied(request_id, params, nbytes, started, planned, copied))
        self._tell_copied()
        return True

    def _tell_copied(self) -> None:
        """Tell the agent which loads were copied here (it sends their done notices), on the channel
        it reads with its periodic events; never waits: what the socket has no room for now stays
        in ``_untold`` for the next call (a later load's, or ``poll``). If the agent is gone, or
        ``MAX_UNTOLD`` wait, the producers' holds end at their leases instead (logged)."""
        ch = self._copied_channel
        with self._lock:
            untold, self._untold = self._untold, []
        if not untold:
            return
        why = None
        if ch is None or self._dead is not None:
            why = self._dead or "no agent"
        else:
            try:
                while untold and ch.writable():
                    ch.send(untold[0], COMMAND_S)
                    untold.pop(0)
            except (ChannelClosed, TimeoutError, OSError) as e:
                why = str(e)
        if why is None and len(untold) <= MAX_UNTOLD:
            with self._lock:
                self._untold[:0] = untold
            return
        if why is None:
            why = f"the agent has not read {len(untold)} before them"
        logger.warning("rank %d: %d loads (request %s, ...) were loaded, but their producers are not told (%s); "
                       "their holds end at their leases", self.rank, len(untold), untold[0].request_id, why)

    def reserve(self, request_id: str, local_block_ids: Sequence[int] | np.ndarray, num_tokens: int,
                num_cached_tokens: int = 0) -> PushTarget:
        """Push mode: reserve blocks a prefill instance pushes a prompt into (see Connector.reserve)."""
        if self.config.role not in ("decode", "both"):
            raise RuntimeError(f"this rank is a {self.config.role} instance; loading needs role decode or both")
        ids = np.asarray(local_block_ids, dtype=np.int64)
        need = -(-num_tokens // self.config.cache.block_size)
        t = self.config.connector.timeouts
        with self._lock:
            if request_id in self._loads:
                raise AlreadyLoading(f"request {request_id} is already loading")
            if self._dead is not None:
                raise RuntimeError(f"rank {self.rank}: cannot reserve: {self._dead}")
            self._loads[request_id] = _Load(ids[:need], self.clock() + t.reservation_s)
            self._switch.want(True)
            self._landed[request_id] = set()
            self._outcomes.pop(request_id, None)
        try:
            reply = self._checked(self._call(Reserve(request_id, ids.tolist(), num_tokens, num_cached_tokens)))
        except BaseException:
            with self._lock:
                load = self._loads.pop(request_id, None)
                self._landed.pop(request_id, None)
                if self._dead is not None and load is not None:  # died around it: fails at the next poll
                    self._fail_locked(request_id, load.block_ids, self._dead)
            raise
        if not isinstance(reply, Reserved):
            raise RuntimeError(f"rank {self.rank}: transfer agent answered Reserve with {type(reply).__name__}")
        return reply.target

    def wait_layer(self, request_id: str, layer: int, timeout_s: float) -> bool:
        """Push mode: True once ``layer`` has landed (or the load has); False on failure, an
        unknown request, or ``timeout_s``. Events read meanwhile are reported by the next ``poll``."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.layout.num_layers}, got {layer}")
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            with self._lock:
                landed = self._landed.get(request_id)
                if landed is None:
                    return self._outcomes.get(request_id, False)
                if layer in landed:
                    return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._read_events(min(remaining, 0.05), self._carry)

    def wait(self, request_id: str, params: KVTransferParams) -> None:
        """The request is queued here: renew its producer holds until it is loaded or abandoned."""
        self._consumer_command(Wait(request_id, params))

    def abandon(self, request_id: str, params: KVTransferParams | None, reason: str = "dropped") -> None:
        """The request will not be loaded: the producers free its blocks at once."""
        self._consumer_command(AbandonLoad(request_id, params, reason))

    def _consumer_command(self, cmd: Wait | AbandonLoad) -> None:
        if self.config.role not in ("decode", "both"):
            raise RuntimeError(f"this rank is a {self.config.role} instance; loading needs role decode or both")
        if self._dead is None:
            self._checked(self._call(cmd))

    # ------------------------------------------------------------------ both
    def poll(self, timeout_s: float = 0.0) -> Finished:
        """Holds released, loads finished, loads failed (with their invalid block ids).

        Non-blocking by default; with ``timeout_s``, waits (GIL released) for the agent's next event."""
        out = Finished()
        with self._lock:
            carried, self._carry = self._carry, Finished()
            copied, self._copied = self._copied, Finished()
            copied_at, self._copied_at = self._copied_at, []
            self._burst_bytes, self._burst_shared = 0, False  # the engine polled: the next load starts a burst
        out.extend(carried)
        out.extend(copied)
        if self._untold:
            self._tell_copied()
        if copied_at:
            self.metrics.copied_handed_over(len(copied_at), len(copied_at) * time.monotonic() - sum(copied_at))
        self._read_events(0.0 if carried or copied else timeout_s, out)
        with self._lock:
            if self._failed:
                out.extend(self._failed)
                self._failed = Finished()
            waiting = not timeout_s and bool(self._loads)
            self._switch.want(self._dead is None and bool(self._loads))
        if waiting and not out:
            # an engine that polls in a loop keeps its core busy while its loads need the agent's
            # threads to run: offer the core to them (a system call when nobody else wants it).
            # The GIL is kept: released, a busy thread of the engine would hold it for a switch interval.
            _sched_yield()
        return out

    def _read_events(self, timeout_s: float, out: Finished) -> None:
        """Every event the agent has sent (waiting up to ``timeout_s`` for the first) into ``out``."""
        with self._poll_lock:
            events = self._events
            if events is not None and self._dead is None:
                try:
                    deadline = time.monotonic() + timeout_s
                    ev = events.recv(timeout_s)
                    while ev is not None:
                        self._take(ev, out)
                        ev = events.recv(0.0)
                        if ev is None and not out and (left := deadline - time.monotonic()) > 0:
                            ev = events.recv(left)  # it only named a producer (PeerKnown): wait on
                except ChannelClosed as e:
                    self._agent_died(f"exited ({e})")
                self._check_deadlines()

    def _take(self, ev: Event, out: Finished) -> None:
        """One event into ``out``: only loads still recorded here (one the agent's death already
        failed is not reported twice)."""
        now = time.monotonic()
        if ev.peers and self._engine_loads is not None:
            with self._engine_lock:
                for p in ev.peers:
                    try:
                        if self._engine_loads is not None:
                            self._engine_loads.learn(p.engine_id, p.meta)
                    except Exception as e:  # its loads go to the agent, as they did
                        report("engine reads", e, f"producer {p.engine_id} rank {p.meta.rank} (read by the agent)")
        with self._lock:
            done = [(rid, self._loads.pop(rid)) for rid in ev.receiving if rid in self._loads]
            failed = [rid for rid in ev.failed if self._loads.pop(rid, None) is not None]
            self._held.difference_update(ev.sending)
            for rid in ev.sending:
                self._streaming.pop(rid, None)
            self._broken = ev.broken
            for rid, layers in ev.layers.items():
                if rid in self._landed:
                    self._landed[rid].update(layers)
                    out.layers.setdefault(rid, []).extend(layers)
            for rid, _ in done:
                self._outcome_locked(rid, True)
            for rid in failed:
                self._outcome_locked(rid, False)
        for rid, load in done:
            if self.device_cache is not None and self.cache is not None:
                try:
                    copy_blocks(self.cache, self.device_cache, load.block_ids)
                except Exception as e:  # the bytes came but cannot reach the device: this load fails
                    out.failed[rid] = load.block_ids.tolist()
                    out.errors[rid] = f"copying the loaded blocks to {self.device_cache.device} failed: {e}"
                    out.codes[rid] = ErrorCode.INTERNAL
                    continue
            out.receiving.append(rid)
        for rid in failed:
            out.failed[rid] = list(ev.failed[rid])
            out.errors[rid] = ev.errors.get(rid, "")
            out.codes[rid] = ev.codes.get(rid, ErrorCode.INTERNAL)
        out.sending.extend(ev.sending)
        n = len(done) + len(failed)
        self.metrics.handed_over(n, (now - ev.sent_at) * n)
        if n and logger.isEnabledFor(logging.DEBUG):
            logger.debug("%d load(s) handed to the engine at %.6f, %.2f ms after the agent sent them: %s", n, now,
                         (now - ev.sent_at) * 1e3, [rid for rid, _ in done] + failed)

    def _check_deadlines(self) -> None:
        now = self.clock()
        with self._lock:
            late = [rid for rid, load in self._loads.items() if now > load.deadline + AGENT_GRACE_S]
        if late:
            self._agent_died(f"held load {late[0]} past its deadline by {AGENT_GRACE_S:g} s (killed)")

    def stats(self) -> dict[str, float]:
        """Counters of this rank's connector, from its agent (see :class:`ConnectorMetrics`)."""
        return self.metrics.snapshot()

    def _fetch_stats(self) -> Stats | None:
        if self._dead is not None or self._commands is None:
            return None
        try:
            reply = self._call(GetStats())
        except RuntimeError:
            return None
        return reply if isinstance(reply, Stats) else None

    @property
    def broken(self) -> str | None:
        """Why this rank cannot load any more, or None while it can."""
        return self._dead or self._broken
