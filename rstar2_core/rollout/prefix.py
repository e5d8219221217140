"""Which slot a new request takes, and how much of its prompt's KV it can reuse instead of prefilling.

A finished request's slot keeps its KV; a later request whose prompt starts with those tokens (the
same trajectory's next turn) reuses the slot and prefills only the suffix. Free slots without a cached
prefix go first (lowest index first), then the least recently used cached prefix is evicted; a longer
prefix held by any other slot is copied instead of prefilled.
Invariant: reuse and copies are exact because the KV at a position depends only on the tokens up to it.
Token sequences are int64 numpy arrays, so a common prefix is one vectorised comparison.
See docs/rollout.md, "HFEngine" (Prefix reuse).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit`."""
    m = min(len(a), len(b), limit)
    if m <= 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


@dataclass(frozen=True)
class SlotPlan:
    slot: int
    reuse: int               # prompt tokens whose KV will be in the slot before prefill
    copy_from: int | None    # slot whose first `reuse` positions are copied over, if any


def plan_slot(prompt: np.ndarray, free: list[int], cached: dict[int, tuple[np.ndarray, float]],
              running: dict[int, np.ndarray]) -> SlotPlan:
    """The slot for `prompt` among `free` slots (sorted), given cached prefixes (slot -> (tokens, last
    use)) and the tokens whose KV running slots hold. At least one prompt token is always fed."""
    limit = len(prompt) - 1
    lengths = {s: common_prefix(cached[s][0], prompt, limit) for s in free if s in cached}
    target = max(lengths, key=lengths.get) if lengths and max(lengths.values()) > 0 else None
    if target is None:
        empty = [s for s in free if s not in cached]
        target = empty[0] if empty else min(free, key=lambda s: cached[s][1])
    reuse = lengths.get(target, 0)
    lengths.update({s: common_prefix(toks, prompt, limit) for s, toks in running.items()})
    src = max((s for s in lengths if s != target), key=lengths.get, default=None)
    if src is not None and lengths[src] > reuse:
        return SlotPlan(target, lengths[src], src)
    return SlotPlan(target, reuse, None)
