"""The RL policy update: log-probs of sampled tokens, the clipped loss over micro-batches, one optimizer step.

`rl_update(backend, trajectories, advantages, ...)` recomputes `old_logprobs` with the policy before the
update (or takes the engine's, `old_logprobs="engine"`), runs `policy_loss` per micro-batch and takes one
optimizer step (`backend.step()`: grad clip, AdamW, LR schedule); `RL_STEP` is that body as every trainer
rank runs it, attention by the backend's kernel (compared with `segments` first where due: kernel_check.py).
Invariant: each micro-batch's loss is divided by the token count of the whole step (`total_tokens`), so the
accumulated gradient is that of the step's token-level mean.

See docs/rl.md, "One RL step" (item 4) and "Choices, and where they depart from the paper or the
reference code" (old_logprobs, truncated importance sampling, dropout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from rstar2_core.models.kernel_check import run_kernel_check
from rstar2_core.models.packed_attention import segment_attention
from rstar2_core.rl.logprobs import batch_logprobs, collate, sequence_logprobs
from rstar2_core.rl.logprobs import model_device as _model_device
from rstar2_core.rl.loss import get_policy_loss
from rstar2_core.rollout.types import Trajectory
from rstar2_core.runtime.micro_batches import cut_micro_batches, over_budget
from rstar2_core.runtime.protocol import TrainerStep

OLD_LOGPROB_SOURCES = ("recompute", "engine")


def padding_trajectory(pad_id: int) -> Trajectory:
    """A two-token sequence with no sampled token: the input of a zero-weight micro-batch. Its forward and
    backward touch every parameter (zero gradients), so a rank with fewer real micro-batches still issues
    the collectives (ZeRO-2 reduce per backward, ZeRO-3 gather per forward) its peers issue."""
    return Trajectory((pad_id,), (pad_id,), (0,), (0.0,), "", (), 0, 0, "eos", False)


def trajectory_length(t: Trajectory, prefix_len: int = 0) -> int:
    """Tokens a trajectory adds to a packed micro-batch row: its prompt past the shared prefix, its response."""
    shared = prefix_len if len(t.prompt_ids) > prefix_len else 0
    return len(t.prompt_ids) - shared + len(t.response_ids)


def cut_trajectories(trajectories: Sequence[Trajectory], *, micro_batch_size: int | None,
                     max_tokens_per_micro_batch: int | None = None, prefix_len: int = 0) -> list[list[int]]:
    """The micro-batches (trajectory indices) `rl_update` runs: `micro_batch_size` trajectories each, or,
    with `max_tokens_per_micro_batch`, packed first-fit-decreasing under that many tokens a row
    (runtime/micro_batches.py)."""
    if max_tokens_per_micro_batch is None:
        return cut_micro_batches([0] * len(trajectories), size=micro_batch_size)
    return cut_micro_batches([trajectory_length(t, prefix_len) for t in trajectories],
                             max_tokens=max_tokens_per_micro_batch, shared=prefix_len)


def rl_update(backend, trajectories: Sequence[Trajectory], advantages: Sequence[float], *, pad_id: int,
              temperature: float = 1.0, micro_batch_size: int | None = 8, clip_low: float = 0.2,
              clip_high: float = 0.28, loss_key: str = "ppo_clip", old_logprobs: str = "recompute",
              total_tokens: float | None = None, num_micro_batches: int | None = None,
              loss_scale: float = 1.0, prefix_len: int = 0, tis_cap: float | None = None,
              max_tokens_per_micro_batch: int | None = None) -> dict[str, float]:
    """One optimizer step on `trajectories` with per-trajectory `advantages` `(B,)`; returns `actor/...` metrics.

    `backend`: a `TrainBackend` (`model`, `backward`, `step`). On a data-parallel rank, pass the step's
    `total_tokens` over all ranks (the loss is then the global token mean), `num_micro_batches` = the
    most any rank needs (this rank pads with zero-weight passes up to it: every rank must issue the same
    collectives) and `loss_scale` = the world size (DeepSpeed averages gradients over ranks).
    `prefix_len`: the prompt tokens every trajectory shares, packed once per micro-batch
    (`logprobs.collate`; `ChatFormat.shared_prompt_len`). `max_tokens_per_micro_batch` cuts the
    micro-batches by a token budget instead of `micro_batch_size` (`cut_trajectories`). A step with
    no sampled token anywhere takes no optimizer step (`actor/skipped` = 1) on any rank."""
    if old_logprobs not in OLD_LOGPROB_SOURCES:
        raise ValueError(f"rl_update: old_logprobs={old_logprobs!r}; valid: {list(OLD_LOGPROB_SOURCES)}")
    if len(trajectories) != len(advantages):
        raise ValueError(f"rl_update: {len(trajectories)} trajectories but {len(advantages)} advantages")
    loss_fn = get_policy_loss(loss_key)
    model = backend.model
    device = _model_device(model)
    local_tokens = float(sum(sum(t.loss_mask) for t in trajectories))
    total = local_tokens if total_tokens is None else float(total_tokens)
    if total == 0:
        return {"actor/skipped": 1.0, "actor/tokens": 0.0}
    cut = cut_trajectories(trajectories, micro_batch_size=micro_batch_size,
                           max_tokens_per_micro_batch=max_tokens_per_micro_batch, prefix_len=prefix_len)
    chunks: list[list[Trajectory]] = [[trajectories[i] for i in mb] for mb in cut]
    need = num_micro_batches if num_micro_batches is not None else max(1, len(chunks))
    if need < len(chunks):
        raise ValueError(f"rl_update: num_micro_batches={need} but these {len(trajectories)} trajectories are cut "
                         f"into {len(chunks)} micro-batches")
    pad = padding_trajectory(pad_id)
    chunks += [[pad]] * (need - len(chunks))
    advs = [[float(advantages[i]) for i in mb] for mb in cut]
    advs += [[0.0]] * (need - len(advs))
    model.train()
    kernel = getattr(backend, "attention_kernel", "auto")
    autocast = backend.autocast if hasattr(backend, "autocast") else contextlib.nullcontext
    recompute = old_logprobs == "recompute"
    recomputed = ([sequence_logprobs(model, c, pad_id, temperature, len(c), prefix_len, kernel) for c in chunks]
                  if recompute else [])
    gap_sum, gap_max = 0.0, 0.0
    sums = {"actor/pg_clipfrac": 0.0, "actor/ratio_mean": 0.0, "actor/ppo_kl": 0.0, "actor/pg_loss": 0.0}
    if tis_cap is not None:
        sums.update({"actor/tis_weight_mean": 0.0, "actor/tis_capped_frac": 0.0})
    checked: dict[str, float] = {}
    for i, chunk in enumerate(chunks):
        batch = collate(chunk, pad_id, device, prefix_len)
        if i == 0:
            checked = run_kernel_check(backend, lambda m, k, b=batch: _sampled_nll(m, b, k, temperature, autocast),
                                       "actor/")
        if recompute:
            old = torch.zeros_like(batch.engine_logprobs)
            for b, t in enumerate(chunk):
                old[b, :len(t.response_ids)] = recomputed[i][b].to(device)
        with segment_attention(model, kernel):  # the backward too: gradient checkpointing re-runs the layers there
            with autocast():
                lp = batch_logprobs(model, batch, temperature, kernel=kernel)
            if not recompute:
                old = lp.detach() if tis_cap is not None else batch.engine_logprobs
            trainer_lp = old if recompute else lp.detach()
            gap = (trainer_lp - batch.engine_logprobs).abs() * batch.loss_mask
            gap_sum += float(gap.sum())
            gap_max = max(gap_max, float(gap.max()) if gap.numel() else 0.0)
            extra = {"behaviour_logprobs": batch.engine_logprobs, "tis_cap": tis_cap} if tis_cap is not None else {}
            loss, m = loss_fn(lp, old, torch.tensor(advs[i], dtype=torch.float32, device=device), batch.loss_mask,
                              clip_low=clip_low, clip_high=clip_high, total_tokens=total, **extra)
            backend.backward(loss * loss_scale if loss_scale != 1.0 else loss)
        for k in sums:
            sums[k] += m[k] * m["actor/tokens"]
    lr = float(getattr(backend, "current_lr", float("nan")))  # the lr this step uses
    grad_norm = backend.step()
    model.eval()
    per = max(local_tokens, 1.0)
    metrics = {**checked, **{k: v / per for k, v in sums.items()}}
    metrics.update({"actor/grad_norm": float(grad_norm), "actor/tokens": local_tokens,
                    "actor/skipped": 0.0, "actor/lr": lr, "actor/micro_batches": float(need),
                    "actor/over_budget": float(over_budget([trajectory_length(t, prefix_len) for t in trajectories],
                                                           max_tokens_per_micro_batch, prefix_len))})
    metrics["actor/engine_logprob_gap"] = gap_sum / per
    metrics["actor/engine_logprob_gap_max"] = gap_max
    return metrics


def _sampled_nll(model: torch.nn.Module, batch, kernel: str, temperature: float, autocast) -> torch.Tensor:
    """The kernel check's loss: the mean negative log-prob of the micro-batch's response tokens under
    `kernel` (not the policy loss, ~0 at ratio 1 with zero-mean advantages: models/kernel_check.py)."""
    with autocast():
        lp = batch_logprobs(model, batch, temperature, kernel=kernel)
    return -(lp * batch.valid).sum() / max(1, int(batch.valid.sum()))


_RANK_MEANS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ratio_mean", "actor/ppo_kl", "actor/engine_logprob_gap",
               "actor/tis_weight_mean", "actor/tis_capped_frac")
_RANK_MAXES = ("actor/engine_logprob_gap_max",)


def rank_update(backend, items: Sequence[tuple[Trajectory, float]], **kwargs) -> dict[str, float]:
    """`rl_update` on one rank's share of the step: `items` are (trajectory, advantage) pairs."""
    return rl_update(backend, [t for t, _ in items], [float(a) for _, a in items], **kwargs)


def item_tokens(item: tuple[Trajectory, float]) -> float:
    """Sampled tokens of a (trajectory, advantage) pair: what it trains on."""
    return float(sum(item[0].loss_mask))


def item_length(item: tuple[Trajectory, float]) -> float:
    """Tokens the forward of a (trajectory, advantage) pair computes (prompt and response)."""
    return float(trajectory_length(item[0]))


def cut_items(items: Sequence[tuple[Trajectory, float]], *, micro_batch_size: int | None,
              max_tokens_per_micro_batch: int | None = None, prefix_len: int = 0, **_: object) -> list[list[int]]:
    """`cut_trajectories` over (trajectory, advantage) pairs: the micro-batches `rank_update` runs."""
    return cut_trajectories([t for t, _ in items], micro_batch_size=micro_batch_size,
                            max_tokens_per_micro_batch=max_tokens_per_micro_batch, prefix_len=prefix_len)


def merge_rank_metrics(per_rank: Sequence[dict[str, float]], tokens: Sequence[float]) -> dict[str, float]:
    """The step's `actor/...` metrics from every rank's: token-weighted means, the (global) grad norm and
    lr of rank 0, the step's token count, rank 0's kernel check figures (the verdict's differences are the
    largest over ranks on every rank)."""
    total = float(sum(tokens))
    if not per_rank or total == 0:
        return {"actor/skipped": 1.0, "actor/tokens": 0.0}
    out = {k: sum(m[k] * t for m, t in zip(per_rank, tokens)) / total for k in _RANK_MEANS if k in per_rank[0]}
    out.update({k: max(m[k] for m in per_rank) for k in _RANK_MAXES if k in per_rank[0]})
    out.update({"actor/grad_norm": per_rank[0]["actor/grad_norm"], "actor/lr": per_rank[0]["actor/lr"],
                "actor/tokens": total, "actor/skipped": 0.0,
                "actor/micro_batches": per_rank[0].get("actor/micro_batches", 1.0),
                "actor/over_budget": sum(m.get("actor/over_budget", 0.0) for m in per_rank)})
    out.update({k: v for k, v in per_rank[0].items() if k.startswith("actor/kernel_check_")})
    return out


RL_STEP = TrainerStep(rank_update, item_tokens, merge_rank_metrics, item_length, cut_items)
"""The RL optimizer step as the runtime's trainer runs it on every rank (runtime.protocol.TrainerStep)."""
