"""How one rank's share of a step is cut into micro-batches: by count, or by a token budget.

    cut_micro_batches([900, 40, 35, 610], size=2)                 # [[0, 1], [2, 3]]
    cut_micro_batches([900, 40, 35, 610], max_tokens=1024)        # [[0, 1, 2], [3]]

Invariant: every item lands in exactly one micro-batch, each micro-batch's indices ascending; under a
budget a micro-batch holds `shared + sum(lengths) <= max_tokens` unless it is one item longer than the
budget on its own. The step's loss is divided by the step's token count, so its gradient does not depend
on the cut (tests/unit/rl/test_rl_micro_batches.py). See docs/training-speed.md, "Micro-batches by token budget".
"""

from __future__ import annotations

from collections.abc import Sequence


def cut_micro_batches(lengths: Sequence[int], *, size: int | None = None, max_tokens: int | None = None,
                      shared: int = 0) -> list[list[int]]:
    """Item indices per micro-batch. `size`: consecutive groups of that many items. `max_tokens`: bins
    filled first-fit-decreasing by `lengths` (the tokens an item adds to a packed row), each bin also
    holding `shared` tokens once (a prefix the row writes once); an item longer than the budget on its
    own runs alone. Exactly one of `size` and `max_tokens`."""
    if (size is None) == (max_tokens is None):
        raise ValueError(f"cut_micro_batches: give exactly one of size ({size}) and max_tokens ({max_tokens})")
    n = len(lengths)
    if size is not None:
        if size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {size}")
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    assert max_tokens is not None
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    room = max_tokens - shared
    bins: list[list[int]] = []
    load: list[int] = []
    for i in sorted(range(n), key=lambda j: (-lengths[j], j)):
        for b in range(len(bins)):
            if load[b] + lengths[i] <= room:
                bins[b].append(i)
                load[b] += lengths[i]
                break
        else:
            bins.append([i])
            load.append(lengths[i])
    return [sorted(b) for b in bins]


def over_budget(lengths: Sequence[int], max_tokens: int | None, shared: int = 0) -> int:
    """Items that do not fit the budget on their own (each runs as a micro-batch of one)."""
    return 0 if max_tokens is None else sum(1 for x in lengths if x + shared > max_tokens)
