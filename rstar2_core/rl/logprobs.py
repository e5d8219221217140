"""Log-probs of sampled tokens for the RL update: trajectories packed into one row, segment attention,
the LM head only at response positions, chunk by chunk.

    batch = collate(trajectories, pad_id, device)
    logprobs = batch_logprobs(model, batch, temperature)       # (B, R_max), 0 beyond each response

Invariant: equal to the plain padded computation at the sampling temperature (values and gradients,
tests/unit/rl/test_rl_logprobs.py), whatever shares a trajectory's micro-batch (the shared prefix is the
fixed system turn, `prefix_len`); the fp32 logits of the whole vocabulary never exist for all tokens.

See docs/rl.md, "Choices, and where they depart from the paper or the reference code" (Log-probs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rstar2_core.models.packed_attention import Segments, segment_attention
from rstar2_core.models.token_logprobs import decoder_hidden, token_logprobs
from rstar2_core.rollout.types import Trajectory


@dataclass(frozen=True)
class PackedBatch:
    """A micro-batch packed in one row. `input_ids, position_ids: (1, S)` with S the sum of the
    trajectories' lengths; `segments`: their spans; `gather_pos, targets, loss_mask, engine_logprobs,
    valid: (B, R_max)` where `gather_pos[b, j]` is the row position whose hidden state predicts response
    token j of trajectory b, and `valid` marks j < len(response_b)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: tuple[Segments, ...]
    targets: torch.Tensor
    gather_pos: torch.Tensor
    loss_mask: torch.Tensor
    engine_logprobs: torch.Tensor
    valid: torch.Tensor


def collate(trajectories: Sequence[Trajectory], pad_id: int, device: str | torch.device = "cpu",
            prefix_len: int = 0) -> PackedBatch:
    """Pack the trajectories into one row (see PackedBatch). `prefix_len`: leading prompt tokens every
    trajectory of the stage shares (the system turn: `ChatFormat.shared_prompt_len`), written once; a
    fixed length, not the longest prefix this micro-batch happens to share, so a trajectory's computation
    does not depend on which others share its micro-batch (a Ray run, whose ranks split the step
    differently, takes the local run's step). A micro-batch whose prompts do not all share it (the
    zero-weight padding pass) is packed without a prefix."""
    if not trajectories:
        raise ValueError("collate: no trajectories")
    B = len(trajectories)
    R = max(max(len(t.response_ids) for t in trajectories), 1)
    tgt = torch.full((B, R), pad_id, dtype=torch.long)
    pos = torch.zeros((B, R), dtype=torch.long)
    mask = torch.zeros((B, R), dtype=torch.float32)
    eng = torch.zeros((B, R), dtype=torch.float32)
    valid = torch.zeros((B, R), dtype=torch.bool)
    for b, t in enumerate(trajectories):
        if len(t.prompt_ids) < 1:
            raise ValueError("collate: a trajectory has an empty prompt; the first response token needs a "
                             "prompt token to be predicted from")
        if not (len(t.loss_mask) == len(t.logprobs) == len(t.response_ids)):
            raise ValueError(f"collate: trajectory {b} has response_ids ({len(t.response_ids)}), loss_mask "
                             f"({len(t.loss_mask)}) and logprobs ({len(t.logprobs)}) of different lengths")
    head = tuple(trajectories[0].prompt_ids[:prefix_len])
    shared = prefix_len > 0 and all(len(t.prompt_ids) > prefix_len and tuple(t.prompt_ids[:prefix_len]) == head
                                    for t in trajectories)
    p = prefix_len if shared else 0
    ids: list[int] = list(trajectories[0].prompt_ids[:p])
    positions: list[int] = list(range(p))
    spans = []
    for b, t in enumerate(trajectories):
        P, n = len(t.prompt_ids), len(t.response_ids)
        start = len(ids)                         # the trajectory's own tokens: prompt_ids[p:] + response
        ids += list(t.prompt_ids[p:]) + list(t.response_ids)
        positions += range(p, P + n)
        spans.append((start, start + P - p + n))
        if n:
            tgt[b, :n] = torch.tensor(t.response_ids, dtype=torch.long)
            pos[b, :n] = torch.arange(start + P - p - 1, start + P - p - 1 + n)
            mask[b, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
            eng[b, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
            valid[b, :n] = True
    row = torch.tensor([ids], dtype=torch.long)
    return PackedBatch(row.to(device), torch.tensor([positions], dtype=torch.long).to(device),
                       (Segments(p, tuple(spans), len(ids)),), tgt.to(device), pos.to(device), mask.to(device),
                       eng.to(device), valid.to(device))


def batch_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float = 1.0,
                   chunk_tokens: int | None = None, kernel: str = "auto") -> torch.Tensor:
    """`(B, R_max)` log-probs of the response tokens under `model` at `temperature` (0 where padded), its
    attention by `kernel` (packed_attention.segment_attention)."""
    with segment_attention(model, kernel):
        hidden = decoder_hidden(model, batch.input_ids, position_ids=batch.position_ids, segments=batch.segments)
    at = batch.gather_pos[batch.valid]
    lp = token_logprobs(model, hidden[0, at], batch.targets[batch.valid], temperature, chunk_tokens)
    out = torch.zeros(batch.valid.shape, dtype=lp.dtype, device=lp.device)
    return out.masked_scatter(batch.valid, lp)


def micro_batch_slices(n: int, size: int) -> list[slice]:
    """[slice(0, size), slice(size, 2 size), ...] covering n items: the micro-batches of a list."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def model_device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, trajectories: Sequence[Trajectory], pad_id: int,
                      temperature: float = 1.0, micro_batch_size: int = 8, prefix_len: int = 0,
                      kernel: str = "auto") -> list[torch.Tensor]:
    """Per trajectory, the `(R_b,)` log-probs of its response tokens under `model` (no gradient)."""
    device = model_device(model)
    out: list[torch.Tensor] = []
    for sl in micro_batch_slices(len(trajectories), micro_batch_size):
        chunk = trajectories[sl]
        lp = batch_logprobs(model, collate(chunk, pad_id, device, prefix_len), temperature, kernel=kernel).cpu()
        out.extend(lp[b, :len(t.response_ids)] for b, t in enumerate(chunk))
    return out
