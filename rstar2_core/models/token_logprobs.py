"""Log-probabilities of given tokens without materialising the vocabulary's logits for every position.

    hidden = decoder_hidden(model, input_ids, position_ids=pos, segments=layout)   # (B, T, H)
    lp = token_logprobs(model, hidden[rows, cols], targets, temperature=0.6)        # (N,) fp32

The model's forward runs with its LM head swapped for an identity; the head + log-softmax then run only
at the N positions asked for, a checkpointed chunk at a time (at most one chunk's logits alive), or
through Liger's fused linear cross-entropy where `cfg.model.head_kernel` picks it (`set_head_kernel`).
Invariant: the head is called as a module (`model.get_output_embeddings()`), so tied embeddings,
autocast and ZeRO-3's parameter gathering work as in the model's own forward.
See docs/training-speed.md, "Log-probabilities without the logits".
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from rstar2_core.rollout.model_call import disable_cudnn_attention

CHUNK_ELEMENTS = 1 << 26        # logits per chunk (64M: 256 MB in fp32)


def decoder_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """(B, T, H) last hidden states of the causal LM (after its final norm), without the LM head.
    kwargs (e.g. `segments=`) go to the model's attention.

    The call goes through `model(...)` itself, with the LM head swapped for an identity for its
    duration: a DeepSpeed engine's forward does bookkeeping the backward relies on (ZeRO-3's micro-step
    count, which decides whether a micro-batch's gradients add to the previous ones; the backward
    prologue hooks), which calling the inner decoder directly would skip. Every training forward comes
    here, so this is where SDPA is kept off cuDNN's attention (`rollout.model_call.disable_cudnn_attention`)."""
    disable_cudnn_attention()
    inner = getattr(model, "module", model)     # a DeepSpeed engine wraps the transformers model
    head = inner.get_output_embeddings()
    inner.set_output_embeddings(torch.nn.Identity())
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                    **kwargs)
    finally:
        inner.set_output_embeddings(head)
    return out.logits


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits.div_(temperature)       # in place: the matmul does not keep its output for backward
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


HEAD_KERNELS = ("auto", "liger", "torch")
_ATTR = "rstar2_head_kernel"     # on the HF model (a DeepSpeed engine's `.module`)


@functools.cache        # a failed import is not cached by Python: without this, every call would search again
def _liger():
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return liger_fused_linear_cross_entropy


def liger_obstacles(head: torch.nn.Module, on_cuda: bool, partitioned: bool) -> list[str]:
    """Why Liger's fused head cannot compute this model's log-probs ([] when it can)."""
    out = []
    if _liger() is None:
        out.append("liger-kernel is not importable (install the `kernels` extra: pip install -e .[kernels])")
    if not on_cuda:
        out.append("the model is not on a CUDA device (Liger's kernels are Triton)")
    if not isinstance(head, torch.nn.Linear) or getattr(head, "weight", None) is None:
        out.append(f"the LM head is a {type(head).__name__}, not a Linear layer")
    elif head.bias is not None:
        # dividing the hidden states by the temperature is not (hW + b) / T with one
        out.append("the LM head has a bias")
    if partitioned:
        out.append("ZeRO-3 partitions the LM head's weight across ranks")
    return out


def head_kernel_of(model: torch.nn.Module) -> str:
    """The head kernel `model` was set to (`auto` when none was)."""
    return getattr(getattr(model, "module", model), _ATTR, "auto")


def set_head_kernel(model: torch.nn.Module, mode: str, *, partitioned: bool = False) -> None:
    """Make `token_logprobs` compute `model`'s log-probs the `mode` way (`cfg.model.head_kernel`).
    `partitioned`: the backend will shard the weights ZeRO-3 style. `liger` where it cannot work raises
    ValueError naming each obstacle and the settings that run instead."""
    if mode not in HEAD_KERNELS:
        raise ValueError(f"model.head_kernel = {mode!r} is not one of {list(HEAD_KERNELS)}")
    inner = getattr(model, "module", model)
    if mode == "liger":
        p0 = next(inner.parameters(), None)
        obstacles = liger_obstacles(inner.get_output_embeddings(), p0 is not None and p0.is_cuda, partitioned)
        if obstacles:
            raise ValueError('model.head_kernel = "liger" cannot be honoured here: ' + "; ".join(obstacles)
                             + '. Set model.head_kernel = "auto" (Liger where usable, else the chunked torch '
                             'path) or "torch"')
    setattr(inner, _ATTR, mode)


def _use_liger(model: torch.nn.Module, head: torch.nn.Module, hidden: torch.Tensor) -> bool:
    mode = head_kernel_of(model)
    if mode == "torch":
        return False
    weight = getattr(head, "weight", None)
    obstacles = liger_obstacles(head, hidden.is_cuda, weight is not None and hasattr(weight, "ds_id"))
    if mode == "liger" and obstacles:    # checked when the backend was built; this is a later change
        raise RuntimeError('model.head_kernel = "liger" no longer holds: ' + "; ".join(obstacles))
    return not obstacles


def token_logprobs(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_tokens: int | None = None) -> torch.Tensor:
    """`log softmax(lm_head(hidden) / temperature)[targets]` in fp32, chunk by chunk of tokens.

    hidden: (N, H); targets: (N,) token ids -> (N,). `chunk_tokens` defaults to CHUNK_ELEMENTS / vocab;
    when N fits one chunk, no checkpoint is taken (nothing to save by recomputing)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    head = model.get_output_embeddings()
    n = hidden.shape[0]
    if n == 0:   # still through the head: the (empty) result stays in the graph, so a zero-weight micro-batch
        # touches every parameter and issues the collectives its data-parallel peers issue (ZeRO-2/3)
        return _chunk_logprobs(head, hidden, targets, temperature)
    if _use_liger(model, head, hidden):
        fused = _liger()
        nll = fused(hidden / temperature, head.weight, targets, reduction="none")
        return -nll.float()
    weight = getattr(head, "weight", None)
    # a ZeRO-3 partitioned weight is an empty tensor; its full shape is `ds_shape`
    vocab = getattr(weight, "ds_shape", weight.shape)[0] if weight is not None else 0
    if not vocab:
        vocab = int(getattr(model, "module", model).config.vocab_size)
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // max(1, vocab))
    if n <= chunk:
        return _chunk_logprobs(head, hidden, targets, temperature)
    grad = torch.is_grad_enabled()
    parts = []
    for s in range(0, n, chunk):
        h, t = hidden[s:s + chunk], targets[s:s + chunk]
        if grad:
            parts.append(checkpoint(_chunk_logprobs, head, h, t, temperature, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(head, h, t, temperature))
    return torch.cat(parts)
