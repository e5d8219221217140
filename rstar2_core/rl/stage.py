"""One RL stage of the recipe: the GRPO-RoC step loop on a runtime, with resumable checkpoints.

    result = run_rl_stage(cfg, 0, init_checkpoint_url=sft_url, data_url=rl_ref.url,
                          out_url="file:///.../rl-stage-1", log_metrics=print_metrics)

`_run` reads top to bottom: open the runtime -> resume (`_start`) -> the loop of steps (`StageSteps`: the
fault hook, the step's checkpoint publisher, the record of a finished step) -> the final checkpoint.
Invariant: every seed comes from `(rl.seed, global_step)` and the data cursor, never a running RNG, so a
resumed stage takes the same batches and logs the same metrics as a straight one.
See docs/rl.md, "The stage loop" and "Checkpoints and resume".
"""

from __future__ import annotations

import asyncio
import io
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rstar2_core import storage
from rstar2_core.config import Config
from rstar2_core.errors import CorruptCheckpoint, StageTrainedNothing
from rstar2_core.faults import maybe_inject_fault
from rstar2_core.models.io import load_tokenizer, publish_copy, read_meta
from rstar2_core.progress import progress_bar
from rstar2_core.results import StageResult
from rstar2_core.rl.checkpoint import (
    STATE_FILE,
    final_url,
    latest_step_checkpoint,
    prune_step_checkpoints,
    read_rl_state,
    rng_state,
    set_rng_state,
    step_url,
)
from rstar2_core.rl.data import RLProblem, batch_indices, load_problems
from rstar2_core.rl.pipelined import StepPlan, run_pipelined
from rstar2_core.rl.step import RolledOut, StepOutcome, rl_step, rollout_and_grade, update_from
from rstar2_core.rl.trainer import RL_STEP
from rstar2_core.rollout.length_model import LengthModel
from rstar2_core.rollout.types import RolloutLimits
from rstar2_core.runtime import TrainerSpec, open_runtime
from rstar2_core.runtime.checkpoint import publish_policy_checkpoint
from rstar2_core.runtime.usage import accumulate

LogMetrics = Callable[[dict, int], None]


def stage_offset(cfg: Config, stage_index: int) -> int:
    """Global RL steps taken before stage `stage_index`."""
    return sum(s.steps for s in cfg.rl.stages[:stage_index])


def step_seed(seed: int, global_step: int) -> int:
    return (seed * 7_919 + global_step * 104_729 + 17) % (1 << 62)


def plan_steps(problems: list[RLProblem], seed: int, cursor: int, steps: range, prompts_per_step: int
               ) -> list[StepPlan]:
    """The batch of every step in `steps`, from the data cursor at the first: step s takes
    `prompts_per_step` problems from the seeded cursor (`rl.data.batch_indices`) and moves it on."""
    plans = []
    for step in steps:
        batch = tuple(problems[i] for i in batch_indices(len(problems), seed, cursor, prompts_per_step))
        cursor += len(batch)
        plans.append(StepPlan(step, batch, cursor))
    return plans


def engine_seq_len(chat, problems: list[RLProblem], max_response_tokens: int) -> int:
    """Longest sequence an engine must hold for these problems: longest prompt + response budget + 1
    (the engine clamps it to the model's max_position_embeddings)."""
    longest_prompt = max(len(chat.prompt_ids(p.problem)) for p in problems)
    return longest_prompt + max_response_tokens + 1


def run_rl_stage(cfg: Config, stage_index: int, *, init_checkpoint_url: str, data_url: str, out_url: str,
                 log_metrics: LogMetrics | None = None, resume: bool = True,
                 tracking_run_id: str | None = None) -> StageResult:
    """Run (or resume) RL stage `stage_index` of `cfg.rl.stages`; returns its final checkpoint (see module doc)."""
    if not 0 <= stage_index < len(cfg.rl.stages):
        raise ValueError(f"stage_index={stage_index} out of range: the profile has {len(cfg.rl.stages)} RL stages "
                         f"(0..{len(cfg.rl.stages) - 1})")
    stage = cfg.rl.stages[stage_index]
    final = final_url(out_url)
    if resume and storage.is_complete(final):
        meta = read_meta(final)
        return StageResult(stage.name, final, meta.get("metrics", {}), int(meta.get("steps", stage.steps)),
                           {"tracking_run_id": meta.get("tracking_run_id"), "resumed": True})
    return asyncio.run(_run(cfg, stage_index, init_checkpoint_url, data_url, out_url, log_metrics, resume,
                            tracking_run_id))


def rl_state(stage: str, step: int, cursor: int, run_id: str | None, metrics: dict, totals: dict,
             world_size: int) -> dict:
    """The driver's state a checkpoint carries (`rl_state.pt`, with the RNG added by `_state_bytes`): the
    last step taken, the data cursor after it, the tracking run id, that step's metrics, the stage's
    running totals and the trainer's world size. What a resume reads back (`read_rl_state`)."""
    return {"step": step, "cursor": cursor, "tracking_run_id": run_id, "metrics": metrics, "stage": stage,
            "totals": totals, "world_size": world_size}


def _state_bytes(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save({**state, "rng": rng_state()}, buf)
    return buf.getvalue()


@dataclass
class StageProgress:
    """What the recorded steps of a stage left: the last step taken, the data cursor after it, the
    tracking run id, that step's metrics and the stage's running totals (`total/...`)."""
    step: int
    cursor: int
    run_id: str | None
    metrics: dict
    totals: dict


def _resume_point(out_url: str, resume: bool) -> tuple[str | None, dict | None]:
    """The newest complete step checkpoint of the stage and its driver state (None, None: start fresh).
    Checked before any engine starts: a retry would find the same files."""
    ckpt = latest_step_checkpoint(out_url) if resume else None
    state = read_rl_state(ckpt) if ckpt is not None else None
    if ckpt is not None and state is None:
        raise CorruptCheckpoint(f"{ckpt} has no RL trainer state ({STATE_FILE}); delete it (the stage then "
                                "resumes from the step checkpoint before it, or starts again) or run with "
                                "resume=False")
    return ckpt, state


def _start(rt, stage_index: int, init_url: str, ckpt: str | None, state: dict | None,
           tracking_run_id: str | None, reset_optimizer: bool) -> StageProgress:
    """Load the trainer for the stage's first step: a step checkpoint's weights, optimizer state and RNG
    (a resume), or the previous stage's optimizer and schedule position (stage k > 0, unless the stage
    resets its optimizer). Returns where the loop starts."""
    if ckpt is None:
        if stage_index > 0:
            rt.trainer.load_state(init_url)     # the previous stage's optimizer and schedule position
        if reset_optimizer:
            rt.trainer.reset_optimizer()
        return StageProgress(0, 0, tracking_run_id, {}, {})
    if not rt.trainer.load_state(ckpt):
        raise CorruptCheckpoint(f"{ckpt} has no optimizer state (trainer/); delete it (the stage then "
                                "resumes from the step checkpoint before it, or starts again) or run "
                                "with resume=False")
    set_rng_state(state["rng"])
    return StageProgress(int(state["step"]), int(state["cursor"]), state.get("tracking_run_id") or tracking_run_id,
                         state.get("metrics", {}), state.get("totals", {}))


class StageSteps:
    """The per-step work of one stage attempt on an open runtime: the fault hook before a step, the
    checkpoint a step publishes when due, and the record of a finished step (metrics with the stage's
    totals logged, `progress` advanced). `run(plans)` runs the steps in order (`rl.max_staleness` = 0) or
    pipelined (rl/pipelined.py)."""

    def __init__(self, cfg: Config, stage_index: int, rt, chat, out_url: str, progress: StageProgress,
                 rejected_rows: int, log_metrics: LogMetrics | None, lengths: LengthModel | None):
        self.cfg, self.rl, self.stage = cfg, cfg.rl, cfg.rl.stages[stage_index]
        self.offset = stage_offset(cfg, stage_index)
        self.rt, self.chat, self.out_url, self.progress = rt, chat, out_url, progress
        self.rejected_rows, self.log_metrics, self.lengths = rejected_rows, log_metrics, lengths
        tok = chat.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.limits = RolloutLimits.from_config(cfg.rollout, self.stage.max_turns, self.stage.max_response_tokens,
                                                self.rl.temperature)
        self.bar = None

    def seed(self, plan: StepPlan) -> int:
        return step_seed(self.rl.seed, self.offset + plan.step)

    async def before_step(self, plan: StepPlan) -> None:
        kind = maybe_inject_fault(self.stage.name, plan.step, self.out_url)
        if kind is not None:
            await self.rt.inject_fault(kind)

    def publisher(self, plan: StepPlan) -> Callable[[dict], str | None]:
        """The step's checkpoint (when due: every `checkpoint_every` steps and at the last), written with
        the totals of the steps recorded before it; prunes to `keep_checkpoints`."""
        totals_before, run_id, gstep = self.progress.totals, self.progress.run_id, self.offset + plan.step
        stage, rl, rt = self.stage, self.rl, self.rt

        def publish(metrics: dict) -> str | None:
            if plan.step % rl.checkpoint_every and plan.step != stage.steps:
                return None
            metrics = {**metrics, "rollout/step": float(plan.step), "data/cursor": float(plan.cursor_after)}
            url = step_url(self.out_url, plan.step)
            state = rl_state(stage.name, plan.step, plan.cursor_after, run_id, metrics,
                             accumulate(totals_before, metrics), rt.trainer.world_size)
            publish_policy_checkpoint(url, rt.trainer, self.chat.tokenizer, extra={STATE_FILE: _state_bytes(state)},
                                      meta={"stage": stage.name, "step": plan.step, "global_step": gstep,
                                            "tracking_run_id": run_id})
            prune_step_checkpoints(self.out_url, rl.keep_checkpoints)
            return url

        return publish

    def record(self, plan: StepPlan, outcome: StepOutcome) -> None:
        metrics = {**outcome.metrics, "rollout/step": float(plan.step), "data/cursor": float(plan.cursor_after),
                   "data/rejected_rows": float(self.rejected_rows)}
        totals = accumulate(self.progress.totals, metrics)
        metrics.update(totals)
        if self.log_metrics is not None:
            self.log_metrics(metrics, self.offset + plan.step)
        self.progress = StageProgress(plan.step, plan.cursor_after, self.progress.run_id, metrics, totals)
        self.bar.update(1)
        self.bar.set_postfix(pass_rate=f"{metrics.get('rollout/pass_rate', float('nan')):.3f}",
                             kept=int(metrics["rollout/groups_kept"]))

    async def run(self, plans: list[StepPlan]) -> StageProgress:
        """Run `plans` and return the progress they left."""
        self.bar = progress_bar(total=self.stage.steps, initial=self.progress.step, desc=self.stage.name,
                                unit="step", file=sys.stderr)
        try:
            if self.rl.max_staleness == 0:
                for plan in plans:
                    await self.before_step(plan)
                    outcome = await rl_step(self.rt, self.chat, list(plan.batch), rl=self.rl,
                                            rollout=self.cfg.rollout, limits=self.limits, seed=self.seed(plan),
                                            pad_id=self.pad_id, publish=self.publisher(plan), lengths=self.lengths)
                    self.record(plan, outcome)
            else:
                await run_pipelined(self.rt, plans, max_staleness=self.rl.max_staleness,
                                    start_version=self.progress.step, rollout=self._rollout, update=self._update,
                                    before_step=self.before_step, after_step=self.record)
        finally:
            self.bar.close()
        return self.progress

    def _rollout(self, plan: StepPlan, version: int):
        return rollout_and_grade(self.rt, self.chat, plan.batch, rl=self.rl, rollout=self.cfg.rollout,
                                 limits=self.limits, seed=self.seed(plan), lengths=self.lengths,
                                 policy_version=version)

    def _update(self, plan: StepPlan, rolled: RolledOut, staleness: int) -> StepOutcome:
        return update_from(self.rt, self.chat, rolled, rl=self.rl, seed=self.seed(plan), pad_id=self.pad_id,
                           publish=self.publisher(plan), staleness=staleness, push_weights=False)


async def _run(cfg: Config, stage_index: int, init_url: str, data_url: str, out_url: str,
               log_metrics: LogMetrics | None, resume: bool, tracking_run_id: str | None) -> StageResult:
    from rstar2_core.chat import ChatFormat

    stage, rl = cfg.rl.stages[stage_index], cfg.rl
    problems, rejected = load_problems(data_url)
    ckpt, state = _resume_point(out_url, resume)
    policy = ckpt or init_url
    chat = ChatFormat(load_tokenizer(policy), with_tools=True)
    # one length model per stage attempt: admission learns from this stage's earlier steps (a resumed
    # attempt relearns; what is admitted when changes, the tokens do not: per-trajectory seeds)
    lengths = LengthModel(stage.max_response_tokens) if cfg.rollout.scheduler == "kv_aware" else None
    spec = TrainerSpec("rl", stage_offset(cfg, len(rl.stages)), rl.warmup_steps, "constant", RL_STEP)
    async with open_runtime(cfg, policy_url=policy, trainer=spec,
                            max_model_len=engine_seq_len(chat, problems, stage.max_response_tokens)) as rt:
        start = _start(rt, stage_index, init_url, ckpt, state, tracking_run_id, stage.reset_optimizer)
        steps = StageSteps(cfg, stage_index, rt, chat, out_url, start, sum(rejected.values()), log_metrics, lengths)
        plans = plan_steps(problems, rl.seed, start.cursor, range(start.step + 1, stage.steps + 1),
                           rl.prompts_per_step)
        done = await steps.run(plans)
        _refuse_untrained(stage.name, stage.steps, done.totals, rl.require_update)
        final_state = rl_state(stage.name, stage.steps, done.cursor, done.run_id, done.metrics, done.totals,
                               rt.trainer.world_size)
        extra = {STATE_FILE: _state_bytes(final_state)}
        meta = {"stage": stage.name, "steps": stage.steps, "global_step": steps.offset + stage.steps,
                "tracking_run_id": done.run_id, "metrics": _plain(done.metrics)}
        # the last step's checkpoint (always written, never pruned: keep_checkpoints >= 1) holds these weights
        final = publish_copy(step_url(out_url, stage.steps), final_url(out_url), extra, meta)
    return StageResult(stage.name, final, _plain(done.metrics), stage.steps, {"tracking_run_id": done.run_id})


def _refuse_untrained(name: str, steps: int, totals: dict, required: bool) -> None:
    """Raise StageTrainedNothing when every one of the stage's `steps` took no optimizer step (a warning
    on stderr instead when `rl.require_update` is off)."""
    if steps <= 0 or totals.get("total/actor/skipped", 0.0) < steps:
        return
    n = {k: int(totals.get(f"total/rollout/groups_{k}", 0.0))
         for k in ("kept", "dropped_all_correct", "dropped_all_wrong", "dropped_too_few")}
    if not required:
        print(f"WARNING: RL stage {name!r} took no optimizer step in its {steps} steps ({n['dropped_all_wrong']} "
              f"groups all wrong, {n['dropped_all_correct']} all right, {n['dropped_too_few']} too few valid); "
              "rl.require_update = false passes its unchanged policy on", file=sys.stderr)
        return
    raise StageTrainedNothing(
        f"RL stage {name!r} ran its {steps} steps without one optimizer step: of its groups "
        f"{n['dropped_all_wrong']} had every rollout wrong, {n['dropped_all_correct']} every rollout right and "
        f"{n['dropped_too_few']} too few valid rollouts ({n['kept']} kept groups had no sampled token to train on); "
        "a group whose rewards do not vary has no advantage. The policy is unchanged and final/ was not written. "
        "Fix: data of the policy's difficulty (an easier stage data set, or the SFT stage first), a larger "
        "rl.grpo.group_size, or a higher rl.temperature; then delete this stage's output folder (its step "
        "checkpoints resume to the same result). rl.require_update = false accepts such a stage (machinery "
        "checks only)")


def _plain(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items()}
