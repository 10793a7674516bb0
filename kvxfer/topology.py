"""Which layers and heads each parallel rank owns.

Layer partition rule (``layer_partition`` None): ``num_layers // pp`` layers per stage,
and the first ``num_layers % pp`` stages take one layer more.
"""

from __future__ import annotations

from collections.abc import Sequence


def layer_ranges(
    num_layers: int, pp: int, partition: Sequence[int] | None = None
) -> list[range]:
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
