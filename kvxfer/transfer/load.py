"""The consumer's records: a load, its reads, a push reservation's progress, and the jobs and
notices its threads pass (see :class:`kvxfer.transfer.consumer.Consumer` for who owns what)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvxfer.dataplane import Descriptors
from kvxfer.protocol import (
    Abandon,
    DoneNotice,
    ErrorCode,
    HandshakeResponse,
    KVTransferParams,
    LayersReady,
    LeaseRenew,
    RemoteRank,
)
from kvxfer.topology import ParallelLayout, SourceSlice, check_compatible
from kvxfer.transfer.planner import DirectPlan, SideLayout, StagedPlan, check_alignment


class AlreadyLoading(ValueError):
    """``start_load`` of a request already loading: refused, and the load in flight goes on
    (unlike other refusals, the producer's hold is still in use)."""


class LoadFailed(RuntimeError):
    """A load cannot go on; ``code`` says why for code, the message for people."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_PARAMS) -> None:
        super().__init__(message)
        self.code = code


MAX_PLANS = 64  # plan shapes kept per producer rank
MAX_PLAN_PIECES = 1 << 16  # only shapes this small are kept (a load this big plans once, cheaply enough)


@dataclass
class Peer:
    """A handshaken producer rank, and the plan shapes of loads read from it (``direct_plan``)."""

    meta: HandshakeResponse
    token: bytes
    peer_id: str
    side: SideLayout
    host: str
    port: int
    plans: dict[tuple[SourceSlice, int, int], DirectPlan] = field(default_factory=dict)

    def direct_plan(self, local: SideLayout, sl: SourceSlice, skip_tokens: int, num_tokens: int) -> DirectPlan:
        """The direct plan's shape for this slice and token range (kept, if small, for the next
        load of that shape: most loads of a serving engine repeat a few)."""
        key = (sl, skip_tokens, num_tokens)
        plan = self.plans.get(key)
        if plan is None:
            plan = DirectPlan.build(self.side, local, sl, skip_tokens, num_tokens)
            if len(plan.length) <= MAX_PLAN_PIECES:
                if len(self.plans) >= MAX_PLANS:
                    self.plans.clear()
                self.plans[key] = plan
        return plan


@dataclass(eq=False)
class Batch:
    """One read of a load from one producer rank: the single record of it while it is outstanding.

    In flight on the data plane (``batch_id`` set, indexed in ``Consumer._in_flight``) or
    refused as "not held" and waiting to be read again (``read_again_at`` set, in
    ``Consumer._read_again``); never both. Worker thread only."""

    load: Load
    peer_id: str
    descs: Descriptors
    batch_id: int | None = None
    read_again_at: float | None = None
    rank: int = -1  # push: the producer rank, and which rows of its plan this read carries
    rows: np.ndarray | None = None


@dataclass(eq=False)
class RankPush:
    """What one producer rank pushes into a reservation: its whole plan, made at its first
    notice, and which rows of it were issued and have landed. Worker thread only."""

    peer: Peer
    descs: Descriptors
    first: np.ndarray  # per row: the first global layer of its remote region
    stop: np.ndarray  # per row: one past its last layer
    issued: np.ndarray
    landed: np.ndarray


@dataclass(eq=False)
class PushState:
    """A reservation's push progress (``Load.push``). ``landed`` is read by ``wait_layer``
    under the consumer's lock; the rest belongs to the worker thread."""

    num_tokens: int
    reserved_until: float
    needed: dict[int, list[SourceSlice]] | None = None  # producer rank -> slices, at the first notice
    ranks: dict[int, RankPush] = field(default_factory=dict)
    landed: set[int] = field(default_factory=set)  # layers whose every byte is here

    def all_issued(self) -> bool:
        return self.needed is not None and all(
            rr in self.ranks and bool(self.ranks[rr].issued.all()) for rr in self.needed)


@dataclass(eq=False)
class Load:
    """One request being loaded. Made by ``start_load`` (engine thread); from then on its mutable
    fields belong to the worker thread."""

    request_id: str
    params: KVTransferParams | None  # push: None until the first producer rank says what it saved
    local_blocks_full: np.ndarray  # one id per local block of the prompt, prefix hits included
    skip_tokens: int
    deadline: float
    local_block_size: int = 1
    batches: list[Batch] = field(default_factory=list)  # outstanding reads
    staged: list[tuple[StagedPlan, Peer]] = field(default_factory=list)
    peers: dict[int, Peer] = field(default_factory=dict)  # remote rank -> peer
    failure: tuple[ErrorCode, str] | None = None  # the first failed read; reported once none is outstanding
    nbytes: int = 0
    started: float = field(default_factory=time.monotonic)
    hold_wait_until: float = 0.0  # no more "not held" retries after this (consumer clock)
    # stage stamps (time.monotonic, comparable across processes; 0: not reached): the worker
    # picked the load up, its first read went to the plane, its last read came back
    began_at: float = 0.0
    issued_at: float = 0.0
    read_at: float = 0.0
    push: PushState | None = None  # a push reservation (None: a pull load)

    @property
    def source(self) -> KVTransferParams:
        """The producer's params (a push load has them from its first notice on)."""
        if self.params is None:
            raise LoadFailed(f"request {self.request_id}: nothing pushed yet", ErrorCode.INTERNAL)
        return self.params

    @property
    def invalid_blocks(self) -> list[int]:
        """The blocks this load was to write (prefix-hit blocks stay valid)."""
        return self.local_blocks_full[self.skip_tokens // self.local_block_size :].tolist()


# ---------------------------------------------------------------- the worker's jobs (engine -> worker)
@dataclass
class BeginLoad:
    load: Load


@dataclass
class AbandonRequest:
    request_id: str
    params: KVTransferParams
    reason: str


@dataclass
class PushNotice:
    load: Load
    msg: LayersReady


@dataclass
class EndReservation:
    load: Load
    reason: str


class RenewNow:
    """A request started waiting: renew its holds now (the lease may be short and half spent)."""


class Wake:
    """The data plane finished a batch: poll it now rather than at the next tick."""


class EngineCopied(msgspec.Struct, frozen=True, tag=True):
    """The engine's own thread copied this load beside its transfer agent (``EngineReads``): the
    agent sends its done notices and counts it. A wire type too: the engine sends it on the
    agent's copied channel (:mod:`kvxfer.agent.messages`), and the agent queues it for the
    consumer's worker as it came. Times: ``time.monotonic`` when the load started, its reads
    were planned, and its bytes were copied and rechecked."""

    request_id: str
    params: KVTransferParams
    nbytes: int
    started: float
    planned: float
    copied: float


class Stop:
    pass


Job = BeginLoad | AbandonRequest | PushNotice | EndReservation | RenewNow | Wake | EngineCopied | Stop


@dataclass
class Notice:
    """A side-channel message to one producer rank (worker -> notifier thread)."""

    rank: RemoteRank
    msg: DoneNotice | Abandon | LeaseRenew


def repeats(ids: np.ndarray) -> bool:
    """Whether any id occurs twice (a sort: np.unique's hashing costs more on a few ids)."""
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


def checked_load_ids(request_id: str, params: KVTransferParams, local_block_ids: Sequence[int] | np.ndarray,
                     num_cached_tokens: int, block_size: int, num_blocks: int, layout: ParallelLayout) -> np.ndarray:
    """``start_load``'s checks (a ValueError names what is wrong): the local block ids the load
    writes, as many as the request's tokens need. Shared with the agent's engine side, which
    checks before it sends the load one-way."""
    L = block_size
    need = math.ceil(params.num_tokens / L)
    small = _small_ids(local_block_ids) if need >= 0 else None  # need < 0: the numpy path names num_tokens
    if small is not None:  # the same checks on a short list of ints, in Python
        if len(small) < need:
            raise ValueError(f"request {request_id}: {params.num_tokens} tokens need {need} local blocks of "
                             f"{L}, got {len(small)}")
        if small and (min(small) < 0 or max(small) >= num_blocks):
            raise ValueError(f"request {request_id}: local block ids must be in [0, {num_blocks})")
        if len(set(small[:need])) != need:
            raise ValueError(f"request {request_id}: local block ids repeat")
        ids = np.array(small[:need], dtype=np.int64)
    else:
        ids = np.asarray(local_block_ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) < need:
            raise ValueError(f"request {request_id}: {params.num_tokens} tokens need {need} local blocks of "
                             f"{L}, got {len(ids)}")
        if len(ids) and (ids.min() < 0 or ids.max() >= num_blocks):
            raise ValueError(f"request {request_id}: local block ids must be in [0, {num_blocks})")
        if repeats(ids[:need]):
            raise ValueError(f"request {request_id}: local block ids repeat")
    if not 0 <= num_cached_tokens <= params.num_tokens:
        raise ValueError(f"request {request_id}: num_cached_tokens must be in [0, {params.num_tokens}]")
    check_alignment(num_cached_tokens, params.block_size, L)
    check_compatible(layout, params.layout)
    if len(params.block_ids) < math.ceil(params.num_tokens / params.block_size):
        raise ValueError(f"request {request_id}: params carry {len(params.block_ids)} remote blocks for "
                         f"{params.num_tokens} tokens of {params.block_size}")
    return ids[:need]


SMALL_IDS = 64  # block id lists up to this long are checked in Python (a few numpy calls cost more)
_INT64_MAX = (1 << 63) - 1


def _small_ids(block_ids: Sequence[int] | np.ndarray) -> list[int] | None:
    """``block_ids`` when it is a short list of Python ints within int64 (what the engine and its
    agent pass), else None (numpy checks it; a value outside int64 fails there as before)."""
    if type(block_ids) is not list or len(block_ids) > SMALL_IDS:
        return None
    for b in block_ids:
        if type(b) is not int or not -_INT64_MAX - 1 <= b <= _INT64_MAX:
            return None
    return block_ids
