"""One SFT optimizer step on packed rows: `sft_update(backend, rows, ...)`, the body every trainer runs.

The local trainer calls it on the whole batch; each Ray trainer shard on its share, with the batch's
label-token count (`total_tokens`), the micro-batch count every rank runs (`num_micro_batches`,
zero-weight `padding_row` passes fill up) and `loss_scale` = the world size (DeepSpeed averages
gradients over ranks). Loss: token-level cross-entropy on assistant tokens (labels != IGNORE), summed
per micro-batch and divided by the batch's label count. Attention: the backend's kernel, compared with
the per-segment one first where that is due (models/kernel_check.py).

Invariant: the accumulated micro-batch gradients are the gradient of the whole batch's token mean, and
every rank issues the same collectives (runtime/ray/sharding.py). See docs/models-and-sft.md, "Loss".
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from rstar2_core.models.kernel_check import run_kernel_check
from rstar2_core.models.packed_attention import segment_attention
from rstar2_core.models.token_logprobs import decoder_hidden, token_logprobs
from rstar2_core.runtime.micro_batches import cut_micro_batches
from rstar2_core.runtime.protocol import TrainerStep
from rstar2_core.sft.packing import IGNORE, PackedRow, collate, merge_shared_prefix, prefix_length


def masked_token_loss(model: torch.nn.Module, batch: dict, kernel: str = "auto") -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over positions whose label is not IGNORE, and their count.

    batch: `packing.collate` output (labels: (B, T) aligned with the inputs, shifted here). The decoder
    runs with segment attention by `kernel` (or the batch's dense mask), then the LM head and log-softmax
    only at label positions, chunk by chunk (`models.token_logprobs`): no (B, T, V) logits."""
    labels = batch["labels"]
    target = labels[:, 1:]
    keep = target != IGNORE
    if "segments" in batch:
        with segment_attention(model, kernel):
            hidden = decoder_hidden(model, batch["input_ids"], position_ids=batch["position_ids"],
                                    segments=batch["segments"])
    else:
        hidden = decoder_hidden(model, batch["input_ids"], attention_mask=batch.get("attention_mask"),
                                position_ids=batch["position_ids"])
    lp = token_logprobs(model, hidden[:, :-1][keep], target[keep])
    return -lp.sum(), int(keep.sum())


def padding_row(pad_id: int) -> PackedRow:
    """Two padding tokens with no label: the input of a zero-weight micro-batch (touches every parameter)."""
    return PackedRow((pad_id, pad_id), (IGNORE, IGNORE), (0, 1), (0, 0), 1, 0)


def label_tokens(row: PackedRow) -> int:
    """Tokens of `row` that the loss trains on (next-token targets that are not IGNORE)."""
    return sum(1 for x in row.labels[1:] if x != IGNORE)


def cut_rows(rows: Sequence[PackedRow], *, micro_batch_size: int | None, max_tokens_per_micro_batch: int | None = None,
             **_: object) -> list[list[int]]:
    """The micro-batches (row indices) `sft_update` runs: `micro_batch_size` rows each, or, with
    `max_tokens_per_micro_batch`, packed first-fit-decreasing by real tokens under that budget, a shared
    prefix counted once (what a merged micro-batch computes; runtime/micro_batches.py)."""
    if max_tokens_per_micro_batch is None:
        return cut_micro_batches([0] * len(rows), size=micro_batch_size)
    shared = prefix_length(rows[0]) if rows else 0
    if not all(prefix_length(r) == shared for r in rows):
        shared = 0
    return cut_micro_batches([r.n_real - shared for r in rows], max_tokens=max_tokens_per_micro_batch, shared=shared)


def sft_update(backend, rows: Sequence[PackedRow], *, micro_batch_size: int | None, pad_id: int,
               total_tokens: int | None = None, num_micro_batches: int | None = None,
               loss_scale: float = 1.0, dense_mask: bool = False, merge_prefix: bool = True,
               max_tokens_per_micro_batch: int | None = None) -> dict[str, float]:
    """Forward/backward over `rows` in micro-batches (`cut_rows`: by count, or by a token budget with
    `max_tokens_per_micro_batch`), then one `backend.step()`. Each micro-batch of
    shared-prefix rows runs as one row with the prefix once (`packing.merge_shared_prefix`; `merge_prefix
    = False` runs the rows as they are). `dense_mask` runs the reference attention (a dense (B, 1, T, T)
    block mask instead of segment attention, rows as they are; bench/sft.py). `total_tokens`: the
    batch's label tokens over all ranks (default: these rows'). Returns this rank's `sft/loss_sum`
    (summed token losses), `sft/label_tokens`, `sft/real_tokens`, `sft/grad_norm`, `sft/lr` (the lr of
    this step), `sft/computed_tokens` (the real tokens the forward passes ran: a merged prefix once; a padding
    pass holds none)."""
    model = backend.model
    p0 = next(model.parameters())
    device = p0.device
    mask_dtype = torch.bfloat16 if getattr(backend, "use_autocast", False) else p0.dtype
    local = sum(label_tokens(r) for r in rows)
    total = local if total_tokens is None else int(total_tokens)
    cut = cut_rows(rows, micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch)
    chunks = [[rows[i] for i in mb] for mb in cut]
    need = num_micro_batches if num_micro_batches is not None else max(1, len(chunks))
    if need < len(chunks):
        raise ValueError(f"sft_update: num_micro_batches={need} but these {len(rows)} rows are cut into "
                         f"{len(chunks)} micro-batches")
    chunks += [[padding_row(pad_id)]] * (need - len(chunks))
    lr = float(getattr(backend, "current_lr", float("nan")))
    kernel = getattr(backend, "attention_kernel", "auto")
    loss_sum, computed, checked = 0.0, 0, {}
    model.train()
    for i, chunk in enumerate(chunks):
        merged = merge_shared_prefix(chunk) if merge_prefix and not dense_mask else None
        run = [merged] if merged is not None else chunk
        computed += sum(r.n_real for r in run)
        mb = collate(run, device, mask_dtype, dense_mask=dense_mask)
        if i == 0 and "segments" in mb:
            checked = run_kernel_check(backend, lambda m, k, b=mb: _mean_loss(m, b, k, backend), "sft/")
        # the backward inside the attention switch too: gradient checkpointing re-runs the layers there
        with segment_attention(model, kernel) if "segments" in mb else contextlib.nullcontext():
            with backend.autocast():
                loss, _ = masked_token_loss(model, mb, kernel)
            backend.backward(loss * (loss_scale / max(1, total)))
        loss_sum += float(loss.detach())
    grad_norm = backend.step()
    return {**checked, "sft/loss_sum": loss_sum, "sft/label_tokens": float(local),
            "sft/real_tokens": float(sum(r.n_real for r in rows)), "sft/computed_tokens": float(computed),
            "sft/grad_norm": float(grad_norm), "sft/lr": lr, "sft/micro_batches": float(need)}


def _mean_loss(model: torch.nn.Module, mb: dict, kernel: str, backend) -> torch.Tensor:
    """The kernel check's loss: the micro-batch's mean token loss under `kernel`."""
    with backend.autocast():
        loss, n = masked_token_loss(model, mb, kernel)
    return loss / max(1, n)


def merge_rank_metrics(per_rank: Sequence[dict[str, float]], tokens: Sequence[float]) -> dict[str, float]:
    """One SFT step's metrics from each rank's `sft_update` sums: the batch's token-mean loss, its label and
    real token counts, the (global) grad norm and lr of rank 0, and its kernel check's figures (the verdict's
    differences are the largest over ranks on every rank)."""
    labels = sum(m["sft/label_tokens"] for m in per_rank)
    return {"sft/loss": sum(m["sft/loss_sum"] for m in per_rank) / max(1.0, labels),
            "sft/label_tokens": labels, "sft/real_tokens": sum(m["sft/real_tokens"] for m in per_rank),
            "sft/computed_tokens": sum(m["sft/computed_tokens"] for m in per_rank),
            "sft/grad_norm": per_rank[0]["sft/grad_norm"], "sft/lr": per_rank[0]["sft/lr"],
            "sft/micro_batches": per_rank[0].get("sft/micro_batches", 1.0),
            **{k: v for k, v in per_rank[0].items() if k.startswith("sft/kernel_check_")}}


def _row_tokens(row: PackedRow) -> float:
    return float(label_tokens(row))


def _row_length(row: PackedRow) -> float:
    return float(row.n_real)


SFT_STEP = TrainerStep(sft_update, _row_tokens, merge_rank_metrics, _row_length, cut_rows)
"""The SFT optimizer step as the runtime's trainer runs it on every rank (runtime.protocol.TrainerStep)."""
