"""Who reads what from whom between a prefill and a decode instance of different sizes.

Pure functions over :class:`ParallelLayout`; no sockets, no globals.

Ownership rules
- Layers: PP stage s owns ``layer_ranges(...)[s]``. With ``layer_partition`` None the
  layers split evenly and the first ``num_layers % pp`` stages take one layer more.
- Heads: with ``tp <= num_kv_heads`` TP rank r owns heads ``[r*H/tp, (r+1)*H/tp)``; with
  ``tp > num_kv_heads`` head h is replicated on the ``tp/H`` consecutive ranks
  ``[h*tp/H, (h+1)*tp/H)``; with ``mla`` every rank holds the same single latent.
- A rank's global index is ``pp_rank * tp_size + tp_rank``.

Replica choice: where the remote side replicates what a local rank needs, the readers
of each piece of content (ordered by local pp rank, then tp rank) take the replicas in
turn, so the replicas' reader counts differ by at most one.

PP pairs need not divide one another: the mapping intersects layer ranges, so a 3-stage
prefill can feed a 2-stage decode. TP pairs must divide one another.

Ratio sign convention (``tp_ratio``, ``pp_ratio``, ``block_size_ratio``): ``+k`` when
the local size is k times the remote one (k local ranks share one remote rank, or one
local block gathers k remote blocks); ``-k`` when the remote size is k times the local
one; ``1`` when equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from kvxfer.config import InstanceConfig


def layer_ranges(num_layers: int, pp: int, partition: Sequence[int] | None = None) -> list[range]:
    """Global layer range of each PP stage."""
    if pp < 1:
        raise ValueError(f"pp: expected >= 1, got {pp}")
    if partition is None:
        if pp > num_layers:
            raise ValueError(f"pp={pp} stages cannot split num_layers={num_layers} layers")
        base, extra = divmod(num_layers, pp)
        sizes = [base + (1 if s < extra else 0) for s in range(pp)]
    else:
        sizes = list(partition)
        if len(sizes) != pp:
            raise ValueError(f"layer_partition {sizes}: expected {pp} entries, got {len(sizes)}")
        if any(s < 1 for s in sizes):
            raise ValueError(f"layer_partition {sizes}: every stage needs at least one layer")
        if sum(sizes) != num_layers:
            raise ValueError(
                f"layer_partition {sizes} sums to {sum(sizes)}, expected num_layers={num_layers}"
            )
    out: list[range] = []
    start = 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


class ParallelLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The parallel shape of one instance; also sent in the handshake."""

    tp_size: int
    pp_size: int
    num_layers: int
    num_kv_heads: int
    mla: bool = False
    layer_partition: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "num_layers", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelLayout.{name}: expected an int >= 1, got {value!r}")
        if self.mla and self.num_kv_heads != 1:
            raise ValueError(f"ParallelLayout.num_kv_heads: expected 1 with mla, got {self.num_kv_heads}")
        h, tp = self.num_kv_heads, self.tp_size
        if h % tp and tp % h:
            raise ValueError(f"ParallelLayout: tp_size={tp} must divide or be a multiple of num_kv_heads={h}")
        layer_ranges(self.num_layers, self.pp_size, self.layer_partition)  # validates the partition

    @classmethod
    def from_config(cls, cfg: InstanceConfig) -> ParallelLayout:
        par, model = cfg.parallel, cfg.model
        partition = tuple(par.layer_partition) if par.layer_partition is not None else None
        return cls(tp_size=par.tp, pp_size=par.pp, num_layers=model.num_layers,
                   num_kv_heads=model.num_kv_heads, mla=model.mla, layer_partition=partition)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def replicas(self) -> int:
        """How many TP ranks hold each head (1 unless tp_size > num_kv_heads, or tp_size for MLA)."""
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    def rank(self, tp_rank: int, pp_rank: int) -> int:
        self._check_rank(tp_rank, pp_rank)
        return pp_rank * self.tp_size + tp_rank

    def layers_of(self, pp_rank: int) -> range:
        if not 0 <= pp_rank < self.pp_size:
            raise ValueError(f"pp_rank: expected 0 <= pp_rank < {self.pp_size}, got {pp_rank}")
        return layer_ranges(self.num_layers, self.pp_size, self.layer_partition)[pp_rank]

    def heads_of(self, tp_rank: int) -> range:
        """Global KV head indices TP rank ``tp_rank`` holds (range(0, 1) for MLA's latent)."""
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: expected 0 <= tp_rank < {self.tp_size}, got {tp_rank}")
        if self.tp_size >= self.num_kv_heads:
            h = tp_rank // self.replicas
            return range(h, h + 1)
        per = self.heads_per_rank
        return range(tp_rank * per, (tp_rank + 1) * per)

    def owners_of_head(self, head: int) -> range:
        """TP ranks that hold global head ``head`` (several when replicated)."""
        if not 0 <= head < self.num_kv_heads:
            raise ValueError(f"head: expected 0 <= head < {self.num_kv_heads}, got {head}")
        if self.tp_size >= self.num_kv_heads:
            return range(head * self.replicas, (head + 1) * self.replicas)
        r = head // self.heads_per_rank
        return range(r, r + 1)

    def _check_rank(self, tp_rank: int, pp_rank: int) -> None:
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: expected 0 <= tp_rank < {self.tp_size}, got {tp_rank}")
        if not 0 <= pp_rank < self.pp_size:
            raise ValueError(f"pp_rank: expected 0 <= pp_rank < {self.pp_size}, got {pp_rank}")


@dataclass(frozen=True)
class SourceSlice:
    """One piece a local rank reads: these layers and heads, from that remote rank."""

    remote_tp_rank: int
    remote_pp_rank: int
    remote_rank: int
    layers: range  # global layer indices
    remote_heads: range  # head indices local to the remote rank
    local_heads: range  # head indices local to the reading rank


def check_compatible(local: ParallelLayout, remote: ParallelLayout) -> None:
    """Refuse (ValueError naming both sides' values) a pair kvxfer cannot map."""
    for name in ("num_layers", "num_kv_heads", "mla"):
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            raise ValueError(f"incompatible layouts: local {name}={a}, remote {name}={b}")
    a, b = local.tp_size, remote.tp_size
    if max(a, b) % min(a, b):
        raise ValueError(
            f"incompatible layouts: local tp_size={a} and remote tp_size={b} do not divide one another"
        )


def _reader_index(local: ParallelLayout, local_tp_rank: int, local_pp_rank: int,
                  head: int, remote_layers: range) -> int:
    """Position of this local rank among the local ranks that read ``head`` of ``remote_layers``."""
    index = 0
    owners = local.owners_of_head(head)
    for s in range(local.pp_size):
        layers = local.layers_of(s)
        if max(layers.start, remote_layers.start) >= min(layers.stop, remote_layers.stop):
            continue
        if s == local_pp_rank:
            return index + (local_tp_rank - owners.start)
        index += len(owners)
    raise AssertionError("the reading rank must intersect the remote layers")


def remote_sources(local: ParallelLayout, local_tp_rank: int, local_pp_rank: int,
                   remote: ParallelLayout) -> list[SourceSlice]:
    """The slices a local rank reads so that it gets every (layer, head) it owns exactly once."""
    check_compatible(local, remote)
    local._check_rank(local_tp_rank, local_pp_rank)
    my_layers = local.layers_of(local_pp_rank)
    my_heads = local.heads_of(local_tp_rank)
    out: list[SourceSlice] = []
    for rs in range(remote.pp_size):
        r_layers = remote.layers_of(rs)
        lo, hi = max(my_layers.start, r_layers.start), min(my_layers.stop, r_layers.stop)
        if lo >= hi:
            continue
        layers = range(lo, hi)
        if remote.replicas == 1:
            # each remote rank holds a distinct block of heads: one slice per remote rank
            for rt in range(remote.tp_size):
                r_heads = remote.heads_of(rt)
                a, b = max(my_heads.start, r_heads.start), min(my_heads.stop, r_heads.stop)
                if a >= b:
                    continue
                out.append(SourceSlice(
                    remote_tp_rank=rt, remote_pp_rank=rs, remote_rank=remote.rank(rt, rs), layers=layers,
                    remote_heads=range(a - r_heads.start, b - r_heads.start),
                    local_heads=range(a - my_heads.start, b - my_heads.start),
                ))
        else:
            # every remote rank holds one (replicated) head: take the replicas in turn
            for h in my_heads:
                owners = remote.owners_of_head(h)
                i = _reader_index(local, local_tp_rank, local_pp_rank, h, r_layers)
                rt = owners[i % len(owners)]
                out.append(SourceSlice(
                    remote_tp_rank=rt, remote_pp_rank=rs, remote_rank=remote.rank(rt, rs), layers=layers,
                    remote_heads=range(0, 1),
                    local_heads=range(h - my_heads.start, h - my_heads.start + 1),
                ))
    return out


def readers_of(remote: ParallelLayout, remote_tp_rank: int, remote_pp_rank: int,
               local: ParallelLayout) -> int:
    """How many local ranks read from that remote rank: the done notices it waits for."""
    check_compatible(local, remote)
    target = remote.rank(remote_tp_rank, remote_pp_rank)
    r_layers, r_heads = remote.layers_of(remote_pp_rank), remote.heads_of(remote_tp_rank)
    count = 0
    for lp in range(local.pp_size):
        layers = local.layers_of(lp)
        if max(layers.start, r_layers.start) >= min(layers.stop, r_layers.stop):
            continue
        for lt in range(local.tp_size):
            heads = local.heads_of(lt)
            if max(heads.start, r_heads.start) >= min(heads.stop, r_heads.stop):
                continue  # owns nothing this remote rank holds
            if any(s.remote_rank == target for s in remote_sources(local, lt, lp, remote)):
                count += 1
    return count


def _ratio(local: int, remote: int, what: str) -> int:
    if local < 1 or remote < 1:
        raise ValueError(f"{what}: expected sizes >= 1, got local {local}, remote {remote}")
    if local >= remote:
        if local % remote:
            raise ValueError(f"{what}: local {local} and remote {remote} do not divide one another")
        return local // remote
    if remote % local:
        raise ValueError(f"{what}: local {local} and remote {remote} do not divide one another")
    return -(remote // local)


def tp_ratio(local: ParallelLayout, remote: ParallelLayout) -> int:
    """+k: k local TP ranks share each remote rank; -k: each local rank reads k remote ranks."""
    return _ratio(local.tp_size, remote.tp_size, "tp_ratio")


def pp_ratio(local: ParallelLayout, remote: ParallelLayout) -> int:
    """+k: k local stages share each remote stage; -k: each local stage spans k remote stages."""
    return _ratio(local.pp_size, remote.pp_size, "pp_ratio")


def block_size_ratio(local_block_size: int, remote_block_size: int) -> int:
    """+k: one local block gathers k remote blocks; -k: one remote block spans k local blocks."""
    return _ratio(local_block_size, remote_block_size, "block_size_ratio")
