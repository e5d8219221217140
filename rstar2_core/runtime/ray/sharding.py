"""How one optimizer step's work is cut over data-parallel ranks so that no rank can deadlock.

Under DeepSpeed ZeRO-2 every `backward()` reduces gradients and under ZeRO-3 every forward gathers
parameters: ranks that run different numbers of forward/backward calls issue mismatched collectives and
hang. So the work is split by the tokens each item's forward computes (`split_by_weight`, greedy
longest-first onto the least-loaded rank) and every rank runs the same number of micro-batches (the most
any rank's cut needs, `micro_batches_per_rank`),
padding with zero-weight passes (rl.trainer.padding_trajectory, sft.step.padding_row). A rank may get
no real work at all and still takes part in every collective.
See docs/ray-runtime.md, "Trainer shards that cannot deadlock".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def split_by_weight(items: Sequence[T], world: int, weight: Callable[[T], float],
                    balance: Callable[[T], float] | None = None) -> list[list[int]]:
    """Indices of `items` per rank, heaviest by `balance` (default: `weight`) first onto the least-loaded
    rank; items of weight 0 (no token to train on) are left out. Each rank's indices are sorted (the
    order a single process would use)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    size = balance or weight
    order = sorted((i for i, x in enumerate(items) if weight(x) > 0), key=lambda i: -size(items[i]))
    parts: list[list[int]] = [[] for _ in range(world)]
    load = [0.0] * world
    for i in order:
        r = min(range(world), key=lambda k: (load[k], len(parts[k]), k))
        parts[r].append(i)
        load[r] += size(items[i])
    return [sorted(p) for p in parts]


def micro_batches_per_rank(parts: Sequence[Sequence[int]], count: Callable[[Sequence[int]], int]) -> int:
    """The micro-batch count every rank runs: the most any rank's share needs (`count(indices)`; at least one)."""
    return max(1, max((count(p) for p in parts), default=1))


def rank_balance(parts: Sequence[Sequence[int]], size: Sequence[float]) -> float:
    """Max over min of the ranks' summed `size` (1.0 = even; inf when a rank got nothing)."""
    loads = [sum(size[i] for i in p) for p in parts]
    return max(loads) / min(loads) if min(loads) > 0 else float("inf")
