"""cuDNN's attention in SDPA vs without it, on a GPU, where the attention shapes change from step to step:
the SFT step on new rows vs the same rows again, and a cold HF engine generating at lengths it has not
seen vs the same lengths again. Both call the code that runs (`sft.step.sft_update`, `HFEngine`).

`rollout.model_call.disable_cudnn_attention` keeps SDPA off cuDNN; arm `cudnn` sets `ALLOW_CUDNN_ATTENTION`
and re-enables it to measure what that saves. Each arm uses its own rows and lengths, so no arm reuses
another's plans. The H200 finding behind it: docs/production.md, "Figures from an H200".

    python bench/sdpa_shapes.py --json      # one GPU, ~2 minutes (over 75 s on an H200); last line = JSON
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_probes
import torch

ARMS = ("cudnn", "no_cudnn")


def _arm(name: str) -> None:
    from rstar2_core.rollout import model_call

    model_call.ALLOW_CUDNN_ATTENTION = name == "cudnn"
    torch.backends.cuda.enable_cudnn_sdp(name == "cudnn")


def sft(shape: str, device, steps: int) -> dict:
    from rstar2_core.models.backend import TorchBackend
    from rstar2_core.sft.step import sft_update

    model = gpu_probes.build_model(shape, device, torch.bfloat16)
    backend = TorchBackend(model, lr=1e-5, total_steps=100, warmup_steps=0, schedule="constant", head_kernel="torch")
    vocab = model.config.vocab_size

    def step(rows):
        return gpu_probes.timed(lambda: sft_update(backend, rows, micro_batch_size=len(rows), pad_id=0), device)

    step(gpu_probes.sft_rows(vocab, 8, 2048, seed=1))                  # warm-up: allocator, cuBLAS
    out = {}
    for k, arm in enumerate(ARMS):
        _arm(arm)
        new = [step(gpu_probes.sft_rows(vocab, 8, 2048, seed=100 * (k + 1) + i)) for i in range(steps)]
        same = [step(gpu_probes.sft_rows(vocab, 8, 2048, seed=100 * (k + 1))) for _ in range(2)]
        out[arm] = {"new_rows_s": new, "same_rows_s": same}
        print(f"SFT {shape} {arm}: new rows " + ", ".join(f"{x:.3f}" for x in new) + " s; same rows "
              + ", ".join(f"{x:.3f}" for x in same) + " s", flush=True)
    return out


def engine(shape: str, device, batch: int, new_tokens: int) -> dict:
    model = gpu_probes.build_model(shape, device, torch.bfloat16).eval()
    vocab = model.config.vocab_size
    out = {}
    for k, arm in enumerate(ARMS):
        _arm(arm)
        prompt_len = 100 + 300 * k             # disjoint KV lengths per arm: no plan is shared between arms
        eng = gpu_probes.make_engine(model, batch, prompt_len + new_tokens + 8)
        try:
            runs = []
            for i in range(2):                 # cold (lengths not seen), then the same lengths again
                prompts = gpu_probes._random_batch(vocab, batch, prompt_len, device).tolist()
                runs.append(gpu_probes.timed(lambda p=prompts, s=i, e=eng: asyncio.run(
                    gpu_probes._engine_generate(e, p, new_tokens, seed=1000 * s)), device))
        finally:
            asyncio.run(eng.close())
        toks = batch * new_tokens
        out[arm] = {"prompt_len": prompt_len, "cold_s": runs[0], "warm_s": runs[1],
                    "cold_tokens_per_s": toks / runs[0], "warm_tokens_per_s": toks / runs[1]}
        print(f"engine {shape} {arm}: {batch} x {new_tokens} tokens after {prompt_len}: cold {runs[0]:.2f} s, "
              f"same lengths again {runs[1]:.2f} s", flush=True)
    return out


def run(a, device) -> dict:
    res: dict = {}
    try:
        for shape in ("tiny", "0.5b"):
            res[f"sft/{shape}"] = sft(shape, device, a.steps)
            res[f"engine/{shape}"] = engine(shape, device, 64, 128)
    finally:
        _arm("no_cudnn")
    return res


def main() -> dict:
    return gpu_probes.gpu_probe(__doc__, run, lambda ap: ap.add_argument("--steps", type=int, default=3))


if __name__ == "__main__":
    main()
