"""The trainers' start-up kernel comparison (rstar2_core/models/kernel_check.py) on one accelerator, the
`kernel_check` section of bench/gpu_check.py (issue 58, item 5): the SFT step and the RL update of the
stages' code (`sft_update`, `rl_update`) on a backend whose kernel check is due, so their first micro-batch
runs through the per-segment kernel and through flex (forward + backward) before the step, at the 0.5B
shape in bf16 with a 16,384-token micro-batch (the production profile's budget) of bench/train_step.py's
long-tailed mix; then the SFT check once more, compiled, for the seconds per kernel.

CPU (the smoke test, `--cpu`): torch's FlexAttention has no backward there, so the candidate is `segments`
itself (the wiring runs, the differences are 0) and the JSON says flex was skipped.

    python bench/gpu_check.py --kernel-check --json          # this section alone, ~1-2 min on a GPU
"""

from __future__ import annotations

import torch
from gpu_probes import build_model, log

FIGURES = ("loss_rel_diff", "grad_norm_rel_diff", "grad_rel_diff_attention", "grad_rel_diff_mlp",
           "grad_rel_diff_embeddings", "grad_rel_diff_norms", "loss", "grad_norm", "passed")


def _figures(metrics: dict, prefix: str, candidate: str) -> dict:
    p = f"{prefix}kernel_check_"
    out = {k: metrics[p + k] for k in FIGURES}
    out["seconds"] = {k: metrics[f"{p}seconds_{k}"] for k in ("segments", candidate)}
    return out


def kernel_check(device: torch.device, quick: bool) -> dict:
    """Figures of the check as the SFT and RL trainers run it (see the module docstring); `ok` when both
    passed (a mismatch raises `AttentionKernelMismatch`, which the section reports as its error)."""
    from train_step import PAD
    from train_step import sft_rows as mix_rows
    from train_step import trajectories as mix_trajectories

    from rstar2_core.models.backend import TorchBackend
    from rstar2_core.rl.trainer import rl_update
    from rstar2_core.sft.step import sft_update

    cpu = device.type != "cuda"
    shape = "cpu-small" if cpu else ("tiny" if quick else "0.5b")
    dtype = torch.float32 if cpu else torch.bfloat16
    budget, seq, cap, system, n_rl = (512, 256, 100, 16, 8) if cpu else ((4096, 2048, 1024, 256, 24) if quick
                                                                          else (16384, 8192, 4096, 512, 24))
    candidate = "segments" if cpu else "flex"
    model = build_model(shape, device, dtype).train()
    vocab = model.config.vocab_size
    backend = TorchBackend(model, lr=1e-7, total_steps=10, warmup_steps=0, schedule="constant",
                           attention_kernel=candidate, kernel_check=True)
    cut = {"micro_batch_size": None, "max_tokens_per_micro_batch": budget}
    out: dict = {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "candidate": candidate,
                 "micro_batch_tokens": budget}
    if cpu:
        out["flex"] = "skipped: torch's FlexAttention has no backward on the CPU (the candidate is segments itself)"
    rows = mix_rows(4, cap, system, seq, vocab, seed=7)
    sft = sft_update(backend, rows, pad_id=PAD, **cut)
    out["sft"] = _figures(sft, "sft/", candidate)
    trajs = mix_trajectories(n_rl, cap, system, vocab, seed=8)
    backend.kernel_check_due = True                   # what the next stage's fresh trainer has
    rl = rl_update(backend, trajs, [1.0 if i % 2 else -1.0 for i in range(len(trajs))], pad_id=PAD,
                   prefix_len=system, **cut)
    out["rl"] = _figures(rl, "actor/", candidate)
    backend.kernel_check_due = True                   # again, compiled: the seconds a warm check takes
    warm = sft_update(backend, mix_rows(4, cap, system, seq, vocab, seed=9), pad_id=PAD, **cut)
    out["warm_seconds"] = _figures(warm, "sft/", candidate)["seconds"]
    out["ok"] = bool(out["sft"]["passed"] and out["rl"]["passed"] and warm["sft/kernel_check_passed"])
    del backend, model
    if not cpu:
        torch.cuda.empty_cache()                      # the sections after it start from an empty cache
    log(f"kernel check ({shape}, {out['dtype']}, {budget}-token micro-batch, segments vs {candidate}): SFT loss rel "
        f"diff {out['sft']['loss_rel_diff']:.1e}, grad-norm rel diff {out['sft']['grad_norm_rel_diff']:.1e}; RL "
        f"{out['rl']['loss_rel_diff']:.1e} / {out['rl']['grad_norm_rel_diff']:.1e}; warm fwd+bwd s "
        + ", ".join(f"{k} {v:.3f}" for k, v in out["warm_seconds"].items()))
    return out
