"""Activation checkpointing on a transformers model, version-proof: what both training backends
(backend.py's torch one, deepspeed_backend.py) call for `model.gradient_checkpointing`.
See docs/models-and-sft.md, "Training backends"."""

from __future__ import annotations

from torch import nn


def enable_activation_checkpointing(model: nn.Module) -> None:
    """`cfg.model.gradient_checkpointing`: HF's non-reentrant activation checkpointing, under the name the
    installed transformers has (`activation_checkpointing_enable` in newer releases, where
    `gradient_checkpointing_enable` is a deprecated alias; only the latter in older ones, e.g. 5.17). A
    model with neither is refused rather than trained without it."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ValueError(f"model.gradient_checkpointing = true, but {type(model).__name__} has no activation "
                         "checkpointing (not a transformers model?); set model.gradient_checkpointing = false")
