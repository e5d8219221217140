"""The RL policy update: log-probs of sampled tokens, the clipped loss over micro-batches, one optimizer step.

`rl_update(backend, trajectories, advantages, ...)` does one RL step's update, as in the paper (one
optimizer step per RL step, grad clip from the config):

1. `old_logprobs` are *recomputed* with the policy before the update (one no-grad forward), the verl
   choice: the engine's sampling log-probs come from a KV-cached decode (and, with vLLM, another
   kernel set and precision), so their ratio to the trainer's forward is not exactly 1 even for
   identical weights, and clipping would then act on numerical noise. With `old_logprobs="engine"` the
   sampling log-probs are used instead (cheaper by one forward; the ratio then also measures
   engine/trainer mismatch). In recompute mode `actor/engine_logprob_gap` (mean |engine - trainer|
   over sampled tokens) is logged, which catches a temperature or template mismatch at once.
2. The loss is `policy_loss` per micro-batch with `total_tokens` = the mask sum over *all* kept
   trajectories, so the accumulated gradient is that of the token-level mean over the whole step (not
   a mean of per-micro-batch means).
3. `backend.step()` clips, steps AdamW and the LR schedule, and zeroes the gradients.

Log-probs (`rl/logprobs.py`: `collate`, `batch_logprobs`, `sequence_logprobs`): a micro-batch's
trajectories packed in one row with per-trajectory attention, the LM head and log-softmax at response
positions only, chunk by chunk (no fp32 logits over the vocabulary for all tokens at once), divided by
the sampling temperature. Shapes: trajectories of prompt length P_b and response length R_b give
`logprobs: (B, R_max)` with 0 beyond R_b; `loss_mask: (B, R_max)` from `Trajectory.loss_mask` (tool
output tokens 0).

Departure: the model is kept in `train()` mode for the gradient forward (gradient checkpointing needs
it); RL assumes dropout probabilities of 0 (true of Qwen2/Qwen3 configs), otherwise the recomputed
`old_logprobs` and the training forward would see different dropout masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from rstar2_core.rl.logprobs import _chunks, batch_logprobs, collate, sequence_logprobs
from rstar2_core.rl.logprobs import model_device as _model_device
from rstar2_core.rl.loss import get_policy_loss
from rstar2_core.rollout.types import Trajectory

OLD_LOGPROB_SOURCES = ("recompute", "engine")


def rl_update(backend, trajectories: Sequence[Trajectory], advantages: Sequence[float], *, pad_id: int,
              temperature: float = 1.0, micro_batch_size: int = 8, clip_low: float = 0.2,
              clip_high: float = 0.28, loss_key: str = "ppo_clip", old_logprobs: str = "recompute"
              ) -> dict[str, float]:
    """One optimizer step on `trajectories` with per-trajectory `advantages` `(B,)`; returns `actor/...` metrics.

    `backend`: a `TrainBackend` (`model`, `backward`, `step`). Trajectories with no sampled token
    contribute nothing; with none at all in the batch, no step is taken (`actor/skipped` = 1)."""
    if old_logprobs not in OLD_LOGPROB_SOURCES:
        raise ValueError(f"rl_update: old_logprobs={old_logprobs!r}; valid: {list(OLD_LOGPROB_SOURCES)}")
    if len(trajectories) != len(advantages):
        raise ValueError(f"rl_update: {len(trajectories)} trajectories but {len(advantages)} advantages")
    loss_fn = get_policy_loss(loss_key)
    model = backend.model
    device = _model_device(model)
    total_tokens = float(sum(sum(t.loss_mask) for t in trajectories))
    if total_tokens == 0:
        return {"actor/skipped": 1.0, "actor/tokens": 0.0}
    model.train()
    recompute = old_logprobs == "recompute"
    recomputed = sequence_logprobs(model, trajectories, pad_id, temperature, micro_batch_size) if recompute else []
    gap_sum = 0.0
    sums = {"actor/pg_clipfrac": 0.0, "actor/ratio_mean": 0.0, "actor/ppo_kl": 0.0, "actor/pg_loss": 0.0}
    adv_all = torch.tensor(list(advantages), dtype=torch.float32)
    for sl in _chunks(len(trajectories), micro_batch_size):
        chunk = trajectories[sl]
        batch = collate(chunk, pad_id, device)
        if float(batch.loss_mask.sum()) == 0:
            continue
        if recompute:
            old = torch.zeros_like(batch.engine_logprobs)
            for b, t in enumerate(chunk):
                old[b, :len(t.response_ids)] = recomputed[sl.start + b].to(device)
            gap_sum += float(((old - batch.engine_logprobs).abs() * batch.loss_mask).sum())
        else:
            old = batch.engine_logprobs
        with backend.autocast() if hasattr(backend, "autocast") else contextlib.nullcontext():
            lp = batch_logprobs(model, batch, temperature)
        loss, m = loss_fn(lp, old, adv_all[sl].to(device), batch.loss_mask, clip_low=clip_low,
                          clip_high=clip_high, total_tokens=total_tokens)
        backend.backward(loss)
        for k in sums:
            sums[k] += m[k] * m["actor/tokens"]
    lr = float(getattr(backend, "current_lr", float("nan")))  # the lr this step uses
    grad_norm = backend.step()
    model.eval()
    metrics = {k: v / total_tokens for k, v in sums.items()}
    metrics.update({"actor/grad_norm": float(grad_norm), "actor/tokens": total_tokens,
                    "actor/skipped": 0.0, "actor/lr": lr})
    if recompute:
        metrics["actor/engine_logprob_gap"] = gap_sum / total_tokens
    return metrics
