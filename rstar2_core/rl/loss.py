"""Policy losses (a registry of pure functions, keyed by `cfg.rl.grpo.policy_loss`).

`ppo_clip` (the paper's objective): per token `ratio = exp(logprobs - old_logprobs)`,
`per_token_loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)` with clip-higher
(0.2 / 0.28), aggregated as the token-level mean over every token with `loss_mask == 1` in the batch
(sum / mask sum). No KL term, no entropy bonus (RECIPE.md).

Micro-batching: pass `total_tokens` = the mask sum over the *whole* RL step's kept trajectories; each
micro-batch's loss is then its masked sum divided by that global count, so accumulating the micro-batch
gradients gives exactly the gradient of the full-batch token mean (a per-micro-batch mean would weight
the tokens of short micro-batches more).

Truncated importance sampling (`tis_cap = C`, verl's token-level TIS, TRL's and slime's vLLM correction):
the tokens were sampled by the engine (`behaviour_logprobs`, its log-probs), not by the trainer's policy
(`old_logprobs`); each token's loss is weighted by `min(exp(old_logprobs - behaviour_logprobs), C)`,
detached: the ratio corrects the mismatch between the two (kernels, precision, stale weights), the cap
bounds the variance a token the engine found unlikely would add. Off (None), the loss is the paper's.

Shapes: `logprobs, old_logprobs, behaviour_logprobs, loss_mask: (B, T)`; `advantages: (B,)` (broadcast over T).
Positions with `loss_mask == 0` (prompt, tool output, padding) may hold any finite value: they are
excluded before the exponential, so they change neither the loss nor the gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
                total_tokens: float | None = None, behaviour_logprobs: torch.Tensor | None = None,
                tis_cap: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio policy loss (scalar) and metrics `actor/pg_loss`, `actor/pg_clipfrac`,
    `actor/ratio_mean`, `actor/ppo_kl` (approx KL(old || new) = mean(old_logprobs - logprobs)),
    `actor/tokens` (mask sum of this call); with `tis_cap`, `actor/tis_weight_mean` and
    `actor/tis_capped_frac` (share of tokens whose weight hit the cap). Metrics are means over this
    call's masked tokens."""
    if logprobs.shape != old_logprobs.shape or logprobs.shape != loss_mask.shape or logprobs.dim() != 2:
        raise ValueError(f"policy_loss: logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
                         f"and loss_mask {tuple(loss_mask.shape)} must all be (B, T)")
    if tis_cap is not None and (behaviour_logprobs is None or behaviour_logprobs.shape != logprobs.shape):
        raise ValueError("policy_loss: tis_cap needs behaviour_logprobs of the same (B, T) shape as logprobs")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"policy_loss: advantages must be (B,) = ({logprobs.shape[0]},), got {tuple(advantages.shape)}")
    mask = loss_mask.to(logprobs.dtype)
    on = mask > 0
    n_tokens = mask.sum()
    denom = float(total_tokens) if total_tokens is not None else n_tokens.clamp(min=1.0)
    log_ratio = torch.where(on, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(logprobs.dtype).unsqueeze(1)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token_loss = torch.maximum(unclipped, clipped)
    if tis_cap is not None:
        behaviour_gap = torch.where(on, old_logprobs.detach() - behaviour_logprobs.detach(), torch.zeros_like(logprobs))
        raw = torch.exp(behaviour_gap)
        tis = torch.clamp(raw, max=tis_cap)
        per_token_loss = per_token_loss * tis
    loss = (per_token_loss * mask).sum() / denom
    with torch.no_grad():
        n = float(n_tokens)
        safe = max(n, 1.0)
        metrics = {
            "actor/pg_loss": float((per_token_loss * mask).sum()) / safe,
            "actor/pg_clipfrac": float(((clipped > unclipped) & on).sum()) / safe,
            "actor/ratio_mean": float((ratio * mask).sum()) / safe,
            "actor/ppo_kl": float((-log_ratio * mask).sum()) / safe,
            "actor/tokens": n,
        }
        if tis_cap is not None:
            metrics["actor/tis_weight_mean"] = float((tis * mask).sum()) / safe
            metrics["actor/tis_capped_frac"] = float(((raw > tis_cap) & on).sum()) / safe
    return loss, metrics


PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo_clip": policy_loss}


def get_policy_loss(key: str) -> PolicyLoss:
    if key not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {key!r}; valid keys: {sorted(POLICY_LOSSES)} (cfg.rl.grpo.policy_loss)")
    return POLICY_LOSSES[key]
