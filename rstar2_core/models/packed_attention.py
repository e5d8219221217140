"""Attention over packed rows without a dense mask: each segment attends to itself causally and to its
row's shared prefix.

A row's `Segments` (prefix length, spans) drive two kernels: `segments`, one SDPA per segment over [prefix
keys, own keys] (any device), and `flex`, one compiled FlexAttention call per layer with a block mask from
the segments (CUDA: no FlexAttention backward on CPU). `with segment_attention(model, kernel):` runs the
forwards inside with `kernel` ("auto": the device's); `model(..., segments=...)` hands the layout over. A
trainer's kernel is `model.attention_kernel`, resolved by its backend (`training_kernel`) and passed down.

Invariant: exact, equal to each sequence alone, both kernels (tests/unit/sft, tests/unit/rl); a flex trainer
compares the two before its first step (kernel_check.py). See docs/training-speed.md, "Segment attention".
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SEGMENTS = "rstar2_segments"
FLEX = "rstar2_flex_segments"
KERNELS = {"segments": SEGMENTS, "flex": FLEX}
"""Kernel name -> the transformers attention function it registers as."""


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


def _batch_shape(query: torch.Tensor, segments: Sequence[Segments], dropout: float) -> tuple[int, int, int]:
    """(B, H, T) of `query`, checked against the layouts; attention dropout refused."""
    if dropout:
        raise ValueError("segment attention does not implement attention dropout; set attention_dropout = 0")
    b, h, t, _ = query.shape
    if len(segments) != b:
        raise ValueError(f"{len(segments)} segment layouts for a batch of {b} rows")
    return b, h, t


def segment_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, scaling: float | None = None,
                              dropout: float = 0.0, segments: Sequence[Segments] | None = None, **kwargs):
    """transformers attention interface. query: (B, H, T, D), key/value: (B, H_kv, T, D) ->
    ((B, T, H, D), None). Without `segments`: plain SDPA with `attention_mask`."""
    if segments is None:
        return _sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    _, h, t = _batch_shape(query, segments, dropout)
    rep = h // key.shape[1]
    if rep > 1:                                       # grouped-query attention: share each kv head
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    rows = [_segment_row(query[i:i + 1], key[i:i + 1], value[i:i + 1], seg, t, scaling, i)
            for i, seg in enumerate(segments)]
    return torch.cat(rows, 0).transpose(1, 2).contiguous(), None


def _segment_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments, t: int, scaling: float | None,
                 i: int) -> torch.Tensor:
    """One packed row's attention output (1, H, T, D): the prefix causally, each span over [prefix, itself].

    q, k and v are split once into [prefix, spans..., padding] (`torch.split`): the backward of a split is one
    concatenation of the pieces' gradients, where a slice per span would allocate a zero tensor of the whole
    row for each span's gradient (at 16K tokens of short trajectories, gigabytes per layer)."""
    h, d = q.shape[1], q.shape[3]
    if seg.length != t:
        raise ValueError(f"row {i} is {t} tokens but its layout says {seg.length}")
    p = seg.prefix
    end = seg.spans[-1][1] if seg.spans else p
    sizes = [p] + [e - s for s, e in seg.spans] + [t - end]
    qs, ks, vs = (x.split(sizes, 2) for x in (q, k, v))
    pieces = []
    if p:
        pieces.append(F.scaled_dot_product_attention(qs[0], ks[0], vs[0], is_causal=True, scale=scaling))
    for j, (s, e) in enumerate(seg.spans, 1):
        if p:
            n = e - s
            allowed = torch.ones(n, p + n, dtype=torch.bool, device=q.device).tril(p)
            kk, vv = torch.cat([ks[0], ks[j]], 2), torch.cat([vs[0], vs[j]], 2)
            pieces.append(F.scaled_dot_product_attention(qs[j], kk, vv, attn_mask=allowed, scale=scaling))
        else:
            pieces.append(F.scaled_dot_product_attention(qs[j], ks[j], vs[j], is_causal=True, scale=scaling))
    if end < t:
        pieces.append(q.new_zeros(1, h, t - end, d))
    return torch.cat(pieces, 2)


def _doc_ids(segments: tuple[Segments, ...], t: int) -> torch.Tensor:
    """(B, T) int32: 0 on a row's prefix, i + 1 on its span i, -1 on padding."""
    doc = torch.full((len(segments), t), -1, dtype=torch.int32)
    for b, seg in enumerate(segments):
        if seg.length != t:
            raise ValueError(f"row {b} is {t} tokens but its layout says {seg.length}")
        doc[b, :seg.prefix] = 0
        for j, (s, e) in enumerate(seg.spans):
            doc[b, s:e] = j + 1
    return doc


@functools.lru_cache(maxsize=4)          # every layer of a forward (and its recompute) asks for the same mask
def _block_mask(segments: tuple[Segments, ...], t: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    doc = _doc_ids(segments, t).to(device)

    def allowed(b, h, q, k):             # causal, within a segment or onto the prefix; padding sees nothing
        dq, dk = doc[b, q], doc[b, k]
        return (k <= q) & (dq >= 0) & ((dq == dk) | (dk == 0))

    # compiled on CUDA: the eager build materialises (T, T) tensors, 1 GB each at 16K tokens
    return create_block_mask(allowed, len(segments), None, t, t, device=device, _compile=device.type == "cuda")


@functools.cache
def _flex_kernel(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention


def flex_segment_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                   value: torch.Tensor, attention_mask: torch.Tensor | None,
                                   scaling: float | None = None, dropout: float = 0.0,
                                   segments: Sequence[Segments] | None = None, **kwargs):
    """As `segment_attention_forward`, in one FlexAttention call over the batch (grouped-query heads
    native). Its backward needs CUDA (torch's CPU FlexAttention is forward-only)."""
    if segments is None:
        return _sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    _, h, t = _batch_shape(query, segments, dropout)
    if query.device.type != "cuda" and torch.is_grad_enabled() and query.requires_grad:
        raise ValueError("the flex attention kernel trains on CUDA only (torch's CPU FlexAttention has no "
                         "backward); use the segments kernel here")
    mask = _block_mask(tuple(segments), t, query.device)
    out = _flex_kernel(query.device.type)(query, key, value, block_mask=mask, scale=scaling,
                                          enable_gqa=key.shape[1] != h)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register both kernels with transformers' attention functions (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(SEGMENTS, segment_attention_forward)
    AttentionInterface.register(FLEX, flex_segment_attention_forward)


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """The kernel `kernel` names on `device`: `auto` is `flex` on CUDA (ROCm too: torch calls it cuda),
    `segments` elsewhere; a name in KERNELS is itself."""
    if kernel == "auto":
        return "flex" if device.type == "cuda" else "segments"
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; valid: {['auto', *sorted(KERNELS)]}")
    return kernel


def training_kernel(setting: str, device: torch.device) -> str:
    """`model.attention_kernel` resolved for a trainer on `device` (what its backend passes to the step
    bodies). `flex` off CUDA is refused here, at the trainer's start, naming the setting: torch's CPU
    FlexAttention has no backward, and the runtime's device is known only once the trainer holds it."""
    kernel = resolve_kernel(setting, device)
    if kernel == "flex" and device.type != "cuda":
        raise ValueError(f'model.attention_kernel = "flex" trains on CUDA/ROCm GPUs only (torch\'s FlexAttention '
                         f"has no backward on the {device.type}), and this trainer runs on the {device.type}: set "
                         'model.attention_kernel = "auto" or "segments"')
    return kernel


@contextlib.contextmanager
def segment_attention(model: torch.nn.Module, kernel: str = "auto") -> Iterator[None]:
    """Run the model's forwards inside with segment attention by `kernel` (`resolve_kernel`: "auto",
    "segments", "flex"; pass `segments=` to them). With gradient checkpointing the backward re-runs the
    layers and looks the attention up again: keep the backward inside the block too (rl_update and
    sft_update do)."""
    register()
    config = model.get_decoder().config     # the HF config its attention layers read (not a DeepSpeed engine's)
    windowed = [t for t in (getattr(config, "layer_types", None) or []) if t != "full_attention"]
    if windowed or getattr(config, "use_sliding_window", False):
        raise ValueError(f"segment attention implements full causal attention only; this model has "
                         f"{sorted(set(windowed)) or ['sliding_window']} layers")
    before = config._attn_implementation
    device = next(model.parameters()).device
    config._attn_implementation = KERNELS[resolve_kernel(kernel, device)]
    try:
        yield
    finally:
        config._attn_implementation = before
