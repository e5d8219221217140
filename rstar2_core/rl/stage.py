"""One RL stage of the recipe: the GRPO-RoC step loop with resumable checkpoints.

    result = run_rl_stage(cfg, 0, init_checkpoint_url=sft_url, data_url=rl_ref.url,
                          out_url="file:///.../rl-stage-1", log_metrics=print_metrics)

Per step (1-based within the stage; `global_step` continues across stages for warm-up and metrics):

1. `maybe_inject_fault(stage.name, step)`;
2. prompts: `prompts_per_step` problems from the seeded data cursor (`rl.data.batch_indices`);
3. rollout: `oversample x group_size` trajectories per prompt through `rollout.rollout_groups` on an
   `HFEngine` that holds its own copy of the policy, with the stage's turn/length limits;
4. grade with `reward.GraderPool` (truncated trajectories score 0, as in the paper);
5. `rl.groups.build_step_batch`: infra exclusion, zero-variance drop, RoC to `group_size`, advantages;
6. `rl.trainer.rl_update`: recomputed old log-probs, micro-batches, one optimizer step;
7. push the new weights to the engine (`engine.update_weights(state_dict)`);
8. `log_metrics(metrics, global_step)`: `rollout/...`, `actor/...`, `timing/{rollout,grade,train,sync,ckpt,step}_s`;
9. every `checkpoint_every` steps (and at the last): model, optimizer, scheduler, RNG, data cursor and
   tracking run id, keeping the last `keep_checkpoints`.

Resume: with `resume=True` a complete `final/` returns at once; otherwise the newest complete step
checkpoint is loaded and the loop continues with the same next batch and the same metrics (every seed
is derived from `(rl.seed, global_step)` and the data cursor, not from a running RNG).

Across stages: the init checkpoint of stage k > 0 is stage k-1's `final/`, which carries the optimizer
and schedule state; it is loaded unless the stage sets `reset_optimizer` (the paper resets at stage 3,
keeping the schedule position). The LR schedule is linear warm-up over `rl.warmup_steps` optimizer
steps of the whole RL run, then constant. A step whose groups were all dropped takes no optimizer step.

Departures: one in-process HF engine (production swaps in vLLM engines through the same `Engine`
protocol); the engine gets in-memory state_dicts (`rollout.weight_sync = "state_dict"`).
"""

from __future__ import annotations

import asyncio
import copy
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

from rstar2_core import storage
from rstar2_core.config import Config
from rstar2_core.faults import maybe_inject_fault
from rstar2_core.models.backend import make_backend
from rstar2_core.models.io import load_model_and_tokenizer, read_meta
from rstar2_core.results import StageResult
from rstar2_core.rl.checkpoint import (
    final_url,
    latest_step_checkpoint,
    prune_step_checkpoints,
    read_rl_state,
    save_rl_checkpoint,
    set_rng_state,
    step_url,
)
from rstar2_core.rl.data import RLProblem, batch_indices, load_problems
from rstar2_core.rl.groups import build_step_batch
from rstar2_core.rl.trainer import rl_update
from rstar2_core.rollout.types import RolloutLimits

LogMetrics = Callable[[dict, int], None]


def stage_offset(cfg: Config, stage_index: int) -> int:
    """Global RL steps taken before stage `stage_index`."""
    return sum(s.steps for s in cfg.rl.stages[:stage_index])


def step_seed(seed: int, global_step: int) -> int:
    return (seed * 7_919 + global_step * 104_729 + 17) % (1 << 62)


def grade_rewards(grader, groups, answers: list[str]) -> list[list[float]]:
    """Rewards per trajectory: the grader's 0/1, forced to 0 for truncated trajectories (the paper keeps
    them with reward 0)."""
    items = [(t.response_text, answers[g]) for g, group in enumerate(groups) for t in group]
    results = grader.grade_many(items) if items else []
    out, k = [], 0
    for group in groups:
        row = []
        for t in group:
            row.append(0.0 if t.truncated else float(results[k].reward))
            k += 1
        out.append(row)
    return out


def _engine_seq_len(model, chat, problems: list[RLProblem], max_response_tokens: int) -> int:
    longest_prompt = max(len(chat.prompt_ids(p.problem)) for p in problems)
    return min(int(model.config.max_position_embeddings), longest_prompt + max_response_tokens + 1)


def _build_engine(model, tokenizer, cfg: Config, seq_len: int):
    from rstar2_core.rollout.hf_engine import HFEngine

    engine_model = copy.deepcopy(model).eval()
    for p in engine_model.parameters():
        p.requires_grad_(False)
    return HFEngine(engine_model, tokenizer, max_batch_size=cfg.rollout.max_batch_size,
                    device=next(model.parameters()).device, max_seq_len=seq_len)


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


async def _run(cfg: Config, stage_index: int, init_url: str, data_url: str, out_url: str,
               log_metrics: LogMetrics | None, resume: bool, tracking_run_id: str | None) -> StageResult:
    from rstar2_core.chat import ChatFormat
    from rstar2_core.reward import GraderPool
    from rstar2_core.rollout import rollout_groups
    from rstar2_core.sandbox import make_sandbox

    stage, rl, grpo = cfg.rl.stages[stage_index], cfg.rl, cfg.rl.grpo
    offset = stage_offset(cfg, stage_index)
    total_steps = stage_offset(cfg, len(cfg.rl.stages))
    problems, rejected = load_problems(data_url)

    ckpt = latest_step_checkpoint(out_url) if resume else None
    model, tokenizer = load_model_and_tokenizer(ckpt or init_url, dtype=cfg.model.dtype)
    backend = make_backend(model, rl, total_steps=total_steps, warmup_steps=rl.warmup_steps, schedule="constant")
    start_step, cursor, run_id, last_metrics = 0, 0, tracking_run_id, {}
    if ckpt is not None:
        state = read_rl_state(ckpt)
        if state is None:
            raise FileNotFoundError(f"{ckpt} has no rl_state.pt; delete it or run with resume=False")
        backend.load_state_dict(state["backend"])
        set_rng_state(state["rng"])
        start_step, cursor = int(state["step"]), int(state["cursor"])
        run_id = state.get("tracking_run_id") or tracking_run_id
        last_metrics = state.get("metrics", {})
    else:
        prev = read_rl_state(init_url) if stage_index > 0 else None
        if prev is not None:
            backend.load_state_dict(prev["backend"])
        if stage.reset_optimizer:
            backend.reset_optimizer()

    chat = ChatFormat(tokenizer, with_tools=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    limits = RolloutLimits.from_config(cfg.rollout, stage.max_turns, stage.max_response_tokens, rl.temperature)
    engine = _build_engine(model, tokenizer, cfg, _engine_seq_len(model, chat, problems, stage.max_response_tokens))
    n_roll = grpo.group_size * grpo.oversample
    bar = tqdm(total=stage.steps, initial=start_step, desc=stage.name, unit="step", file=sys.stderr,
               disable=None)
    try:
        async with make_sandbox(cfg.sandbox) as sandbox:
            with GraderPool(timeout_s=cfg.eval.grader_timeout_s) as grader:
                for step in range(start_step + 1, stage.steps + 1):
                    gstep = offset + step
                    maybe_inject_fault(stage.name, step)
                    t0 = time.perf_counter()
                    batch = [problems[i] for i in batch_indices(len(problems), rl.seed, cursor, rl.prompts_per_step)]
                    seed = step_seed(rl.seed, gstep)
                    groups = await rollout_groups(engine, sandbox, chat, [p.problem for p in batch], n_roll, limits,
                                                  seed=seed, scheduler=cfg.rollout.scheduler)
                    t1 = time.perf_counter()
                    rewards = grade_rewards(grader, groups, [p.answer for p in batch])
                    t2 = time.perf_counter()
                    sb = build_step_batch(groups, rewards, grpo, seed)
                    if sb.trajectories:
                        actor = rl_update(backend, sb.trajectories, sb.advantages, pad_id=pad_id,
                                          temperature=rl.temperature, micro_batch_size=rl.micro_batch_size,
                                          clip_low=grpo.clip_low, clip_high=grpo.clip_high, loss_key=grpo.policy_loss,
                                          old_logprobs=rl.old_logprobs)
                    else:
                        actor = {"actor/skipped": 1.0, "actor/tokens": 0.0}
                    t3 = time.perf_counter()
                    if not actor.get("actor/skipped"):
                        engine.update_weights({k: v.detach() for k, v in model.state_dict().items()})
                    t4 = time.perf_counter()
                    cursor += len(batch)
                    metrics = {**sb.metrics, **actor, "rollout/step": float(step), "data/cursor": float(cursor),
                               "data/rejected_rows": float(sum(rejected.values()))}
                    ck_s = 0.0
                    if step % rl.checkpoint_every == 0 or step == stage.steps:
                        save_rl_checkpoint(step_url(out_url, step), backend, tokenizer,
                                           {"step": step, "cursor": cursor, "tracking_run_id": run_id,
                                            "metrics": metrics, "stage": stage.name},
                                           meta={"stage": stage.name, "step": step, "global_step": gstep,
                                                 "tracking_run_id": run_id})
                        prune_step_checkpoints(out_url, rl.keep_checkpoints)
                        ck_s = time.perf_counter() - t4
                    metrics.update({"timing/rollout_s": t1 - t0, "timing/grade_s": t2 - t1, "timing/train_s": t3 - t2,
                                    "timing/sync_s": t4 - t3, "timing/ckpt_s": ck_s,
                                    "timing/step_s": time.perf_counter() - t0})
                    if log_metrics is not None:
                        log_metrics(metrics, gstep)
                    last_metrics = metrics
                    bar.update(1)
                    bar.set_postfix(pass_rate=f"{metrics.get('rollout/pass_rate', float('nan')):.3f}",
                                    kept=int(metrics["rollout/groups_kept"]))
    finally:
        bar.close()
        await engine.close()
    final = final_url(out_url)
    save_rl_checkpoint(final, backend, tokenizer,
                       {"step": stage.steps, "cursor": cursor, "tracking_run_id": run_id, "metrics": last_metrics,
                        "stage": stage.name},
                       meta={"stage": stage.name, "steps": stage.steps, "global_step": offset + stage.steps,
                             "tracking_run_id": run_id, "metrics": _plain(last_metrics)})
    return StageResult(stage.name, final, _plain(last_metrics), stage.steps, {"tracking_run_id": run_id})


def _plain(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items()}
