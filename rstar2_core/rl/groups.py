"""From graded rollout groups to the step's update batch: infra exclusion, zero-variance drop, RoC, advantages.

`build_step_batch(groups, rewards, grpo_cfg, seed)` takes, per prompt, the `oversample x G` trajectories
and their rewards and (1) leaves infra-failed trajectories out of every group statistic, (2) drops groups
whose valid rewards are all equal or that have fewer than 2 valid members, (3) down-samples each group
to `group_size` with the configured resampler, (4) computes advantages over the kept members.
Invariant: an infra-failed trajectory is neither positive nor negative. `rollout/...` metrics describe
all valid trajectories (before resampling) plus what was kept; undefined ratios are omitted, not 0.

See docs/rl.md, "One RL step" (item 3) and "Metrics".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rstar2_core.rl.advantages import get_advantage_estimator
from rstar2_core.rl.roc import filter_zero_variance, get_resampler, trajectory_penalty
from rstar2_core.rollout.types import Trajectory


@dataclass(frozen=True)
class StepBatch:
    """Kept trajectories with one advantage each (`advantages: (B,)`), and the step's rollout metrics."""

    trajectories: tuple[Trajectory, ...]
    advantages: tuple[float, ...]
    metrics: dict[str, float] = field(default_factory=dict)


def penalty_of(t: Trajectory) -> float:
    return trajectory_penalty(t.n_tool_calls, t.n_failed_tool_calls, t.n_answer_blocks, max(t.n_turns, 0))


def _group_seed(seed: int, g: int) -> int:
    return (seed * 1_000_003 + g) % (1 << 63)


def _error_ratio(trajs: list[Trajectory]) -> float | None:
    calls = sum(t.n_tool_calls for t in trajs)
    return None if calls == 0 else sum(t.n_failed_tool_calls for t in trajs) / calls


def build_step_batch(groups: Sequence[Sequence[Trajectory]], rewards: Sequence[Sequence[float]], grpo,
                     seed: int) -> StepBatch:
    """See the module docstring. `grpo`: `GRPOConfig` (resample, group_size, positive_mode,
    min_per_class, advantage_estimator, adv_eps)."""
    if len(groups) != len(rewards) or any(len(g) != len(r) for g, r in zip(groups, rewards)):
        raise ValueError("build_step_batch: groups and rewards must have the same shape (one reward per trajectory)")
    resample = get_resampler(grpo.resample)
    estimator = get_advantage_estimator(grpo.advantage_estimator)
    kept_trajs: list[Trajectory] = []
    kept_adv: list[float] = []
    valid_all: list[tuple[Trajectory, float]] = []
    kept_pos: list[Trajectory] = []
    n_infra = dropped_correct = dropped_wrong = dropped_few = solved = 0
    for g, (group, rs) in enumerate(zip(groups, rewards)):
        valid = [i for i, t in enumerate(group) if not t.infra_failed]
        n_infra += len(group) - len(valid)
        v_trajs = [group[i] for i in valid]
        v_rewards = [float(rs[i]) for i in valid]
        valid_all += list(zip(v_trajs, v_rewards))
        solved += any(r > 0 for r in v_rewards)
        if len(valid) < 2:
            dropped_few += 1
            continue
        if not filter_zero_variance([v_rewards])[0]:
            if v_rewards[0] > 0:
                dropped_correct += 1
            else:
                dropped_wrong += 1
            continue
        penalties = [penalty_of(t) for t in v_trajs]
        keep = resample(v_rewards, penalties, grpo.group_size, mode=grpo.positive_mode,
                        seed=_group_seed(seed, g), min_per_class=grpo.min_per_class)
        adv = estimator(torch.tensor([v_rewards[i] for i in keep], dtype=torch.float32), grpo.adv_eps)
        for j, i in enumerate(keep):
            kept_trajs.append(v_trajs[i])
            kept_adv.append(float(adv[j]))
            if v_rewards[i] > 0:
                kept_pos.append(v_trajs[i])
    n_groups = len(groups)
    m: dict[str, float] = {
        "rollout/groups": float(n_groups),
        "rollout/groups_kept": float(n_groups - dropped_correct - dropped_wrong - dropped_few),
        "rollout/groups_dropped_all_correct": float(dropped_correct),
        "rollout/groups_dropped_all_wrong": float(dropped_wrong),
        "rollout/groups_dropped_too_few": float(dropped_few),
        "rollout/dropped_group_frac": (dropped_correct + dropped_wrong + dropped_few) / max(n_groups, 1),
        "rollout/infra_failed": float(n_infra),
        "rollout/trajectories": float(sum(len(g) for g in groups)),
        "rollout/trajectories_kept": float(len(kept_trajs)),
    }
    if valid_all:
        ts = [t for t, _ in valid_all]
        n = len(ts)
        m.update({
            "rollout/reward_mean": sum(r for _, r in valid_all) / n,
            "rollout/pass_rate": sum(r > 0 for _, r in valid_all) / n,
            "rollout/solve_rate": solved / max(n_groups, 1),
            "rollout/tool_calls_per_traj": sum(t.n_tool_calls for t in ts) / n,
            "rollout/response_tokens_mean": sum(len(t.response_ids) for t in ts) / n,
            "rollout/generated_tokens_mean": sum(t.n_generated_tokens for t in ts) / n,
            "rollout/turns_mean": sum(t.n_turns for t in ts) / n,
            "rollout/truncated_frac": sum(t.truncated for t in ts) / n,
        })
    for key, trajs in (("rollout/pos_tool_error_ratio", [t for t, r in valid_all if r > 0]),
                       ("rollout/neg_tool_error_ratio", [t for t, r in valid_all if r <= 0]),
                       ("rollout/kept_pos_tool_error_ratio", kept_pos)):
        ratio = _error_ratio(trajs)
        if ratio is not None:
            m[key] = ratio
    if kept_pos:
        m["rollout/kept_pos_penalty_mean"] = sum(penalty_of(t) for t in kept_pos) / len(kept_pos)
    return StepBatch(tuple(kept_trajs), tuple(kept_adv), m)
