"""The engine's side of a transfer agent: the ``Connector`` API, carried out in the agent.

``Connector.from_config`` returns an :class:`AgentConnector` when ``connector.data_path`` is
``agent`` (or ``auto`` with a data plane that can live in another process). The engine's
thread spends one command round trip per request (the agent checks it and answers at once)
and a non-blocking read of the event channel per ``poll``; the bytes move in the agent.

A dead or hung agent never hangs the engine: every command has a time limit; an agent that
exits, or holds a load past its deadline plus ``AGENT_GRACE_S``, is killed and reported
(``broken``), and every load it had fails with its block ids at the next ``poll``.

Threads: the engine's threads call in, no thread of its own. ``AgentCommands`` orders
commands (one in flight); ``_poll_lock`` makes one ``poll`` at a time (it owns the event
channel); ``_lock`` guards the loads, holds, pending failures and ``_dead``, and is never held
across a blocking call. Lock order: ``_poll_lock``, then ``_lock``, then the ``EngineCopies``' own
(a load moves from ``_loads`` to the copied ones in one step under both).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import msgspec
import numpy as np

from kvxfer.agent.channel import Channel, ChannelClosed
from kvxfer.agent.commands import COMMAND_S, AgentCommands, checked
from kvxfer.agent.engine_copies import Deferred, EngineCopies
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
from kvxfer.agent.metrics import AgentMetrics
from kvxfer.agent.shared import share_tensors
from kvxfer.agent.spawn import reap_agent, spawn_agent
from kvxfer.cache.staging import copy_blocks, mirror_of, pin_for, unpin
from kvxfer.cache.tensors import KVCache
from kvxfer.config import InstanceConfig
from kvxfer.connector import check_cache, check_rank
from kvxfer.protocol import ErrorCode, KVTransferParams, PushTarget
from kvxfer.switch_interval import SwitchInterval
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.aggregator import Finished
from kvxfer.transfer.consumer import AlreadyLoading
from kvxfer.transfer.load import checked_load_ids

logger = logging.getLogger(__name__)

_sched_yield = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6").sched_yield  # PyDLL: keeps the GIL

AGENT_START_S = 120.0  # spawn, import, map the cache, register, bind the side channel
# past a load's deadline the agent itself fails it; this much later, we do (kill it: hung). Generous: an
# agent starved of CPU on a loaded host (seen with a load average of 50 on 2 cores) is late, not hung
AGENT_GRACE_S = 15.0
MAX_OUTCOMES = 4096  # finished loads whose outcome wait_layer still answers


@dataclass
class _Load:
    """A load the agent is carrying out: its local blocks, and when it must have finished."""

    block_ids: np.ndarray
    deadline: float


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
        self._commands: AgentCommands | None = None
        self._events: Channel | None = None
        self._copied_channel: Channel | None = None
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
        self._engine_copies: EngineCopies | None = None  # small loads this process copies itself
        self._dead: str | None = None  # why the agent is gone
        self._closed = False
        # the interpreter's switch interval, short while loads are in flight (switch_interval.py)
        self._switch = SwitchInterval(config.connector.gil_switch_interval_s,
                                       config.connector.gil_wait_switch_interval_s)

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
        try:
            self.process, commands, self._events, self._copied_channel = spawn_agent(self.config, shared)
            self._commands = AgentCommands(commands, self.rank, self._why_dead, self._agent_died)
        except OSError as e:
            self._teardown()
            unpin(cache)
            raise RuntimeError(f"rank {self.rank}: cannot start the transfer agent: {e}") from None
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
        self._engine_copies = EngineCopies.for_rank(self.config, self.rank, cache) \
            if self.device_cache is None else None  # a staged load must be copied to the device: the agent's
        logger.info("rank %d: transfer agent pid %d serves the side channel on port %d (%s)", self.rank,
                    self.process.pid, reply.port, reply.plane)

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
        with self._lock:  # copied loads not polled yet: the next poll still reports them
            copies, self._engine_copies = self._engine_copies, None
            if copies is not None:
                self._carry.extend(copies.take()[0])
                for d in copies.take_deferred():  # left for a poll that will not copy them: failed
                    if self._loads.pop(d.request_id, None) is not None:
                        self._fail_locked(d.request_id, d.block_ids, "the connector was closed")
        if copies is not None:
            copies.close()
        if self.cache is not None:
            unpin(self.cache)  # the host mirror's pinning (a device cache's), once the agent is gone

    def _teardown(self, wait_s: float = 0.0) -> None:
        """Stop the agent (given ``wait_s`` to exit by itself) and close both channels."""
        reap_agent(self.process, wait_s, self.rank)
        with self._lock:
            if self._dead is None:
                self._dead = "transfer agent closed"
        for ch in (self._commands, self._events, self._copied_channel):
            if ch is not None:
                ch.close()

    # ------------------------------------------------------------------ commands
    def _call(self, cmd: Command, timeout_s: float = COMMAND_S) -> Reply:
        if self._commands is None:
            raise RuntimeError("register_kv_caches first")
        return self._commands.call(cmd, timeout_s)

    def _send_only(self, cmd: Command) -> None:
        if self._commands is None:
            raise RuntimeError("register_kv_caches first")
        self._commands.send_only(cmd)

    def _why_dead(self) -> str | None:
        return self._dead

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
        reap_agent(p, 10.0, self.rank)
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
        reply = checked(self._call(Hold(request_id, ids.tolist(), num_tokens, streaming)))
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
        checked(self._call(Push(request_id, target)))

    def release(self, request_id: str) -> bool:
        """The engine frees a hold itself (e.g. the request was cancelled)."""
        if self._dead is not None:
            return False
        reply = checked(self._call(Release(request_id)))
        with self._lock:
            self._held.discard(request_id)
            self._streaming.pop(request_id, None)
        return isinstance(reply, Done) and reply.value

    # ------------------------------------------------------------------ consumer
    def start_load(self, request_id: str, params: KVTransferParams, local_block_ids: Sequence[int] | np.ndarray,
                   num_cached_tokens: int = 0) -> None:
        """Begin pulling the request's blocks; ``poll`` reports it finished or failed.

        Checked here (a ValueError names what is wrong, nothing changes), then copied here (a small
        load from a producer this process can read: ``EngineCopies``; in a large burst, half of
        them at the next ``poll``) or sent one-way: the engine's thread does not wait for the agent
        (a round trip, and on a busy engine a second wait for its own GIL). Should the agent still
        refuse it, the load fails at ``poll``."""
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
        # short from here until the poll that reports the load: a copy here waits for the GIL too
        # (after a busy thread of the engine took it), and the agent's event may come at once
        self._switch.want(True)
        copies = self._engine_copies
        if copies is not None and self._broken is None and copies.fits(ids, num_cached_tokens):
            where = copies.share_burst()
            if where == "later":
                copies.defer(Deferred(request_id, params, ids.copy(), num_cached_tokens))  # the caller's may change
                return
            if where == "now" and self._copy_here(copies, request_id, params, ids, num_cached_tokens):
                return
        self._to_agent(request_id, params, ids, num_cached_tokens)

    def _to_agent(self, request_id: str, params: KVTransferParams, ids: np.ndarray, num_cached_tokens: int) -> None:
        """A recorded load, sent to the agent (one-way: it fails at ``poll`` if the agent is gone)."""
        try:
            self._send_only(StartLoad(request_id, params, ids.tolist(), num_cached_tokens))
        except RuntimeError:
            with self._lock:  # the agent died around the send: the load fails at the next poll
                load = self._loads.pop(request_id, None)
                if load is not None:
                    self._fail_locked(request_id, load.block_ids, self._dead or "transfer agent gone")

    def _copy_deferred(self, copies: EngineCopies) -> None:
        """The loads a shared burst left for this ``poll`` (``EngineCopies.share_burst``): copied
        here, or sent to the agent if they cannot be. One failed meanwhile (the agent died: it is
        reported failed, and its blocks may be the engine's again once it is) is left alone."""
        deferred = copies.take_deferred()
        for i, d in enumerate(deferred):
            with self._lock:
                load = self._loads.get(d.request_id)
                if load is None:
                    continue
            try:
                if self._copy_here(copies, d.request_id, d.params, d.block_ids, d.num_cached_tokens):
                    continue
            except BaseException:  # interrupted mid-copy: this load fails (its blocks may be half written)
                with self._lock:
                    self._fail_locked(d.request_id, d.block_ids, "its copy was interrupted")
                    self._outcome_locked(d.request_id, False)
                copies.requeue(deferred[i + 1:])  # the rest: at the next poll
                raise
            with self._lock:  # the agent has it from now: its own time limit starts now too
                load.deadline = self.clock() + self.config.connector.timeouts.transfer_s
            self._to_agent(d.request_id, d.params, d.block_ids, d.num_cached_tokens)

    def _copy_here(self, copies: EngineCopies, request_id: str, params: KVTransferParams, ids: np.ndarray,
                   num_cached_tokens: int) -> bool:
        """A recorded load copied by this thread (engine_copies.py); False: the agent must load it
        (as it must every load once it says it is broken: it fails them, as without copies here)."""
        if self._broken is not None:
            return False
        try:
            copied = copies.copy(request_id, params, ids, num_cached_tokens)
        except BaseException:  # interrupted: the load never started (the caller gets the exception)
            with self._lock:
                self._loads.pop(request_id, None)
            raise
        if copied is None:
            return False
        with self._lock:  # one step: the load is in _loads or in the copies, for any poll
            if self._loads.pop(request_id, None) is None:  # failed meanwhile (the agent died): reported so
                return True
            self._outcome_locked(request_id, True)
            copies.copied(copied)
        copies.tell(self._copied_channel, self._dead)
        return True

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
            reply = checked(self._call(Reserve(request_id, ids.tolist(), num_tokens, num_cached_tokens)))
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
            checked(self._call(cmd))

    # ------------------------------------------------------------------ both
    def poll(self, timeout_s: float = 0.0) -> Finished:
        """Holds released, loads finished, loads failed (with their invalid block ids).

        Non-blocking by default; with ``timeout_s``, waits (GIL released) for the agent's next event.
        Loads a burst left for it (``EngineCopies.share_burst``) are copied first, the GIL kept
        (milliseconds for megabytes)."""
        out = Finished()
        if self._engine_copies is not None:
            with self._poll_lock:  # one poll at a time copies, as one reads events
                self._copy_deferred(self._engine_copies)
        with self._lock:
            carried, self._carry = self._carry, Finished()
            copies = self._engine_copies
            copied, copied_at = copies.take() if copies is not None else (Finished(), [])
        out.extend(carried)
        out.extend(copied)
        if copies is not None and copies.untold:
            copies.tell(self._copied_channel, self._dead)
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
                    ev = self._wait_event(events, timeout_s)
                    while ev is not None:
                        self._take(ev, out)
                        ev = events.recv(0.0)
                        if ev is None and not out and (left := deadline - time.monotonic()) > 0:
                            ev = self._wait_event(events, left)  # it only named a producer (PeerKnown): wait on
                except ChannelClosed as e:
                    self._agent_died(f"exited ({e})")
                self._check_deadlines()

    def _wait_event(self, events: Channel, timeout_s: float) -> Event | None:
        """The agent's next event within ``timeout_s``; a wait with loads in flight has the wait's
        switch interval (switch_interval.py): the event's thread gets the GIL soon after it asks."""
        if timeout_s <= 0:
            return cast("Event | None", events.recv(0.0))
        with self._switch.waiting():
            return cast("Event | None", events.recv(timeout_s))

    def _take(self, ev: Event, out: Finished) -> None:
        """One event into ``out``: only loads still recorded here (one the agent's death already
        failed is not reported twice)."""
        now = time.monotonic()
        copies = self._engine_copies
        if ev.peers and copies is not None:
            copies.learn(ev.peers)
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
