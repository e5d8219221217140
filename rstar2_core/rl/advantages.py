"""Advantage estimators (a registry of pure functions, keyed by `cfg.rl.grpo.advantage_estimator`).

`grpo`: `A_i = (r_i - mean(r)) / (std(r) + eps)` over the kept rollouts of one group, the same value on
every token of trajectory i (RECIPE.md). Invariant: the std is the *population* std (unbiased=False), so
rewards (1, 0) give (+1, -1) and a group's advantages have unit variance whatever G is; a group whose
rewards are all equal gets zero advantages. Shapes: `grpo_advantages(rewards: (G,)) -> (G,)`;
`grpo_advantages_batched(rewards: (num_groups, G)) -> (num_groups, G)`. Groups of unequal size (after
infra failures are excluded) go through the 1-D form.

See docs/rl.md, "Choices, and where they depart from the paper or the reference code" (Advantages).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards `(G,)` of one kept group -> advantages `(G,)`, `(r - mean) / (std + eps)`, population std."""
    if rewards.dim() != 1:
        raise ValueError(f"grpo_advantages: expected rewards of shape (G,), got {tuple(rewards.shape)}; "
                         "use grpo_advantages_batched for (num_groups, G)")
    return grpo_advantages_batched(rewards.unsqueeze(0), eps).squeeze(0)


def grpo_advantages_batched(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards `(num_groups, G)` -> advantages `(num_groups, G)`, normalised within each row."""
    if rewards.dim() != 2 or rewards.shape[1] < 1:
        raise ValueError(f"grpo_advantages_batched: expected (num_groups, G >= 1), got {tuple(rewards.shape)}")
    r = rewards.to(torch.float32)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    return (r - mean) / (std + eps)


AdvantageEstimator = Callable[[torch.Tensor, float], torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {"grpo": grpo_advantages}


def get_advantage_estimator(key: str) -> AdvantageEstimator:
    """The 1-D estimator `(rewards (G,), eps) -> (G,)` registered under `key`."""
    if key not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {key!r}; valid keys: {sorted(ADVANTAGE_ESTIMATORS)} "
                         "(cfg.rl.grpo.advantage_estimator)")
    return ADVANTAGE_ESTIMATORS[key]
