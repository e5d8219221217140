"""Decode attention that reads a prefix shared by the running rows once per step, not once per row.

The prefix's keys and values are kept once (`PrefixBlock`); in a decode step each row's query is scored
against the block (one matrix product for all rows) and against its own slot from the shared length
on, with one softmax over both: cascade attention in plain matrix products. The engine runs that
forward under `ATTENTION`, set on the model's config for the one call, with `shared_prefix=` in the
forward kwargs. Invariant: exact attention over each row's whole context (row r uses the block only
for its first `shared[r]` tokens, which equal the block's), equal to the plain step within float
rounding; the engine must own its model, or another thread's forward would run under the switch.
See docs/rollout.md, "Shared-prefix decode step (`shared_prefix.py`)".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from rstar2_core.rollout.prefix import common_prefix

ATTENTION = "rstar2_shared_prefix"
MIN_SHARED = 64      # fewer shared tokens than this: the plain step (the block's read would not pay)


class PrefixBlock:
    """One token sequence's keys and values, once: `keys[l]`, `values[l]` of shape (1, kv_heads, P, head_dim)."""

    def __init__(self, tokens: np.ndarray, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.tokens, self.keys, self.values = tokens, keys, values

    def __len__(self) -> int:
        return len(self.tokens)

    def shared_with(self, prompt: np.ndarray) -> int:
        """How many leading tokens of `prompt` the block holds (common prefix length)."""
        return common_prefix(self.tokens, prompt, len(prompt))


@dataclass(frozen=True)
class SharedPrefix:
    """What one decode forward's attention layers need besides their own-slot keys: the block, and the
    additive mask (rows, 1, 1, P) of the block positions each row attends (its first `shared[r]`)."""

    block: PrefixBlock
    mask: torch.Tensor


def shared_prefix_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                                    scaling: float | None = None, dropout: float = 0.0,
                                    shared_prefix: SharedPrefix | None = None, **kwargs):
    """transformers attention interface. query (R, H, 1, D); key/value (R, H_kv, L_own, D): each row's own
    positions from the step's shared start on; attention_mask (R, 1, 1, L_own) additive ->
    ((R, 1, H, D), None). Without `shared_prefix`: plain SDPA."""
    if shared_prefix is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    r, h, q, d = query.shape
    if q != 1 or dropout:
        raise ValueError(f"shared-prefix attention is for decode steps (one query per row, no dropout); got "
                         f"{q} queries, dropout {dropout}")
    layer = module.layer_idx
    pk, pv = shared_prefix.block.keys[layer][0], shared_prefix.block.values[layer][0]   # (H_kv, P, D)
    hkv = key.shape[1]
    g = h // hkv                                           # query heads per kv head (grouped-query attention)
    scale = d ** -0.5 if scaling is None else scaling
    qg = query.reshape(r, hkv, g, d)                       # (R, H_kv, g, D)
    # the block: every row's queries against one copy of the prefix keys
    s_pre = torch.matmul(qg.transpose(0, 1).reshape(hkv, r * g, d), pk.transpose(-1, -2))     # (H_kv, R g, P)
    s_pre = s_pre.view(hkv, r, g, -1).transpose(0, 1)                                        # (R, H_kv, g, P)
    s_own = torch.matmul(qg, key.transpose(-1, -2))                                           # (R, H_kv, g, L)
    scores = torch.cat([s_pre, s_own], -1).float() * scale
    scores = scores + torch.cat([shared_prefix.mask, attention_mask], -1).float()           # (R, 1, 1, P + L)
    probs = scores.softmax(-1).to(value.dtype)
    p = pk.shape[1]
    out_pre = torch.matmul(probs[..., :p].transpose(0, 1).reshape(hkv, r * g, p), pv)         # (H_kv, R g, D)
    out = out_pre.view(hkv, r, g, d).transpose(0, 1) + torch.matmul(probs[..., p:], value)   # (R, H_kv, g, D)
    return out.reshape(r, 1, h, d), None


_registered = False


def register() -> None:
    """Register `ATTENTION` with transformers' attention functions (once per process)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION, shared_prefix_attention_forward)
        _registered = True


@contextlib.contextmanager
def shared_prefix_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run the model's forwards inside under `ATTENTION` (pass `shared_prefix=` to them)."""
    register()
    config = model.get_decoder().config
    before = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
