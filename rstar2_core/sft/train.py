"""Non-reasoning SFT: `run_sft(cfg, *, base_model_url, sft_data_url, out_url, log_metrics=None, resume=True)`.

What it does: loads the base checkpoint, renders the SFT conversations through `ChatFormat`, packs
them (`sft/packing.py`), and trains with the configured backend (`TorchBackend`, or DeepSpeed ZeRO
when `cfg.sft.backend == "deepspeed"`): AdamW, linear warm-up over `warmup_ratio` of the steps then
cosine (or constant), global grad-norm clip, bf16 autocast on GPUs. Loss: token-level cross-entropy
on assistant tokens only (prompt and tool responses masked), averaged over all label tokens of the
optimizer batch (micro-batches accumulate sums, divided by the batch's token count).

Checkpoints: `<out_url>/steps/step-NNNNNN` every `cfg.sft.checkpoint_every` steps (model, tokenizer,
backend state, RNG; the last two are kept), `<out_url>/final` at the end. With `resume=True` a run
continues from the newest complete step checkpoint (the batch order is a pure function of seed and
step, so a resumed run produces the same weights as an uninterrupted one) and returns at once if
`final` is complete. `maybe_inject_fault("sft", step)` runs at the start of each step (1-based).
Metrics through `log_metrics(dict, step)`: `sft/loss`, `sft/lr`, `sft/grad_norm`, `sft/tokens_per_s`,
`sft/epoch`. A tqdm bar shows progress and ETA.

Departs from the paper: lr/batch/epochs come from the profile (the paper: 3 epochs, lr 5e-6, 4%
warm-up, cosine, batch 128, on 222K samples; the tiny profile trains a from-scratch model at ~1e-3).

    rstar2 sft train --profile tiny --base file:///.../base --data file:///.../sft.jsonl --out file:///.../sft
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from rstar2_core import storage
from rstar2_core.config import Config
from rstar2_core.faults import maybe_inject_fault
from rstar2_core.models.backend import make_backend
from rstar2_core.models.io import (
    latest_complete,
    load_model_and_tokenizer,
    read_extra,
    read_meta,
    save_checkpoint,
)
from rstar2_core.models.packed_attention import segment_attention
from rstar2_core.models.token_logprobs import decoder_hidden, token_logprobs
from rstar2_core.results import StageResult
from rstar2_core.sft.data import read_sft_rows
from rstar2_core.sft.packing import IGNORE, PackedRow, collate, encode_conversations, epoch_rows

STAGE = "sft"
STATE_FILE = "trainer_state.pt"
KEEP_STEP_CHECKPOINTS = 2
MetricsFn = Callable[[dict, int], None]


def masked_token_loss(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over positions whose label is not IGNORE, and their count.

    batch: `packing.collate` output (labels: (B, T) aligned with the inputs, shifted here). The decoder
    runs with segment attention (or the batch's dense mask), then the LM head and log-softmax only at
    label positions, chunk by chunk (`models.token_logprobs`): no (B, T, V) logits."""
    labels = batch["labels"]
    target = labels[:, 1:]
    keep = target != IGNORE
    if "segments" in batch:
        with segment_attention(model):
            hidden = decoder_hidden(model, batch["input_ids"], position_ids=batch["position_ids"],
                                    segments=batch["segments"])
    else:
        hidden = decoder_hidden(model, batch["input_ids"], attention_mask=batch.get("attention_mask"),
                                position_ids=batch["position_ids"])
    lp = token_logprobs(model, hidden[:, :-1][keep], target[keep])
    return -lp.sum(), int(keep.sum())


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _save_step(backend, tokenizer, steps_url: str, step: int, loss: float) -> None:
    buf = io.BytesIO()
    torch.save({"backend": backend.state_dict(), "torch_rng": torch.get_rng_state(), "step": step}, buf)
    save_checkpoint(backend, tokenizer, storage.join(steps_url, f"step-{step:06d}"),
                    extra={STATE_FILE: buf.getvalue()}, meta={"step": step, "sft/loss": loss})
    done = [u for u in storage.list_dirs(steps_url) if storage.is_complete(u)]
    for old in sorted(done, key=lambda u: read_meta(u).get("step", -1))[:-KEEP_STEP_CHECKPOINTS]:
        storage.remove(old)


def _batches(rows: list[PackedRow], batch_size: int) -> int:
    return max(1, math.ceil(len(rows) / batch_size))


def run_sft(cfg: Config, *, base_model_url: str, sft_data_url: str, out_url: str,
            log_metrics: MetricsFn | None = None, resume: bool = True) -> StageResult:
    """Train `base_model_url` on the conversations at `sft_data_url`; the final checkpoint is
    `<out_url>/final`. Resumes from `<out_url>/steps` when `resume`."""
    from rstar2_core.chat import ChatFormat

    sc = cfg.sft
    final_url = storage.join(out_url, "final")
    steps_url = storage.join(out_url, "steps")
    if resume and storage.is_complete(final_url):
        meta = read_meta(final_url)
        return StageResult(name=STAGE, checkpoint_url=final_url, metrics=meta.get("metrics", {}),
                           steps=int(meta.get("step", 0)), extra={"resumed_final": True})

    last = latest_complete(steps_url) if resume else None
    device = _device()
    model, tokenizer = load_model_and_tokenizer(last or base_model_url, dtype=cfg.model.dtype, device=device)
    model.train()
    model.config.use_cache = False
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    chat = ChatFormat(tokenizer)
    docs, too_long = encode_conversations(read_sft_rows(sft_data_url), chat, sc.max_seq_len)
    if not docs:
        raise ValueError(f"no SFT conversation fits sft.max_seq_len={sc.max_seq_len} ({too_long} too long); "
                         "raise sft.max_seq_len")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else chat.im_end_id
    rows = epoch_rows(docs, sc.epochs, sc.seed, sc.max_seq_len, pad_id, sc.pack)
    total_steps = _batches(rows, sc.batch_size)
    warmup = round(sc.warmup_ratio * total_steps)
    backend = make_backend(model, sc, total_steps=total_steps, warmup_steps=warmup, schedule=sc.schedule)

    start = 0
    if last is not None:
        state = torch.load(io.BytesIO(read_extra(last, STATE_FILE)), weights_only=False)
        backend.load_state_dict(state["backend"])
        torch.set_rng_state(state["torch_rng"])
        start = int(state["step"])

    n_label = sum(sum(m) for _, m in docs)
    bar = tqdm(total=total_steps, initial=start, desc="sft", unit="step", dynamic_ncols=True)
    metrics: dict[str, float] = {}
    for step in range(start, total_steps):
        maybe_inject_fault(STAGE, step + 1)
        t0 = time.perf_counter()
        batch_rows = rows[step * sc.batch_size:(step + 1) * sc.batch_size]
        n_tok = sum(sum(1 for x in r.labels[1:] if x != IGNORE) for r in batch_rows)
        lr = float(getattr(backend, "current_lr", sc.lr))
        loss_sum = 0.0
        for i in range(0, len(batch_rows), sc.micro_batch_size):
            mb = collate(batch_rows[i:i + sc.micro_batch_size], device)
            with backend.autocast():
                loss, _ = masked_token_loss(backend.model, mb)
            backend.backward(loss / max(1, n_tok))
            loss_sum += float(loss.detach())
        grad_norm = backend.step()
        dt = time.perf_counter() - t0
        real = sum(r.n_real for r in batch_rows)
        metrics = {"sft/loss": loss_sum / max(1, n_tok), "sft/lr": lr, "sft/grad_norm": grad_norm,
                   "sft/tokens_per_s": real / dt, "sft/epoch": (step + 1) / total_steps * sc.epochs}
        if log_metrics is not None:
            log_metrics(metrics, step + 1)
        bar.set_postfix(loss=f"{metrics['sft/loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{real / dt:.0f}")
        bar.update(1)
        done = step + 1
        if sc.checkpoint_every and done % sc.checkpoint_every == 0 and done < total_steps:
            _save_step(backend, tokenizer, steps_url, done, metrics["sft/loss"])
    bar.close()

    model.config.use_cache = True
    summary = {**metrics, "sft/n_conversations": len(docs), "sft/n_rows": len(rows),
               "sft/skipped_too_long": too_long, "sft/label_tokens_per_epoch": n_label}
    save_checkpoint(backend, tokenizer, final_url, meta={"step": total_steps, "metrics": summary})
    return StageResult(name=STAGE, checkpoint_url=final_url, metrics=summary, steps=total_steps,
                       extra={"resumed_from": last, "total_steps": total_steps})
