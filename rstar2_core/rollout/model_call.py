"""The engine's call into a transformers causal LM, the same on transformers 5.17 through 5.24.

transformers renamed the forward's cache argument `past_key_values` -> `cache` (5.17 knows only the
old name and silently swallows `cache=`), so the name is read once from the model class's `forward`
signature. `check_model` refuses, with the fix, models the engine's masks would get wrong (attention
other than `sdpa`/`eager`, sliding-window or other non-full layers). `disable_cudnn_attention` keeps
SDPA off cuDNN attention, whose per-shape plans cost more than the attention when shapes keep changing.
Invariant: every forward the engine runs goes through `ModelCall`, never `model(...)` directly.
See docs/rollout.md, "HFEngine" (transformers versions).
"""

from __future__ import annotations

import inspect

import torch

CACHE_NAMES = ("cache", "past_key_values")
# False: `disable_cudnn_attention` takes cuDNN's attention out of SDPA's choices (see there). True keeps torch's
# own choice; bench/sdpa_shapes.py sets it to compare.
ALLOW_CUDNN_ATTENTION = False


def disable_cudnn_attention() -> None:
    """Take cuDNN's fused attention out of `scaled_dot_product_attention`'s choices, for the rest of the
    process and for every model in it (torch's backend flags are process-wide; this never turns it back
    on). Idempotent; off CUDA the flag is set but nothing reads it. Called by the HF engine and by
    `models.token_logprobs.decoder_hidden` (every training forward).

    Why: cuDNN builds an execution plan on the host for each new attention shape (10-16 ms a call,
    forward and backward, in a profile), and the shapes here change every step: the trainer's segment
    attention makes one SDPA call per conversation or trajectory, of new lengths each step, and the
    engine's rows and lengths change as requests come and go. Measured on an H200 (torch 2.11, cuDNN
    9.19, bench/sdpa_shapes.py, docs/production.md): the 0.5B-shape SFT step on new rows took 2.8-3.8 s
    with cuDNN among SDPA's choices and 0.35-0.48 s without; a cold engine's 64 x 128 tokens (tiny shape)
    10.9 s vs 0.57 s. The trade-off: SDPA then takes flash or memory-efficient attention, which have no
    per-shape set-up; where shapes repeat (a fixed-shape benchmark) cuDNN's kernel can be the faster one,
    which this gives up. The backends compute the same attention up to floating-point order (not compared
    on the GPU here)."""
    if not ALLOW_CUDNN_ATTENTION and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which `type(model).forward` takes its KV cache."""
    params = inspect.signature(type(model).forward).parameters
    for name in CACHE_NAMES:
        if name in params:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes no KV cache argument (looked for {list(CACHE_NAMES)}); "
                    "HFEngine needs a transformers causal LM")


def check_model(model: torch.nn.Module) -> str:
    """The attention implementation ('sdpa' or 'eager') of a model the engine can run; else ValueError."""
    cfg = model.config
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        raise ValueError(f"HFEngine builds 4D attention masks, which attn_implementation={impl!r} does not take; "
                         "load the model with attn_implementation='sdpa'")
    other = sorted({t for t in (getattr(cfg, "layer_types", None) or ()) if t != "full_attention"})
    if other:
        raise ValueError(f"HFEngine gives every layer a full causal mask, but this model has {other} layers; "
                         "use vLLM for it, or a config without sliding-window layers")
    return impl


class ModelCall:
    """`model(input_ids, position_ids, mask, cache) -> logits` with the cache under the model's own name."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.cache_name = model, cache_kwarg(model)

    def __call__(self, ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, cache,
                 logits_to_keep: int = 0, **attention_kwargs) -> torch.Tensor:
        """ids, position_ids: (rows, q) -> logits (rows, q or logits_to_keep, vocab). `attention_kwargs`
        reach the attention function (transformers passes forward kwargs down to it)."""
        return self.model(input_ids=ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                          logits_to_keep=logits_to_keep, **{self.cache_name: cache}, **attention_kwargs).logits
