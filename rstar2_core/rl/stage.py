"""One RL stage of the recipe: the GRPO-RoC step loop on a runtime, with resumable checkpoints.

    result = run_rl_stage(cfg, 0, init_checkpoint_url=sft_url, data_url=rl_ref.url,
                          out_url="file:///.../rl-stage-1", log_metrics=print_metrics)

The stage opens the runtime of `cluster.runtime` (rstar2_core/runtime/: in-process engines and trainer,
or engine actors, DeepSpeed trainer shards and the sandbox pool on Ray) for the newest checkpoint, then
per step (1-based within the stage; `global_step` continues across stages for warm-up and metrics):

1. `maybe_inject_fault(stage.name, step, out_url)`: a rehearsal fault (raise, kill-engine,
   kill-trainer, engine-errors) fires once per run and the runtime carries it out;
2. prompts: `prompts_per_step` problems from the seeded data cursor (`rl.data.batch_indices`);
3. `rl.step.rl_step`: rollout on the runtime's engines with the stage's turn/length limits, grading,
   `build_step_batch` (infra exclusion, zero-variance drop, RoC, advantages), one optimizer step on
   the runtime's trainer, the weight sync to every engine, and the checkpoint when due: every
   `checkpoint_every` steps and at the last (weights, every rank's optimizer state, RNG, data cursor,
   tracking run id, usage totals), keeping the last `keep_checkpoints`;
4. `log_metrics(metrics, global_step)`: rl_step's metrics plus `total/...` sums over the stage so far.

With `rl.max_staleness` = k >= 1 the same steps run asynchronously (rl/pipelined.py): the engines roll
the next batches out while the trainer updates, within k optimizer steps of the trainer's weights.

Failures: infrastructure failures (a dead actor, a step over `rl.max_infra_failure_share`, stale engine
weights, an injected fault) raise an `InfraError` after the runtime has stopped every actor it started;
Prefect retries the task and the stage resumes from its last complete step checkpoint.

Resume: with `resume=True` a complete `final/` returns at once; otherwise the newest complete step
checkpoint is loaded (weights into the trainer and the engines, each rank's optimizer state: the same
world size is required) and the loop continues with the same next batch and the same metrics (every
seed is derived from `(rl.seed, global_step)` and the data cursor, not from a running RNG).

Across stages: the init checkpoint of stage k > 0 is stage k-1's `final/`, which carries the optimizer
and schedule state; it is loaded unless the stage sets `reset_optimizer` (the paper resets at stage 3,
keeping the schedule position). The LR schedule is linear warm-up over `rl.warmup_steps` optimizer
steps of the whole RL run, then constant. A step whose groups were all dropped takes no optimizer step;
a stage all of whose steps took none raises `StageTrainedNothing` (not retried) instead of writing `final/`
(`rl.require_update = false`: a warning, for machinery checks that learn nothing).
"""

from __future__ import annotations

import asyncio
import io
import sys
from collections.abc import Callable

import torch

from rstar2_core import storage
from rstar2_core.config import Config
from rstar2_core.errors import CorruptCheckpoint, StageTrainedNothing
from rstar2_core.faults import maybe_inject_fault
from rstar2_core.models.io import load_tokenizer, read_meta
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
from rstar2_core.rollout.admission import LengthModel
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


async def _run(cfg: Config, stage_index: int, init_url: str, data_url: str, out_url: str,
               log_metrics: LogMetrics | None, resume: bool, tracking_run_id: str | None) -> StageResult:
    from rstar2_core.chat import ChatFormat

    stage, rl = cfg.rl.stages[stage_index], cfg.rl
    offset = stage_offset(cfg, stage_index)
    total_steps = stage_offset(cfg, len(cfg.rl.stages))
    problems, rejected = load_problems(data_url)
    ckpt = latest_step_checkpoint(out_url) if resume else None
    state = read_rl_state(ckpt) if ckpt is not None else None
    if ckpt is not None and state is None:  # before any engine starts: a retry would find the same files
        raise CorruptCheckpoint(f"{ckpt} has no RL trainer state ({STATE_FILE}); delete it (the stage then "
                                "resumes from the step checkpoint before it, or starts again) or run with "
                                "resume=False")
    policy = ckpt or init_url
    chat = ChatFormat(load_tokenizer(policy), with_tools=True)
    tok = chat.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    limits = RolloutLimits.from_config(cfg.rollout, stage.max_turns, stage.max_response_tokens, rl.temperature)
    # one length model per stage attempt: admission learns from this stage's earlier steps (a resumed
    # attempt relearns; what is admitted when changes, the tokens do not: per-trajectory seeds)
    lengths = LengthModel(stage.max_response_tokens) if cfg.rollout.scheduler == "kv_aware" else None
    spec = TrainerSpec("rl", total_steps, rl.warmup_steps, "constant", RL_STEP)
    start_step, cursor, run_id, last_metrics, totals = 0, 0, tracking_run_id, {}, {}
    async with open_runtime(cfg, policy_url=policy, trainer=spec,
                            max_model_len=engine_seq_len(chat, problems, stage.max_response_tokens)) as rt:
        if ckpt is not None:
            if not rt.trainer.load_state(ckpt):
                raise CorruptCheckpoint(f"{ckpt} has no optimizer state (trainer/); delete it (the stage then "
                                        "resumes from the step checkpoint before it, or starts again) or run "
                                        "with resume=False")
            set_rng_state(state["rng"])
            start_step, cursor = int(state["step"]), int(state["cursor"])
            run_id = state.get("tracking_run_id") or tracking_run_id
            last_metrics, totals = state.get("metrics", {}), state.get("totals", {})
        else:
            if stage_index > 0:
                rt.trainer.load_state(init_url)     # the previous stage's optimizer and schedule position
            if stage.reset_optimizer:
                rt.trainer.reset_optimizer()
        bar = progress_bar(total=stage.steps, initial=start_step, desc=stage.name, unit="step", file=sys.stderr)
        done = {"cursor": cursor, "totals": totals, "metrics": last_metrics}    # what the recorded steps left

        def publisher(plan: StepPlan):
            """The step's checkpoint (when due), written with the totals of the steps recorded before it."""
            totals_before, gstep = done["totals"], offset + plan.step

            def publish(metrics: dict) -> str | None:
                if plan.step % rl.checkpoint_every and plan.step != stage.steps:
                    return None
                metrics = {**metrics, "rollout/step": float(plan.step), "data/cursor": float(plan.cursor_after)}
                url = step_url(out_url, plan.step)
                state = rl_state(stage.name, plan.step, plan.cursor_after, run_id, metrics,
                                 accumulate(totals_before, metrics), rt.trainer.world_size)
                publish_policy_checkpoint(url, rt.trainer, tok, extra={STATE_FILE: _state_bytes(state)},
                                          meta={"stage": stage.name, "step": plan.step, "global_step": gstep,
                                                "tracking_run_id": run_id})
                prune_step_checkpoints(out_url, rl.keep_checkpoints)
                return url

            return publish

        async def before_step(plan: StepPlan) -> None:
            kind = maybe_inject_fault(stage.name, plan.step, out_url)
            if kind is not None:
                await rt.inject_fault(kind)

        def record(plan: StepPlan, outcome: StepOutcome) -> None:
            metrics = {**outcome.metrics, "rollout/step": float(plan.step), "data/cursor": float(plan.cursor_after),
                       "data/rejected_rows": float(sum(rejected.values()))}
            step_totals = accumulate(done["totals"], metrics)
            metrics.update(step_totals)
            if log_metrics is not None:
                log_metrics(metrics, offset + plan.step)
            done.update(cursor=plan.cursor_after, totals=step_totals, metrics=metrics)
            bar.update(1)
            bar.set_postfix(pass_rate=f"{metrics.get('rollout/pass_rate', float('nan')):.3f}",
                            kept=int(metrics["rollout/groups_kept"]))

        plans = plan_steps(problems, rl.seed, cursor, range(start_step + 1, stage.steps + 1), rl.prompts_per_step)
        try:
            if rl.max_staleness == 0:
                for plan in plans:
                    await before_step(plan)
                    outcome = await rl_step(rt, chat, list(plan.batch), rl=rl, rollout=cfg.rollout, limits=limits,
                                            seed=step_seed(rl.seed, offset + plan.step), pad_id=pad_id,
                                            publish=publisher(plan), lengths=lengths)
                    record(plan, outcome)
            else:
                def rollout(plan: StepPlan, version: int):
                    return rollout_and_grade(rt, chat, plan.batch, rl=rl, rollout=cfg.rollout, limits=limits,
                                             seed=step_seed(rl.seed, offset + plan.step), lengths=lengths,
                                             policy_version=version)

                def update(plan: StepPlan, rolled: RolledOut, staleness: int) -> StepOutcome:
                    return update_from(rt, chat, rolled, rl=rl, seed=step_seed(rl.seed, offset + plan.step),
                                       pad_id=pad_id, publish=publisher(plan), staleness=staleness,
                                       push_weights=False)

                await run_pipelined(rt, plans, max_staleness=rl.max_staleness, start_version=start_step,
                                    rollout=rollout, update=update, before_step=before_step, after_step=record)
        finally:
            bar.close()
        cursor, totals, last_metrics = done["cursor"], done["totals"], done["metrics"]
        _refuse_untrained(stage.name, stage.steps, totals, rl.require_update)
        state = rl_state(stage.name, stage.steps, cursor, run_id, last_metrics, totals, rt.trainer.world_size)
        final = publish_policy_checkpoint(final_url(out_url), rt.trainer, tok, extra={STATE_FILE: _state_bytes(state)},
                                          meta={"stage": stage.name, "steps": stage.steps,
                                                "global_step": offset + stage.steps, "tracking_run_id": run_id,
                                                "metrics": _plain(last_metrics)})
    return StageResult(stage.name, final, _plain(last_metrics), stage.steps, {"tracking_run_id": run_id})


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
