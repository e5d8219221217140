"""Attention over packed rows without a dense mask: each segment attends to itself causally and to its
row's shared prefix.

A row is described by its `Segments` (prefix length, segment spans: SFT conversations after one shared
system turn, or an RL micro-batch's trajectories), and attention runs one
`scaled_dot_product_attention` per segment over [prefix keys, own keys]. `with segment_attention(model):`
switches the model to `SEGMENTS` for the forwards inside, and `model(..., segments=...)` hands the
layout over; a call without `segments` inside the block runs plain SDPA with the mask it passed.

Invariant: exact, equal to each sequence alone (tests/unit/sft, tests/unit/rl).
See docs/training-speed.md, "Segment attention".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SEGMENTS = "rstar2_segments"


@dataclass(frozen=True)
class Segments:
    """Layout of one packed row: `prefix` shared tokens at the start, then `spans` [(start, end), ...] of
    independent segments (each sees the prefix and itself); `length` is the row length (the rest is pad)."""

    prefix: int
    spans: tuple[tuple[int, int], ...]
    length: int

    def __post_init__(self) -> None:
        end = self.prefix
        for s, e in self.spans:
            if s != end or e <= s:
                raise ValueError(f"segments must follow the prefix and each other without gaps, got prefix "
                                 f"{self.prefix} and spans {self.spans}")
            end = e
        if end > self.length:
            raise ValueError(f"segments end at {end}, past the row length {self.length}")


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def segment_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, scaling: float | None = None,
                              dropout: float = 0.0, segments: Sequence[Segments] | None = None, **kwargs):
    """transformers attention interface. query: (B, H, T, D), key/value: (B, H_kv, T, D) ->
    ((B, T, H, D), None). Without `segments`: plain SDPA with `attention_mask`."""
    if segments is None:
        return _sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if dropout:
        raise ValueError("segment attention does not implement attention dropout; set attention_dropout = 0")
    b, h, t, _ = query.shape
    if len(segments) != b:
        raise ValueError(f"{len(segments)} segment layouts for a batch of {b} rows")
    rep = h // key.shape[1]
    if rep > 1:                                       # grouped-query attention: share each kv head
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    rows = [_segment_row(query[i:i + 1], key[i:i + 1], value[i:i + 1], seg, t, scaling, i)
            for i, seg in enumerate(segments)]
    return torch.cat(rows, 0).transpose(1, 2).contiguous(), None


def _segment_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments, t: int, scaling: float | None,
                 i: int) -> torch.Tensor:
    """One packed row's attention output (1, H, T, D): the prefix causally, each span over [prefix, itself]."""
    h, d = q.shape[1], q.shape[3]
    if seg.length != t:
        raise ValueError(f"row {i} is {t} tokens but its layout says {seg.length}")
    p = seg.prefix
    pieces = []
    if p:
        pieces.append(F.scaled_dot_product_attention(q[:, :, :p], k[:, :, :p], v[:, :, :p], is_causal=True,
                                                     scale=scaling))
    for s, e in seg.spans:
        if p:
            n = e - s
            allowed = torch.ones(n, p + n, dtype=torch.bool, device=q.device).tril(p)
            kk, vv = torch.cat([k[:, :, :p], k[:, :, s:e]], 2), torch.cat([v[:, :, :p], v[:, :, s:e]], 2)
            pieces.append(F.scaled_dot_product_attention(q[:, :, s:e], kk, vv, attn_mask=allowed, scale=scaling))
        else:
            pieces.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e],
                                                         is_causal=True, scale=scaling))
    end = seg.spans[-1][1] if seg.spans else p
    if end < t:
        pieces.append(q.new_zeros(1, h, t - end, d))
    return torch.cat(pieces, 2)


def register() -> None:
    """Register `SEGMENTS` with transformers' attention functions (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(SEGMENTS, segment_attention_forward)


@contextlib.contextmanager
def segment_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run the model's forwards inside with `SEGMENTS` attention (pass `segments=` to them). With gradient
    checkpointing the backward re-runs the layers and looks the attention up again: keep the backward
    inside the block too (rl_update and sft_update do)."""
    register()
    config = model.get_decoder().config     # the HF config its attention layers read (not a DeepSpeed engine's)
    windowed = [t for t in (getattr(config, "layer_types", None) or []) if t != "full_attention"]
    if windowed or getattr(config, "use_sliding_window", False):
        raise ValueError(f"segment attention implements full causal attention only; this model has "
                         f"{sorted(set(windowed)) or ['sliding_window']} layers")
    before = config._attn_implementation
    config._attn_implementation = SEGMENTS
    try:
        yield
    finally:
        config._attn_implementation = before
