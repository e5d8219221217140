"""One RL step on any runtime: rollout -> grade -> build_step_batch -> update -> (publish) -> weight sync.

    outcome = await rl_step(rt, chat, batch, rl=cfg.rl, rollout=cfg.rollout, limits=limits, seed=seed, pad_id=pad)

The step is two halves, `rollout_and_grade` and `update_from`; the stage loops, bench/vs_trl.py,
bench/runtime.py and the tests all call these: there is no other copy of the step body. Invariant: a bad
step raises before its checkpoint is published, so a retry resumes from the last good one:
`InfraFailureShareExceeded` (too many infrastructure failures, before the update), `StaleEngineWeights`
(engine/trainer log-prob gap); `publish` runs last (before the sync with `weight_sync = "checkpoint"`).
Metrics: `rollout/`, `actor/`, `infra/`, `runtime/`, `timing/`, `sync/`, `usage/`.
See docs/rl.md, "One RL step" and "Metrics".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rstar2_core.chat import ChatFormat
from rstar2_core.config.rl import RLConfig
from rstar2_core.config.rollout_sections import RolloutConfig
from rstar2_core.errors import InfraFailureShareExceeded, StaleEngineWeights
from rstar2_core.reward.grade import GRADER_FAILURES
from rstar2_core.rl.data import RLProblem
from rstar2_core.rl.groups import build_step_batch
from rstar2_core.rollout.length_model import LengthModel
from rstar2_core.rollout.types import RolloutLimits, Trajectory
from rstar2_core.runtime.protocol import RuntimeUsage, StageRuntime
from rstar2_core.runtime.usage import step_usage_metrics


@dataclass(frozen=True)
class StepOutcome:
    """What one RL step did: its metrics, whether an optimizer step was taken, the checkpoint it published."""

    metrics: dict[str, float]
    stepped: bool
    checkpoint_url: str | None = None


@dataclass(frozen=True)
class Grades:
    """Rewards per trajectory (`rewards[g][j]`) and, where the grader failed on one (`GRADER_FAILURES`:
    it timed out, or raised / lost its worker), that reason (`grader_failed[g][j]`, else None)."""

    rewards: list[list[float]]
    grader_failed: list[list[str | None]]


def grade_groups(grader: Any, groups: Sequence[Sequence[Trajectory]], answers: Sequence[str]) -> Grades:
    """The grader's 0/1 per trajectory, forced to 0 for truncated trajectories (the paper keeps them with
    reward 0); a trajectory the grader failed on scores 0 and is flagged with the reason."""
    items = [(t.response_text, answers[g]) for g, group in enumerate(groups) for t in group]
    results = grader.grade_many(items) if items else []
    rewards, failed, k = [], [], 0
    for group in groups:
        row, fail = [], []
        for t in group:
            r = results[k]
            row.append(0.0 if t.truncated else float(r.reward))
            fail.append(r.reason if r.reason in GRADER_FAILURES else None)
            k += 1
        rewards.append(row)
        failed.append(fail)
    return Grades(rewards, failed)


def infra_failures(groups: Sequence[Sequence[Trajectory]], grades: Grades) -> dict[str, float]:
    """`infra/...` counts of one step: engine errors, sandbox errors, grader timeouts and errors (each
    trajectory counted once, under its first failure), their sum and its share of the step's trajectories."""
    engine = sandbox = timeouts = errors = 0
    total = 0
    for group, fails in zip(groups, grades.grader_failed):
        for t, fail in zip(group, fails):
            total += 1
            if t.infra_failed:
                if (t.infra_error or "").startswith("engine"):
                    engine += 1
                else:
                    sandbox += 1
            elif fail == "grader_timeout":
                timeouts += 1
            elif fail == "grader_error":
                errors += 1
    failed = engine + sandbox + timeouts + errors
    return {"infra/engine_errors": float(engine), "infra/sandbox_errors": float(sandbox),
            "infra/grader_timeouts": float(timeouts), "infra/grader_errors": float(errors),
            "infra/failed": float(failed), "infra/failed_share": failed / max(1, total)}


@dataclass(frozen=True)
class RolledOut:
    """A batch rolled out and graded, ready for its optimizer step: its problems, the groups
    (`groups[g][j]` of `batch[g]`), their grades and infra counts, the rollout and grading seconds, the
    runtime's usage counters around the rollout, and `policy_version`: the optimizer steps of this stage the engines' weights had taken when
    the rollout started (the step's trainer has taken `step - 1`; the difference is the batch's staleness)."""

    batch: tuple[RLProblem, ...]
    groups: list[list[Trajectory]]
    grades: Grades
    infra: dict[str, float]
    rollout_s: float
    grade_s: float
    usage_before: RuntimeUsage
    usage_after: RuntimeUsage
    policy_version: int = 0


async def rollout_and_grade(rt: StageRuntime, chat: ChatFormat, batch: Sequence[RLProblem], *,
                            rl: RLConfig, rollout: RolloutConfig, limits: RolloutLimits, seed: int,
                            lengths: LengthModel | None = None, policy_version: int = 0) -> RolledOut:
    """The first half of a step: roll `batch` out on the runtime's engines and grade it. Raises
    `InfraFailureShareExceeded` when more than `rl.max_infra_failure_share` of the trajectories failed for
    infrastructure reasons (before any update)."""
    from rstar2_core.rollout import rollout_groups

    grpo = rl.grpo
    t0 = time.perf_counter()
    before = rt.usage()
    groups = await rollout_groups(rt.engines, rt.sandbox, chat, [p.problem for p in batch],
                                  grpo.group_size * grpo.oversample, limits, seed=seed,
                                  scheduler=rollout.scheduler, lengths=lengths,
                                  group_affinity=rollout.group_affinity)
    t1 = time.perf_counter()
    after_rollout = rt.usage()
    grades = grade_groups(rt.grader, groups, [p.answer for p in batch])
    t2 = time.perf_counter()
    infra = infra_failures(groups, grades)
    if infra["infra/failed_share"] > rl.max_infra_failure_share:
        raise InfraFailureShareExceeded(
            f"{infra['infra/failed_share']:.0%} of this step's trajectories failed for infrastructure reasons "
            f"(engine errors {infra['infra/engine_errors']:.0f}, sandbox errors {infra['infra/sandbox_errors']:.0f}, "
            f"grader timeouts {infra['infra/grader_timeouts']:.0f}, grader errors "
            f"{infra['infra/grader_errors']:.0f}), above rl.max_infra_failure_share = "
            f"{rl.max_infra_failure_share}; no update was taken. A retry resumes from the last checkpoint; if it "
            "repeats, check the engines, the sandbox pool size (sandbox.workers) and eval.grader_timeout_s")
    return RolledOut(tuple(batch), groups, grades, infra, t1 - t0, t2 - t1, before, after_rollout, policy_version)


def update_from(rt: StageRuntime, chat: ChatFormat, rolled: RolledOut, *, rl: RLConfig, seed: int, pad_id: int,
                publish: Callable[[dict[str, float]], str | None] | None = None, staleness: int = 0,
                push_weights: bool = True) -> StepOutcome:
    """The second half of a step: `build_step_batch` on the rolled-out groups, one optimizer step, the
    stale-weights check, `publish(metrics)` and (with `push_weights`) the weight push to the engines.
    `timing/step_s` is the batch's rollout and grading plus this half; `staleness`: optimizer steps between
    the weights that sampled the batch and the trainer's (0 in a synchronous step). The log-prob gap
    check applies to fresh batches only: a stale batch's engine log-probs come from older weights by
    design (its tokens are reweighted by `rl.tis_cap`). Without `push_weights` the caller pushes the
    weights (the asynchronous stage loop, rl/pipelined.py, does it between its rollouts) and the metrics
    carry `rollout/staleness`."""
    grpo = rl.grpo
    t2 = time.perf_counter()
    t0 = t2 - rolled.rollout_s - rolled.grade_s      # when the batch's rollout began
    before_train = rt.usage()
    groups, grades, infra = rolled.groups, rolled.grades, rolled.infra
    sb = build_step_batch(groups, grades.rewards, grpo, seed)
    with rt.training():   # the engines may free device memory while the trainer steps; the sync brings them back
        if sb.trajectories:
            actor = rt.trainer.step(list(zip(sb.trajectories, sb.advantages)), micro_batch_size=rl.micro_batch_size,
                                    pad_id=pad_id, temperature=rl.temperature, clip_low=grpo.clip_low,
                                    clip_high=grpo.clip_high, loss_key=grpo.policy_loss, old_logprobs=rl.old_logprobs,
                                    prefix_len=chat.shared_prompt_len, tis_cap=rl.tis_cap,
                                    max_tokens_per_micro_batch=rl.max_tokens_per_micro_batch)
        else:
            actor = {"actor/skipped": 1.0, "actor/tokens": 0.0}
        stepped = not actor.get("actor/skipped")
        gap = actor.get("actor/engine_logprob_gap")
        if stepped and staleness == 0 and gap is not None and gap > rl.max_engine_logprob_gap:
            raise StaleEngineWeights(
                f"engine vs trainer log-prob gap {gap:.4f} per sampled token exceeds rl.max_engine_logprob_gap = "
                f"{rl.max_engine_logprob_gap}: the engines sampled with other weights than the trainer holds (a weight "
                "sync that did not land, or a sampling/template mismatch). The step was not published; a retry "
                "resumes from the last checkpoint")
        t3 = time.perf_counter()
        after_train = rt.usage()
        metrics: dict[str, float] = {**sb.metrics, **actor, **infra, "runtime/engines": float(len(rt.engines)),
                                     "runtime/trainer_ranks": float(rt.trainer.world_size),
                                     "runtime/nodes": float(after_train.nodes)}
        if not push_weights:
            metrics["rollout/staleness"] = float(staleness)
        phases = {"rollout": rolled.rollout_s, "grade": rolled.grade_s, "train": t3 - t2}
        url, publish_s = None, 0.0
        # with checkpoint weight sync the engines reload what is published: publish before the push
        publish_first = push_weights and rt.weight_sync_mode == "checkpoint" and publish is not None
        if publish_first:
            url = publish(metrics)
            publish_s = time.perf_counter() - t3
        t4 = time.perf_counter()
        report = rt.sync_weights(url) if push_weights and stepped else None
    phases["sync"] = time.perf_counter() - t4     # with the engines' wake-up when no update was pushed
    if report is not None:
        metrics.update(report.metrics())
    metrics.update(step_usage_metrics(rolled.usage_before, rolled.usage_after, after_train, phases, groups,
                                      sb.trajectories, n_trainer_ranks=rt.trainer.world_size if rt.trainer else 0,
                                      train_start=before_train))
    metrics.update({f"timing/{k}_s": v for k, v in phases.items()})
    if publish is not None and not publish_first:
        t5 = time.perf_counter()
        url = publish(metrics)
        publish_s = time.perf_counter() - t5
    metrics["timing/publish_s"] = publish_s
    metrics["timing/step_s"] = time.perf_counter() - t0
    return StepOutcome(metrics, stepped, url)


async def rl_step(rt: StageRuntime, chat: ChatFormat, batch: Sequence[RLProblem], *, rl: RLConfig,
                  rollout: RolloutConfig, limits: RolloutLimits, seed: int, pad_id: int,
                  publish: Callable[[dict[str, float]], str | None] | None = None,
                  lengths: LengthModel | None = None) -> StepOutcome:
    """One synchronous GRPO-RoC step on runtime `rt` (see the module docstring): `rollout_and_grade`,
    then `update_from` with the weight push. `rl` holds the algorithm's settings (GRPO-RoC, micro-batch,
    failure thresholds), `rollout` the scheduler's. `lengths`: the stage's `rollout.LengthModel`
    (KV-aware admission learns response lengths from the earlier steps; None starts every step from the
    max-length rule)."""
    rolled = await rollout_and_grade(rt, chat, batch, rl=rl, rollout=rollout, limits=limits, seed=seed,
                                     lengths=lengths)
    return update_from(rt, chat, rolled, rl=rl, seed=seed, pad_id=pad_id, publish=publish)
