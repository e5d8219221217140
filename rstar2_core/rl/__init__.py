"""GRPO-RoC: resampling, advantages, policy loss (pure functions, importable without torch models), and
the RL step loop (`rl.trainer`, `rl.stage`, `rl.hard_subset`, imported on demand).

    from rstar2_core.rl import trajectory_penalty, resample_on_correct, filter_zero_variance, \
        grpo_advantages, grpo_advantages_batched, policy_loss

Invariant: this package imports only the pure modules; the step loop's modules stay on demand.
See docs/rl.md.
"""

from rstar2_core.rl.advantages import (
                                       ADVANTAGE_ESTIMATORS,
                                       get_advantage_estimator,
                                       grpo_advantages,
                                       grpo_advantages_batched,
)
from rstar2_core.rl.loss import POLICY_LOSSES, get_policy_loss, policy_loss
from rstar2_core.rl.roc import (
                                       RESAMPLERS,
                                       class_counts,
                                       filter_zero_variance,
                                       get_resampler,
                                       keep_all,
                                       resample_on_correct,
                                       trajectory_penalty,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "RESAMPLERS", "class_counts", "filter_zero_variance",
    "get_advantage_estimator", "get_policy_loss", "get_resampler", "grpo_advantages", "grpo_advantages_batched",
    "keep_all", "policy_loss", "resample_on_correct", "trajectory_penalty",
]
