"""The transfer agent: one process per engine rank that owns the rank's data path.

The agent runs the rank's :class:`kvxfer.connector.Connector` (side channel, consumer worker,
data plane, holds) over the engine's cache, mapped from shared memory. Every byte moves on
the agent's threads, under the agent's own GIL: an engine whose Python is busy does not slow
its transfers, and the engine spends a command round trip per request, not a GIL hand-off
per piece. The agent exits when its engine closes the command channel (or dies).

Threads: the main thread answers commands, in order (``SaveLayer`` and ``StartLoad`` are one-way:
no answer; a load refused here is reported failed through the events; loads queued back to back
are started as one burst, so the connector can copy them together); the event thread waits for
the connector to finish something and sends it. Both send events through ``_flush``, under
``_events_lock`` (one sender, events in order; ``_pending`` and ``_broken`` are its): the main
thread right after a ``StartLoad`` (after the last of a burst of them already sent), so a load the
consumer's fast path finished there goes out at once, with no hand-off to the event thread; the
consumer's worker thread, likewise, after a turn that finished loads (``worker_takes_done``). Refused
loads wait in ``_refused`` (``_refused_lock``).
Nothing else in the process touches the channels.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import msgspec

from kvxfer.agent.channel import Channel, ChannelClosed
from kvxfer.agent.messages import (
    AbandonLoad,
    Close,
    Command,
    Done,
    Event,
    GetStats,
    Held,
    HistogramState,
    Hold,
    PeerKnown,
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
from kvxfer.agent.priority import set_nice
from kvxfer.agent.shared import map_cache
from kvxfer.cache.spec import spec_from_config
from kvxfer.config import InstanceConfig, convert
from kvxfer.connector import Connector
from kvxfer.metrics import Histogram
from kvxfer.protocol import ErrorCode, HandshakeResponse
from kvxfer.supervise import code_of, describe, report
from kvxfer.threads import NamedThread
from kvxfer.transfer.aggregator import Finished
from kvxfer.transfer.load import EngineCopied

logger = logging.getLogger(__name__)

START_WAIT_S = 60.0  # the engine sends Start right after spawning us
EVENT_WAIT_S = 0.02  # the event thread's longest sleep: hold releases and lease expiry run this often
PARENT_CHECK_S = 1.0  # the agent checks this often that its engine is still its parent
MAX_BURST = 64  # loads queued back to back that are started together


def _hist(h: Histogram) -> HistogramState:
    return HistogramState(counts=list(h.counts), sum=h.sum, count=h.count)


class Agent:
    """One rank's connector, driven over two channels by its engine (see the module doc)."""

    def __init__(self, commands: Channel, events: Channel, copied: Channel | None = None) -> None:
        self.commands = commands
        self.events = events
        self.copied = copied  # EngineCopied, from the engine: read under _copied_lock (_take_copied)
        self._copied_lock = threading.Lock()
        self.conn: Connector | None = None
        self._stop = threading.Event()
        self._broken: str | None = None
        self._refused = Finished()  # one-way loads the connector refused: sent as failed with the next events
        self._refused_lock = threading.Lock()
        self._events_lock = threading.Lock()
        self._pending = Finished()  # what poll gave and no send has carried yet
        self._new_peers: list[PeerKnown] = []  # producer ranks handshaken since the last event (_refused_lock)
        self.parent = os.getppid()
        self._channel_closed = False  # the main thread's: a receive inside a burst found the channel closed

    def run(self) -> int:
        start = self.commands.recv(START_WAIT_S)
        if not isinstance(start, Start):
            logger.error("transfer agent: expected Start from the engine within %g s, got %s", START_WAIT_S,
                         "nothing" if start is None else type(start).__name__)
            return 2
        try:
            self.conn = self._start(start)
        except (ValueError, RuntimeError, OSError) as e:
            logger.error("transfer agent: cannot start: %s", e)
            self.commands.send(Refused(kind="value" if isinstance(e, ValueError) else "runtime", message=str(e)))
            return 1
        conn = self.conn
        if conn.consumer is not None:
            conn.consumer.caller_takes_done = True  # _flush_now sends what a load finished at once
            conn.consumer.worker_takes_done = self._flush_from_worker  # and the worker what it finished
            conn.consumer.peers.on_new = self._peer_known  # the engine may read them itself (EngineReads)
        self.commands.send(Ready(port=conn.side_channel_port, generation=conn.generation, plane=conn.plane.name))
        notifier = NamedThread(target=self._send_events, name=f"kvxfer-agent-events-{conn.rank}", daemon=True)
        notifier.start()
        unsent = False  # loads started since the last _flush_now
        cmd: Command | None = None
        try:
            while True:
                try:
                    if cmd is None:  # else: the command that ended a burst of loads, taken next
                        cmd = self.commands.recv(PARENT_CHECK_S)
                except ChannelClosed:
                    logger.info("transfer agent rank %d: the engine closed the channel; exiting", conn.rank)
                    break
                if os.getppid() != self.parent:  # a child the engine forked may hold its end open
                    logger.warning("transfer agent rank %d: the engine (pid %d) is gone; exiting", conn.rank,
                                   self.parent)
                    break
                if isinstance(cmd, Close):
                    self._stop.set()
                    notifier.join(timeout=5)
                    conn.close()
                    self.conn = None
                    self.commands.send(Done())
                    break
                if isinstance(cmd, SaveLayer):  # one-way: the engine does not wait for an answer
                    self._save_layer(cmd)
                elif isinstance(cmd, StartLoad):  # one-way too
                    cmd = self._start_loads(cmd)
                    unsent = True
                    if self._channel_closed:
                        logger.info("transfer agent rank %d: the command channel closed; exiting", conn.rank)
                        break
                    if cmd is not None:  # what ended the burst: answered next
                        continue
                elif cmd is not None:
                    self._reply(self._answer(cmd))
                cmd = None
                if unsent and not self.commands.has_next():  # a burst of loads: their events go out as one
                    self._flush_now()
                    unsent = False
        finally:
            self._stop.set()
            if self.conn is not None:
                self.conn.close()
        return 0

    def _reply(self, reply: Reply) -> None:
        try:
            self.commands.send(reply)
        except ChannelClosed:
            pass  # the engine is gone; the next receive ends the loop

    def _start(self, start: Start) -> Connector:
        for p in start.sys_path:
            if p not in sys.path:
                sys.path.append(p)
        cfg = convert(start.config, InstanceConfig, "<engine's config>")
        set_nice(cfg.connector.agent_nice)  # before the connector starts its threads: they inherit it
        # The engine stages device caches itself; here the cache is the engine's host memory.
        cfg = msgspec.structs.replace(
            cfg, connector=msgspec.structs.replace(cfg.connector, data_path="engine", host_staging="never"))
        pp_rank = start.rank // cfg.parallel.tp
        cache = map_cache(spec_from_config(cfg, pp_rank), start.num_blocks, start.tensors)
        conn = Connector.in_process(cfg, start.rank)
        try:
            conn.register_kv_caches(cache)
        except BaseException:
            conn.close()
            raise
        return conn

    def _answer(self, cmd: Command) -> Reply:
        conn = self.conn
        assert conn is not None
        try:
            if isinstance(cmd, Hold):
                return Held(params=conn.hold(cmd.request_id, cmd.block_ids, cmd.num_tokens, cmd.streaming))
            if isinstance(cmd, Push):
                conn.push(cmd.request_id, cmd.target)
                return Done()
            if isinstance(cmd, Reserve):
                return Reserved(target=conn.reserve(cmd.request_id, cmd.local_block_ids, cmd.num_tokens,
                                                    cmd.num_cached_tokens))
            if isinstance(cmd, Release):
                return Done(value=conn.release(cmd.request_id))
            if isinstance(cmd, Wait):
                conn.wait(cmd.request_id, cmd.params)
                return Done()
            if isinstance(cmd, AbandonLoad):
                conn.abandon(cmd.request_id, cmd.params, cmd.reason)
                return Done()
            if isinstance(cmd, GetStats):
                self._take_copied()
                m = conn.metrics
                snap = conn.stats()
                with m._lock:
                    return Stats(snapshot=snap, failed_by_code=dict(m.failed_by_code),
                                 handshake=_hist(m.handshake_latency), transfer=_hist(m.transfer_latency),
                                 broken=conn.broken)
            return Refused(kind="runtime", message=f"{type(cmd).__name__} is not a command the agent answers")
        except ValueError as e:
            return Refused(kind="value", message=str(e))
        except Exception as e:  # the command failed in the agent: the engine raises it; we go on
            report(f"agent command {type(cmd).__name__}", e, "the command (refused)")
            return Refused(kind="runtime", message=f"{type(e).__name__}: {e}")

    def _save_layer(self, cmd: SaveLayer) -> None:
        """A saved layer; nobody waits for an answer. The engine checked the arguments, so a
        refusal here means the hold ended meanwhile (expired or abandoned): nothing to push."""
        assert self.conn is not None
        try:
            self.conn.save_layer(cmd.request_id, cmd.layer)
        except ValueError as e:
            logger.info("transfer agent rank %d: layer %d of request %s not pushed: %s", self.conn.rank, cmd.layer,
                        cmd.request_id, e)
        except Exception as e:
            report("agent command SaveLayer", e, "that layer's push notice (the reads of the hold end at its lease)")

    def _start_loads(self, first: StartLoad) -> Command | None:
        """``first`` and every load queued right behind it, started together (the connector
        copies a burst of small cma loads in one cut); returns the command that ended the burst,
        if one is waiting. Loads are one-way: the engine checked their arguments and counts them
        loading, so one the connector refuses anyway is reported failed, with its block ids, by
        the next events."""
        assert self.conn is not None
        burst, after = [first], None
        while len(burst) < MAX_BURST and self.commands.has_next():
            try:
                nxt = self.commands.recv(0)
            except ChannelClosed:  # closed, or a frame that does not decode (dropped): the loop ends
                self._channel_closed = True
                break
            if not isinstance(nxt, StartLoad):
                after = nxt
                break
            burst.append(nxt)
        try:
            if len(burst) == 1:
                errors: list[Exception | None] = [None]
                try:
                    self.conn.start_load(first.request_id, first.params, first.local_block_ids,
                                         first.num_cached_tokens)
                except Exception as e:
                    errors = [e]
            else:
                errors = self.conn.start_loads([(c.request_id, c.params, c.local_block_ids, c.num_cached_tokens)
                                                for c in burst])
        except Exception as e:  # a bug in start_loads itself: every load of the burst fails
            errors = [e] * len(burst)
        for cmd, err in zip(burst, errors, strict=True):
            if err is not None:
                self._refuse_load(cmd, err)
        return after

    def _take_copied(self) -> None:
        """Loads the engine copied itself (``EngineCopied`` on the copied channel), passed on together:
        the event thread takes them each turn, so their done notices go out together (one round
        trip to each producer every EVENT_WAIT_S at most, not a chain of wake-ups in both agents
        per load while the engine's next load wants the CPU); ``GetStats`` takes them first, so
        the engine's counters include every load it has seen finish."""
        conn = self.conn
        if conn is None or conn.consumer is None:
            return
        copied: list[EngineCopied] = []
        with self._copied_lock:
            try:
                while self.copied is not None and self.copied.has_next():
                    m = self.copied.recv(0)
                    if isinstance(m, EngineCopied):
                        copied.append(m)
            except ChannelClosed as e:  # the engine is gone (the command loop ends us) or sent garbage
                logger.warning("transfer agent rank %d: the copied channel closed (%s); loads the engine copies "
                               "from now on are not told to their producers (their holds end at their leases)",
                               conn.rank, e)
                self.copied = None
        if copied:
            conn.consumer.loaded_by_engine(copied)

    def _peer_known(self, engine_id: str, meta: HandshakeResponse) -> None:
        """A producer rank newly handshaken (the consumer's turn-lock holder): sent with the next event."""
        with self._refused_lock:
            self._new_peers.append(PeerKnown(engine_id=engine_id, meta=meta))

    def _refuse_load(self, cmd: StartLoad, e: Exception) -> None:
        code = ErrorCode.BAD_PARAMS if isinstance(e, ValueError) else code_of(e)
        if not isinstance(e, ValueError):
            report("agent command StartLoad", e, f"request {cmd.request_id} (failed)")
        with self._refused_lock:
            self._refused.failed[cmd.request_id] = list(cmd.local_block_ids)
            self._refused.errors[cmd.request_id] = f"the transfer agent refused the load: {describe(e)}"
            self._refused.codes[cmd.request_id] = code

    def _flush(self, wait: bool = True) -> bool:
        """Send what finished, refused loads and a change of ``broken`` as one Event (if any).
        ``wait=False`` (the main thread): not if the event thread is sending, or the engine has
        not read enough to leave room; False then (the event thread must send it)."""
        conn = self.conn
        assert conn is not None
        if not self._events_lock.acquire(blocking=wait):
            return False
        try:
            if not wait and not self.events.writable():
                return False  # the main thread must not block on an engine that does not poll: commands wait
            self._pending.extend(conn.poll(0.0))
            with self._refused_lock:
                if self._refused:
                    self._pending.extend(self._refused)
                    self._refused = Finished()
                peers, self._new_peers = self._new_peers, []
            broken = conn.broken
            if self._pending or broken != self._broken or peers:
                self._broken = broken
                p = self._pending
                sent_at = time.monotonic()
                try:
                    self.events.send(Event(sending=p.sending, receiving=p.receiving, failed=p.failed,
                                           errors=p.errors, codes=p.codes, broken=broken, sent_at=sent_at,
                                           layers=p.layers, peers=peers))
                except BaseException:
                    with self._refused_lock:  # not sent: they go with the next event
                        self._new_peers[:0] = peers
                    raise
                if (p.receiving or p.failed) and logger.isEnabledFor(logging.DEBUG):
                    logger.debug("event sent at %.6f (%s): %s", sent_at, threading.current_thread().name,
                                 p.receiving + list(p.failed))
                self._pending = Finished()
            return True
        finally:
            self._events_lock.release()

    def _flush_now(self) -> None:
        """The main thread, after a load: send it if it finished already (the fast path, which
        leaves the event thread asleep); if this thread cannot, it wakes the event thread."""
        conn = self.conn
        if conn is None or conn.consumer is None or not conn.consumer.wait_ready(0.0):
            return
        sent = False
        try:
            sent = self._flush(wait=False)
        except ChannelClosed:
            pass  # the engine is gone; the next receive ends the loop
        except Exception as e:  # kept in _pending: the event thread sends it with its next turn
            report("agent events", e, "sending after a load")
        if not sent:
            conn.consumer.wake_waiters()

    def _flush_from_worker(self) -> bool:
        """The consumer's worker, after a turn that finished loads: send them from there, not
        through the event thread (a thread hand-off less per load). False: the event thread must."""
        try:
            return self._flush(wait=False)
        except ChannelClosed:
            return True  # the engine is gone: nobody to send to

    def _send_events(self) -> None:
        conn = self.conn
        assert conn is not None
        while not self._stop.is_set():
            try:
                if conn.consumer is not None:
                    conn.consumer.wait_ready(EVENT_WAIT_S)
                else:
                    self._stop.wait(EVENT_WAIT_S)
                self._flush()
                self._take_copied()
            except ChannelClosed:
                return
            except Exception as e:  # kept in _pending; sent with the next turn's
                report("agent events", e, "one poll")
                self._stop.wait(EVENT_WAIT_S)


_IN_AGENT = False  # set by main: this process is a transfer agent


def in_agent() -> bool:
    """Whether this process is a transfer agent, whose only Python is kvxfer's (planes may then
    spend its GIL on progress threads an engine's process could not give them)."""
    return _IN_AGENT


def main(argv: list[str]) -> int:
    import socket

    global _IN_AGENT
    _IN_AGENT = True

    if len(argv) != 3:
        print("usage: python -m kvxfer.agent COMMAND_FD EVENT_FD COPIED_FD (started by the engine's connector)",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the engine, which then stops us
    commands = Channel(socket.socket(fileno=int(argv[0])), Command)
    events = Channel(socket.socket(fileno=int(argv[1])), Event)
    copied = Channel(socket.socket(fileno=int(argv[2])), EngineCopied)
    return Agent(commands, events, copied).run()


__all__ = ["Agent", "Event", "in_agent", "main"]
