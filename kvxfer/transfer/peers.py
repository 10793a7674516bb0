"""The producer ranks a consumer has handshaken with, and the check of each handshake's answer.

A handshake is checked once, before any read: a producer of another model, shape, dtype or
kernel layout is refused with ``INCOMPATIBLE`` (the differences named), a restarted one with
``STALE_GENERATION``, an address that answers as someone else with ``BAD_PARAMS``. What it
told us is kept per (engine, rank) until the producer restarts or a read from it fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvxfer.cache.spec import KVCacheSpec
from kvxfer.dataplane import DataPlane
from kvxfer.handshake import HandshakeError, SideChannelClient
from kvxfer.metrics import ConnectorMetrics
from kvxfer.protocol import ErrorCode, HandshakeResponse, RemoteRank, compat_hash
from kvxfer.supervise import report
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.load import Peer
from kvxfer.transfer.planner import FUSED_REPACKABLE, SideLayout

logger = logging.getLogger(__name__)


class PeerTable:
    """(engine, rank) -> the latest generation's ``Peer``: handshaken, checked and connected.

    Owned by the consumer's turn-lock holder (the worker, or the fast path's caller)."""

    def __init__(self, engine_id: str, rank: int, layout: ParallelLayout, spec: KVCacheSpec, model: str,
                 secret: bytes | None, client: SideChannelClient, plane: DataPlane,
                 stats: ConnectorMetrics) -> None:
        self.engine_id, self.rank, self.layout, self.spec, self.model = engine_id, rank, layout, spec, model
        self.secret, self.client, self.plane, self.stats = secret, client, plane, stats
        self._peers: dict[tuple[str, int], Peer] = {}
        # told of each peer newly handshaken (its engine id and handshake), on the holder's thread;
        # must be quick and never raise (a transfer agent passes it on to its engine)
        self.on_new: Callable[[str, HandshakeResponse], None] | None = None

    def known(self, engine_id: str, r: RemoteRank) -> Peer | None:
        """The peer for ``r`` if handshaken at its generation (no network)."""
        peer = self._peers.get((engine_id, r.rank))
        return peer if peer is not None and peer.meta.generation == r.generation else None

    def get(self, engine_id: str, r: RemoteRank) -> Peer:
        """The peer for ``r``, handshaking (and connecting the plane) first if needed; raises
        HandshakeError with its code, or what the plane's connect raises."""
        if (peer := self.known(engine_id, r)) is not None:
            return peer
        key = (engine_id, r.rank)
        if (old := self._peers.pop(key, None)) is not None:  # the producer restarted: drop the old one
            logger.info("producer %s rank %d restarted (generation changed); handshaking again", engine_id, r.rank)
            self.plane.disconnect(old.peer_id)
        t0 = time.monotonic()
        meta, token = self.client.handshake(r.host, r.port, self.engine_id, self.rank, self.layout, self.secret)
        self.stats.handshook(time.monotonic() - t0)
        check_peer(meta, engine_id, r, self.model, self.layout, self.spec)
        side = SideLayout.from_remote(meta.spec, meta.regions)
        peer_id = f"{engine_id}/{r.rank}/{meta.generation}"
        self.plane.connect(peer_id, meta.data_address, token)
        peer = Peer(meta, token, peer_id, side, r.host, r.port)
        self._peers[key] = peer
        if self.on_new is not None:
            try:
                self.on_new(engine_id, meta)
            except Exception as e:
                report("consumer: a new peer's listener", e, f"peer {peer_id}")
        return peer

    def forget(self, peer_id: str) -> None:
        """Close the data path to a peer and drop what its handshake told us."""
        for key, p in list(self._peers.items()):
            if p.peer_id == peer_id:
                del self._peers[key]
        try:
            self.plane.disconnect(peer_id)
        except Exception as e:
            report("consumer worker: disconnect", e, f"peer {peer_id}")

    def token_for(self, engine_id: str, r: RemoteRank) -> bytes:
        """The side-channel token of ``r`` at its generation (empty if not handshaken)."""
        peer = self.known(engine_id, r)
        return peer.token if peer is not None else b""


def check_peer(meta: HandshakeResponse, engine_id: str, r: RemoteRank, model: str, layout: ParallelLayout,
               local: KVCacheSpec) -> None:
    """Raise HandshakeError (with its code) if ``meta`` is not producer ``engine_id`` rank ``r``
    of the generation asked for, or its cache cannot be read into ``local``'s."""
    if meta.engine_id != engine_id or meta.rank != r.rank:
        raise HandshakeError(f"{r.host}:{r.port} is {meta.engine_id} rank {meta.rank}, "
                             f"expected {engine_id} rank {r.rank}", ErrorCode.BAD_PARAMS)
    if meta.generation != r.generation:
        raise HandshakeError(f"producer {engine_id} rank {r.rank} restarted: params are for generation "
                             f"{r.generation}, it now serves {meta.generation}; its blocks are gone",
                             ErrorCode.STALE_GENERATION)
    mine = compat_hash(model, layout.num_layers, layout.num_kv_heads, local.head_size, local.dtype, local.mla)
    if meta.compat_hash != mine:
        diffs = [f"{name}: local {a!r}, remote {b!r}" for name, a, b in (
            ("model", model, meta.model), ("num_layers", layout.num_layers, meta.layout.num_layers),
            ("num_kv_heads", layout.num_kv_heads, meta.layout.num_kv_heads),
            ("head_size", local.head_size, meta.spec.head_size), ("dtype", local.dtype, meta.spec.dtype),
            ("mla", local.mla, meta.spec.mla)) if a != b]
        raise HandshakeError(f"incompatible producer {engine_id} rank {r.rank}: " + ("; ".join(diffs) or
                             f"compatibility hash {meta.compat_hash} != {mine}"), ErrorCode.INCOMPATIBLE)
    if meta.spec.kv_fused != local.kv_fused:
        raise HandshakeError(f"incompatible producer {engine_id} rank {r.rank}: kv_fused: local {local.kv_fused}, "
                             f"remote {meta.spec.kv_fused} (no repack between fused and separate K/V yet)",
                             ErrorCode.INCOMPATIBLE)
    rbs, lbs = meta.spec.block_size, local.block_size
    ro, lo = meta.spec.fused_order, local.fused_order
    if local.kv_fused and ro and lo and ro != lo:
        raise HandshakeError(f"incompatible producer {engine_id} rank {r.rank}: fused caches in different kernel "
                             f"orders (fused_order: local {lo!r}, remote {ro!r}; no repack between them yet)",
                             ErrorCode.INCOMPATIBLE)
    if local.kv_fused and rbs != lbs and not (ro == lo == FUSED_REPACKABLE):
        raise HandshakeError(f"producer {engine_id} rank {r.rank}: fused caches (vLLM's CPU layout) move whole "
                             f"blocks in the engine's own token order: block sizes must match (local {lbs}, "
                             f"remote {rbs}) unless both orders are {FUSED_REPACKABLE!r} (fused_order: local "
                             f"{lo!r}, remote {ro!r})", ErrorCode.INCOMPATIBLE)
    if max(rbs, lbs) % min(rbs, lbs):
        raise HandshakeError(f"unsupported block sizes: local {lbs}, remote {rbs} (must divide one another)",
                             ErrorCode.INCOMPATIBLE)
