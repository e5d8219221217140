"""How one optimizer step's work is cut over data-parallel ranks so that no rank can deadlock.

Under DeepSpeed ZeRO-2 every `backward()` reduces gradients and under ZeRO-3 every forward gathers
parameters: ranks that run different numbers of forward/backward calls issue mismatched collectives and
hang. So the work is split by token count (`split_by_weight`, greedy longest-first onto the
least-loaded rank) and every rank runs the same number of micro-batches, `micro_batches_per_rank`,
padding with zero-weight passes (rl.trainer.padding_trajectory, sft.step.padding_row). A rank may get
no real work at all and still takes part in every collective.
See docs/ray-runtime.md, "Trainer shards that cannot deadlock".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def split_by_weight(items: Sequence[T], world: int, weight: Callable[[T], float]) -> list[list[int]]:
    """Indices of `items` per rank, heaviest first onto the least-loaded rank; items of weight 0 (no token
    to train on) are left out. Each rank's indices are sorted (the order a single process would use)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    order = sorted((i for i, x in enumerate(items) if weight(x) > 0), key=lambda i: -weight(items[i]))
    parts: list[list[int]] = [[] for _ in range(world)]
    load = [0.0] * world
    for i in order:
        r = min(range(world), key=lambda k: (load[k], len(parts[k]), k))
        parts[r].append(i)
        load[r] += weight(items[i])
    return [sorted(p) for p in parts]


def micro_batches_per_rank(parts: Sequence[Sequence[int]], micro_batch_size: int) -> int:
    """The micro-batch count every rank runs: what the fullest rank needs (at least one)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return max(1, max((-(-len(p) // micro_batch_size) for p in parts), default=1))
