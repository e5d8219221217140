"""Policy losses (a registry of pure functions, keyed by `cfg.rl.grpo.policy_loss`).

`ppo_clip` (the paper's objective): the clipped PPO ratio with clip-higher (0.2 / 0.28), no KL term, no
entropy bonus, aggregated as the token-level mean over every `loss_mask == 1` token; optional truncated
importance sampling against the engine's log-probs (`tis_cap`). Invariants: with `total_tokens` = the
whole step's mask sum, accumulated micro-batch gradients equal the full-batch one; positions with
`loss_mask == 0` are excluded before the exponential, so any finite value there changes neither loss
nor gradient. Shapes: `logprobs, old_logprobs, behaviour_logprobs, loss_mask: (B, T)`; `advantages: (B,)`.

See docs/rl.md, "Choices, and where they depart from the paper or the reference code" (Loss,
Truncated importance sampling).
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
