"""Non-reasoning SFT: `run_sft(cfg, *, base_model_url, sft_data_url, out_url, log_metrics=None, resume=True)`.

Renders the SFT conversations through `ChatFormat`, packs them (sft/packing.py) and trains on the
configured runtime's trainer (`cluster.runtime`): AdamW, warm-up then cosine (or constant), global
grad-norm clip, bf16 autocast on GPUs, loss on assistant tokens only (sft/step.py). Step checkpoints go
under `<out_url>/steps/`, the last one (weights and tokenizer) to `<out_url>/final`.

Invariant: a resumed run produces the same weights as an uninterrupted one (the batch order is a pure
function of seed and step); a run that does not reach `sft.converged_loss` raises `SFTNotConverged`
and writes no `final/`. See docs/models-and-sft.md, "Length and convergence" and "Checkpoints and metrics".
"""

from __future__ import annotations

import asyncio
import io
import math
import time
from collections.abc import Callable

import torch

from rstar2_core import storage
from rstar2_core.config import Config
from rstar2_core.errors import CorruptCheckpoint, SFTNotConverged
from rstar2_core.faults import maybe_inject_fault
from rstar2_core.models.io import latest_complete, load_tokenizer, read_extra, read_meta
from rstar2_core.progress import progress_bar
from rstar2_core.results import StageResult
from rstar2_core.runtime import TrainerSpec, open_runtime
from rstar2_core.runtime.checkpoint import publish_policy_checkpoint
from rstar2_core.sft.data import read_sft_rows
from rstar2_core.sft.packing import PackedRow, encode_conversations, epoch_rows
from rstar2_core.sft.step import SFT_STEP

STAGE = "sft"
STATE_FILE = "trainer_state.pt"
KEEP_STEP_CHECKPOINTS = 2
SFT_DRAW_SEED_STRIDE = 1_000
"""A retry after `SFTNotConverged` shuffles the conversations with `sft.seed + draw x this`."""
MetricsFn = Callable[[dict, int], None]


def _save_step(trainer, tokenizer, steps_url: str, step: int, loss: float, recent: list[float],
               converged_step: int | None) -> None:
    buf = io.BytesIO()
    torch.save({"torch_rng": torch.get_rng_state(), "step": step, "recent_losses": list(recent),
                "converged_step": converged_step}, buf)
    publish_policy_checkpoint(storage.join(steps_url, f"step-{step:06d}"), trainer, tokenizer,
                              extra={STATE_FILE: buf.getvalue()}, meta={"step": step, "sft/loss": loss})
    done = [u for u in storage.list_dirs(steps_url) if storage.is_complete(u)]
    for old in sorted(done, key=lambda u: read_meta(u).get("step", -1))[:-KEEP_STEP_CHECKPOINTS]:
        storage.remove(old)


def _batches(rows: list[PackedRow], batch_size: int) -> int:
    return max(1, math.ceil(len(rows) / batch_size))


def _draw(out_url: str) -> int:
    """How many earlier runs of this stage ended without converging (markers under `<out_url>/draws`)."""
    url = storage.join(out_url, "draws")
    return len(storage.list_dirs(url)) if storage.exists(url) else 0


def _training_rows(docs, sc, seed: int, pad_id: int) -> tuple[list[PackedRow], int, float]:
    """The rows of the run, its step count (`epochs` passes, or `max_steps`, the conversations repeating in
    a fresh order each pass) and the rows of one pass."""
    rows = epoch_rows(docs, sc.epochs, seed, sc.max_seq_len, pad_id, sc.pack)
    per_pass = len(rows) / sc.epochs
    if not sc.max_steps:
        return rows, _batches(rows, sc.batch_size), per_pass
    need = sc.max_steps * sc.batch_size
    if need > len(rows):
        rows = epoch_rows(docs, need / per_pass + 1e-9, seed, sc.max_seq_len, pad_id, sc.pack)
    return rows[:need], sc.max_steps, per_pass


def run_sft(cfg: Config, *, base_model_url: str, sft_data_url: str, out_url: str,
            log_metrics: MetricsFn | None = None, resume: bool = True) -> StageResult:
    """Train `base_model_url` on the conversations at `sft_data_url`; the final checkpoint is
    `<out_url>/final`. Resumes from `<out_url>/steps` when `resume`."""
    final_url = storage.join(out_url, "final")
    if resume and storage.is_complete(final_url):
        meta = read_meta(final_url)
        return StageResult(name=STAGE, checkpoint_url=final_url, metrics=meta.get("metrics", {}),
                           steps=int(meta.get("step", 0)), extra={"resumed_final": True})
    return asyncio.run(_run_sft(cfg, base_model_url, sft_data_url, out_url, log_metrics, resume))


async def _run_sft(cfg: Config, base_model_url: str, sft_data_url: str, out_url: str,
                   log_metrics: MetricsFn | None, resume: bool) -> StageResult:
    from rstar2_core.chat import ChatFormat

    sc = cfg.sft
    final_url, steps_url = storage.join(out_url, "final"), storage.join(out_url, "steps")
    last = latest_complete(steps_url) if resume else None
    if last is not None and not storage.exists(storage.join(last, STATE_FILE)):  # a retry finds the same files
        raise CorruptCheckpoint(f"{last} has no SFT state ({STATE_FILE}); delete it (SFT then resumes from the "
                                "step checkpoint before it, or starts again)")
    tokenizer = load_tokenizer(last or base_model_url)
    chat = ChatFormat(tokenizer)
    docs, too_long = encode_conversations(read_sft_rows(sft_data_url), chat, sc.max_seq_len)
    if not docs:
        raise ValueError(f"no SFT conversation fits sft.max_seq_len={sc.max_seq_len} ({too_long} too long); "
                         "raise sft.max_seq_len")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else chat.im_end_id
    draw = _draw(out_url)
    rows, total_steps, per_pass = _training_rows(docs, sc, sc.seed + draw * SFT_DRAW_SEED_STRIDE, pad_id)
    warmup = round(sc.warmup_ratio * total_steps)
    spec = TrainerSpec("sft", total_steps, warmup, sc.schedule, SFT_STEP)
    n_label = sum(sum(m) for _, m in docs)
    metrics: dict[str, float] = {}
    recent: list[float] = []                     # the last converged_window losses
    converged_step: int | None = None
    async with open_runtime(cfg, policy_url=last or base_model_url, trainer=spec, engines=False, sandbox=False,
                            grader=False) as rt:
        start = 0
        if last is not None:
            state = torch.load(io.BytesIO(read_extra(last, STATE_FILE)), weights_only=False)
            if not rt.trainer.load_state(last):
                raise CorruptCheckpoint(f"{last} has no trainer state (trainer/); delete it (SFT then resumes "
                                        "from the step checkpoint before it, or starts again)")
            torch.set_rng_state(state["torch_rng"])
            start = int(state["step"])
            recent, converged_step = list(state.get("recent_losses", [])), state.get("converged_step")
        bar = progress_bar(total=total_steps, initial=start, desc="sft", unit="step", dynamic_ncols=True)
        done = start
        for step in range(start, total_steps):
            kind = maybe_inject_fault(STAGE, step + 1, out_url)
            if kind is not None:
                await rt.inject_fault(kind)
            t0 = time.perf_counter()
            batch_rows = rows[step * sc.batch_size:(step + 1) * sc.batch_size]
            m = rt.trainer.step(batch_rows, micro_batch_size=sc.micro_batch_size, pad_id=pad_id,
                                max_tokens_per_micro_batch=sc.max_tokens_per_micro_batch)
            dt = time.perf_counter() - t0
            metrics = {"sft/loss": m["sft/loss"], "sft/lr": m["sft/lr"], "sft/grad_norm": m["sft/grad_norm"],
                       "sft/tokens_per_s": m["sft/real_tokens"] / dt,
                       "sft/epoch": (step + 1) * sc.batch_size / max(1.0, per_pass),
                       **{k: v for k, v in m.items() if k.startswith("sft/kernel_check_")}}   # the first step's
            recent = (recent + [float(m["sft/loss"])])[-sc.converged_window:]
            if (converged_step is None and sc.converged_loss is not None and len(recent) == sc.converged_window
                    and sum(recent) / len(recent) < sc.converged_loss):
                converged_step = step + 1
            if converged_step is not None:
                metrics["sft/converged_step"] = float(converged_step)
            if log_metrics is not None:
                log_metrics(metrics, step + 1)
            bar.set_postfix(loss=f"{metrics['sft/loss']:.3f}", lr=f"{metrics['sft/lr']:.2e}",
                            tok_s=f"{metrics['sft/tokens_per_s']:.0f}")
            bar.update(1)
            done = step + 1
            stop = (converged_step is not None and sc.steps_after_converged is not None
                    and done >= converged_step + sc.steps_after_converged)
            if stop:
                break
            if sc.checkpoint_every and done % sc.checkpoint_every == 0 and done < total_steps:
                _save_step(rt.trainer, tokenizer, steps_url, done, metrics["sft/loss"], recent, converged_step)
        bar.close()
        if sc.converged_loss is not None and converged_step is None:
            _not_converged(out_url, steps_url, sc, recent, done, draw)
        summary = {**metrics, "sft/n_conversations": len(docs), "sft/n_rows": len(rows),
                   "sft/skipped_too_long": too_long, "sft/label_tokens_per_epoch": n_label, "sft/steps": float(done),
                   "sft/draw": float(draw)}
        publish_policy_checkpoint(final_url, rt.trainer, tokenizer, optimizer=False,
                                  meta={"step": done, "metrics": summary})
    return StageResult(name=STAGE, checkpoint_url=final_url, metrics=summary, steps=done,
                       extra={"resumed_from": last, "total_steps": total_steps, "draw": draw})


def _not_converged(out_url: str, steps_url: str, sc, recent: list[float], steps: int, draw: int) -> None:
    """Drop this draw's step checkpoints, count the draw, raise `SFTNotConverged` with the figures."""
    loss = sum(recent) / max(1, len(recent))
    for url in storage.list_dirs(steps_url) if storage.exists(steps_url) else []:
        storage.remove(url)
    storage.write_json_atomic(storage.join(out_url, "draws", f"draw-{draw:03d}", "result.json"),
                              {"draw": draw, "steps": steps, "loss": loss, "threshold": sc.converged_loss})
    raise SFTNotConverged(
        f"SFT did not converge: the mean loss of its last {len(recent)} steps is {loss:.4f}, above "
        f"sft.converged_loss = {sc.converged_loss}, after {steps} steps (draw {draw + 1}); the policy has not "
        "learned the task, so RL would not train (for the tiny profile: the copying phase change did not happen "
        "in this draw, docs/sft-learning.md). No final checkpoint was written. A retry starts SFT over with the "
        "conversations in another order; more steps (sft.max_steps) or another schedule make a miss rarer",
        loss, float(sc.converged_loss), steps, draw)
