"""Resample-on-Correct (RoC): which of the oversampled rollouts of one prompt are kept for the update.

Per prompt the policy samples `oversample x G` rollouts; RoC keeps `G` of them: negatives (reward <= 0)
uniformly at random, positives preferring a low `trajectory_penalty` (failed tool calls + format), each
class its share of `keep` with a floor per class when the group has both. Invariant: the two shares always
sum to `keep`, and failed calls are counted from structured statuses (`ToolCallRecord.failed`), never by
searching tool output. `RESAMPLERS` maps `cfg.rl.grpo.resample` (`roc`, `none` = keep all) to a function
`(rewards, penalties, keep, mode, seed, min_per_class) -> kept indices`.

See docs/rl.md, "Choices, and where they depart from the paper or the reference code" (Penalty,
Positives, Class shares).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

POSITIVE_MODES = ("weighted", "lowest_penalty")
_WEIGHT_EPS = 1e-6


def trajectory_penalty(n_tool_calls: int, n_failed_tool_calls: int, n_answer_blocks: int, n_turns: int) -> float:
    """`p_err + p_format` of one trajectory (RECIPE.md).

    `p_err = failed / calls`, or 0.5 when the trajectory made no tool call. `p_format = 1` with no
    `<answer>` block, else `min(1, (answer_blocks - 1) / turns)`; `n_turns` counts assistant turns (>= 1
    for any trajectory that produced text). Failed = unparseable call, unknown tool, bad arguments,
    run-time error, timeout, memory limit. Range: [0, 2].
    """
    for name, v in (("n_tool_calls", n_tool_calls), ("n_failed_tool_calls", n_failed_tool_calls),
                    ("n_answer_blocks", n_answer_blocks), ("n_turns", n_turns)):
        if v < 0:
            raise ValueError(f"trajectory_penalty: {name}={v} must be >= 0")
    if n_failed_tool_calls > n_tool_calls:
        raise ValueError(f"trajectory_penalty: n_failed_tool_calls={n_failed_tool_calls} exceeds "
                         f"n_tool_calls={n_tool_calls}; count each failed call once among the calls")
    p_err = 0.5 if n_tool_calls == 0 else n_failed_tool_calls / n_tool_calls
    if n_answer_blocks == 0:
        p_format = 1.0
    else:
        if n_turns < 1:
            raise ValueError("trajectory_penalty: a trajectory with an answer block has n_turns >= 1; "
                             "count the assistant turns (the first generation is turn 1)")
        p_format = min(1.0, (n_answer_blocks - 1) / n_turns)
    return p_err + p_format


def class_counts(n_pos: int, n_neg: int, keep: int, min_per_class: int = 2) -> tuple[int, int]:
    """(positives kept, negatives kept) for a group of `n_pos + n_neg >= keep` rollouts; sums to `keep`."""
    n = n_pos + n_neg
    if keep > n:
        raise ValueError(f"class_counts: keep={keep} exceeds the group size {n}")
    if n_pos == 0:
        return 0, keep
    if n_neg == 0:
        return keep, 0
    k_pos = math.floor(n_pos * keep / n + 0.5)
    floor_pos = min(min_per_class, n_pos, keep // 2)
    floor_neg = min(min_per_class, n_neg, keep // 2)
    k_pos = max(k_pos, floor_pos)
    k_pos = min(k_pos, keep - floor_neg)
    return k_pos, keep - k_pos


def _check_inputs(rewards: Sequence[float], penalties: Sequence[float], keep: int) -> None:
    if len(rewards) != len(penalties):
        raise ValueError(f"resample: rewards ({len(rewards)}) and penalties ({len(penalties)}) must have "
                         "one entry per rollout")
    if keep < 0:
        raise ValueError(f"resample: keep={keep} must be >= 0")
    bad = [p for p in penalties if not (p >= 0 and math.isfinite(p))]
    if bad:
        raise ValueError(f"resample: penalties must be finite and >= 0 (trajectory_penalty), got {bad[:3]}")


def resample_on_correct(rewards: Sequence[float], penalties: Sequence[float], keep: int,
                        mode: str = "weighted", seed: int | None = None, min_per_class: int = 2) -> list[int]:
    """Indices kept (sorted ascending) out of one prompt's rollouts; `len == keep` when `len(rewards) >= keep`
    (all indices when fewer). Same seed -> same result."""
    if mode not in POSITIVE_MODES:
        raise ValueError(f"resample_on_correct: unknown mode {mode!r}; valid modes: {list(POSITIVE_MODES)}")
    _check_inputs(rewards, penalties, keep)
    n = len(rewards)
    if n <= keep:
        return list(range(n))
    pos = [i for i, r in enumerate(rewards) if r > 0]
    neg = [i for i, r in enumerate(rewards) if r <= 0]
    k_pos, k_neg = class_counts(len(pos), len(neg), keep, min_per_class)
    rng = np.random.default_rng(seed)
    kept_neg = [neg[j] for j in rng.choice(len(neg), size=k_neg, replace=False)] if k_neg else []
    if mode == "lowest_penalty":
        kept_pos = sorted(pos, key=lambda i: (penalties[i], i))[:k_pos]
    else:
        w = np.array([1.0 / (penalties[i] + _WEIGHT_EPS) for i in pos])
        u = rng.random(len(pos))
        keys = np.log(u) / w  # log of u ** (1 / w): largest keys = weighted sample without replacement
        order = sorted(range(len(pos)), key=lambda j: (-keys[j], j))
        kept_pos = [pos[j] for j in order[:k_pos]]
    return sorted(kept_neg + kept_pos)


def keep_all(rewards: Sequence[float], penalties: Sequence[float], keep: int, mode: str = "weighted",
             seed: int | None = None, min_per_class: int = 2) -> list[int]:
    """Plain GRPO: every rollout is kept (`keep` and the rest are ignored)."""
    _check_inputs(rewards, penalties, max(keep, 0))
    return list(range(len(rewards)))


Resampler = Callable[..., list[int]]
RESAMPLERS: dict[str, Resampler] = {"roc": resample_on_correct, "none": keep_all}


def get_resampler(key: str) -> Resampler:
    if key not in RESAMPLERS:
        raise ValueError(f"unknown resampler {key!r}; valid keys: {sorted(RESAMPLERS)} (cfg.rl.grpo.resample)")
    return RESAMPLERS[key]


def filter_zero_variance(rewards_by_group: Sequence[Sequence[float]] | torch.Tensor) -> list[bool]:
    """Mask over groups: True = keep (rewards differ), False = every reward equal (no GRPO signal) or empty.

    `rewards_by_group`: a list of per-group reward lists (groups may differ in size) or a `(num_groups, G)`
    tensor.
    """
    if isinstance(rewards_by_group, torch.Tensor):
        if rewards_by_group.dim() != 2:
            raise ValueError(f"filter_zero_variance: expected (num_groups, G), got shape {tuple(rewards_by_group.shape)}")
        rewards_by_group = rewards_by_group.tolist()
    return [len(g) > 0 and any(r != g[0] for r in g) for g in rewards_by_group]
