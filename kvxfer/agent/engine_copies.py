"""The loads an engine's thread copies itself, as its :class:`~kvxfer.agent.client.AgentConnector`
tracks them: copied and not yet handed to ``poll``, copied and not yet told to the agent (which
sends their producers' done notices), left for the next ``poll`` to copy, and the burst they
belong to.

The copying is :class:`~kvxfer.agent.engine_loads.EngineLoads`'; this module is its bookkeeping,
kept apart from the connector's own (the loads in the agent, the holds, the agent's life).

Threads: the engine's. ``_copy_lock`` lets one thread copy at a time (another thread's load
goes to the agent meanwhile); ``_lock`` guards the copied loads, the untold ones, the deferred
ones and the burst, and is never held across a copy or a send. The connector calls ``copied`` and ``take`` under its
own lock (taken first: this class never takes the connector's).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvxfer.agent.channel import Channel, ChannelClosed
from kvxfer.agent.engine_loads import EngineLoads
from kvxfer.agent.messages import PeerKnown
from kvxfer.cache.tensors import KVCache
from kvxfer.config import InstanceConfig
from kvxfer.connector import check_rank
from kvxfer.dataplane import load_data_plane
from kvxfer.protocol import KVTransferParams
from kvxfer.supervise import report
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.aggregator import Finished
from kvxfer.transfer.load import EngineCopied
from kvxfer.transfer.planner import SideLayout

logger = logging.getLogger(__name__)

# in a burst of loads (no poll between), the engine's thread copies this many bytes before it gives
# every other load it could copy to the agent (share_burst): a step's few small loads stay the
# engine's (the agent's round trip would report them a poll later), a burst of many is copied on
# both sides at once
SHARE_AFTER_BYTES = 8 << 20
MAX_UNTOLD = 65536  # copied loads kept for an agent that reads none of them (stuck): then given up (logged)
ENGINE_COUNTERS = ("engine_copied_loads", "engine_passed_loads", "engine_shared_loads", "engine_later_loads",
                   "engine_producers")
SEND_S = 30.0  # a send on the copied channel, which is only tried when the socket has room


@dataclass
class Deferred:
    """A checked, recorded load this rank copies at the next ``poll`` (``EngineCopies.share_burst``)."""

    request_id: str
    params: KVTransferParams
    block_ids: np.ndarray
    num_cached_tokens: int


class EngineCopies:
    """The engine's own copies of one rank (see the module doc)."""

    def __init__(self, loads: EngineLoads, rank: int) -> None:
        self.loads = loads
        self.rank = rank
        self._copy_lock = threading.Lock()
        self._lock = threading.Lock()
        self._copied = Finished()  # copied, reported at the next poll
        self._copied_at: list[float] = []  # when each was copied (the handoff stage)
        self._untold: list[EngineCopied] = []  # copied, the agent not sent them yet (tell)
        # a burst: loads started with no poll between. Bytes copied here in it, and whether the
        # last load shared since SHARE_AFTER_BYTES went to the agent (the next waits for poll)
        self._burst_bytes = 0
        self._burst_shared = False
        self._closed = False
        self._deferred: list[Deferred] = []  # loads of a shared burst left for the next poll (share_burst)
        self.shared_loads = 0  # loads of a burst given to the agent although they could be copied here
        self.later_loads = 0  # loads of a burst left for the next poll

    @classmethod
    def for_rank(cls, config: InstanceConfig, rank: int, cache: KVCache) -> EngineCopies | None:
        """The copies of a decode rank whose plane reads one-sided (``DataPlane.engine_reads``:
        cma) in pull mode with ``engine_copy_bytes``; else None (the agent loads everything). The
        caller makes none for a staged cache (a load must reach the device: the agent's)."""
        conn = config.connector
        if config.role not in ("decode", "both") or conn.engine_copy_bytes == 0 or conn.mode != "pull":
            return None
        try:
            reads = load_data_plane(conn.name).engine_reads(conn.data_plane, cache.regions)
        except Exception as e:  # the agent loads everything, as without copies here
            report("engine reads", e, f"rank {rank}: the transfer agent loads every request")
            return None
        if reads is None:
            return None
        layout = ParallelLayout.from_config(config)
        tp_rank, pp_rank = check_rank(config, rank)
        loads = EngineLoads(reads, layout, tp_rank, pp_rank, SideLayout.from_cache(cache), conn.engine_copy_bytes,
                            cache.spec.bytes_per_block, conn.engine_copy_release_gil_bytes or None)
        return cls(loads, rank)

    def fits(self, block_ids: np.ndarray, num_cached_tokens: int) -> bool:
        return self.loads.fits(block_ids, num_cached_tokens)

    def share_burst(self) -> Literal["now", "agent", "later"]:
        """Where this load, small enough to copy here, goes: ``now`` (copied in ``start_load``),
        ``agent``, or ``later`` (copied at the next ``poll``). In a burst (loads started with no
        ``poll`` between), once this rank has copied SHARE_AFTER_BYTES in it, every other load goes
        to the agent and the others wait for ``poll``: the agent has all of its share from the
        start and copies it while ``poll`` copies the rest, where copied in ``start_load`` each
        would hold back the agent's next one. A load started on its own, and a step's few small
        loads, are still copied at once. Counted as ``engine_shared_loads`` (the agent's) and
        ``engine_later_loads``."""
        with self._lock:
            if self._burst_bytes < SHARE_AFTER_BYTES:
                return "now"
            self._burst_shared = not self._burst_shared
            if self._burst_shared:
                self.shared_loads += 1
                return "agent"
            self.later_loads += 1
            return "later"

    def defer(self, load: Deferred) -> None:
        """``load`` is copied at the next ``poll`` (``take_deferred``)."""
        with self._lock:
            self._deferred.append(load)

    def requeue(self, loads: list[Deferred]) -> None:
        """``loads`` (taken, not copied) wait for the next ``poll`` again, first."""
        with self._lock:
            self._deferred[:0] = loads

    def take_deferred(self) -> list[Deferred]:
        with self._lock:
            deferred, self._deferred = self._deferred, []
        return deferred

    def copy(self, request_id: str, params: KVTransferParams, ids: np.ndarray,
             num_cached_tokens: int) -> EngineCopied | None:
        """Copy a checked load now; None: the agent must load it (another thread is copying, the
        load is not one this rank copies, or copying it failed: a bug here must not fail a load
        the agent can make). An interrupt propagates (the load never started)."""
        if not self._copy_lock.acquire(blocking=False):
            return None
        if self._closed:
            self._copy_lock.release()
            return None
        started = time.monotonic()
        try:
            got = self.loads.load(params, ids, num_cached_tokens)
        except Exception as e:
            report("engine reads", e, f"request {request_id} (loaded by the transfer agent instead)")
            got = None
        finally:
            self._copy_lock.release()
        if got is None:
            return None
        nbytes, planned = got
        return EngineCopied(request_id, params, nbytes, started, planned, time.monotonic())

    def copied(self, load: EngineCopied) -> None:
        """``load`` (copied) is the engine's now: reported at the next ``poll``, told to the agent."""
        with self._lock:
            self._copied.receiving.append(load.request_id)
            self._copied_at.append(load.copied)
            self._burst_bytes += load.nbytes
            self._untold.append(load)

    def take(self) -> tuple[Finished, list[float]]:
        """For ``poll``: the loads copied since the last, and when each was; a new burst begins."""
        with self._lock:
            copied, self._copied = self._copied, Finished()
            copied_at, self._copied_at = self._copied_at, []
            self._burst_bytes, self._burst_shared = 0, False
        return copied, copied_at

    @property
    def untold(self) -> bool:
        return bool(self._untold)

    def tell(self, channel: Channel | None, dead: str | None) -> None:
        """Tell the agent which loads were copied here (it sends their done notices), on the channel
        it reads with its periodic events; never waits: what the socket has no room for now stays
        untold for the next call (a later load's, or ``poll``). If the agent is gone (``dead``), or
        ``MAX_UNTOLD`` wait, the producers' holds end at their leases instead (logged)."""
        with self._lock:
            untold, self._untold = self._untold, []
        if not untold:
            return
        why = None
        if channel is None or dead is not None:
            why = dead or "no agent"
        else:
            try:
                while untold and channel.writable():
                    channel.send(untold[0], SEND_S)
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

    def learn(self, peers: Sequence[PeerKnown]) -> None:
        """Producer ranks the agent handshook with: copied from here on where the plane can."""
        with self._copy_lock:
            if self._closed:
                return
            for p in peers:
                try:
                    self.loads.learn(p.engine_id, p.meta)
                except Exception as e:  # its loads go to the agent, as they did
                    report("engine reads", e, f"producer {p.engine_id} rank {p.meta.rank} (read by the agent)")

    def counters(self) -> dict[str, float]:
        values = (self.loads.copied, self.loads.passed, self.shared_loads, self.later_loads, self.loads.producers)
        return {k: float(v) for k, v in zip(ENGINE_COUNTERS, values, strict=True)}

    def close(self) -> None:
        with self._copy_lock:
            self._closed = True
            self.loads.close()
