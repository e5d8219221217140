"""Per-call cost of the LM-head kernels on a GPU as the token count changes from call to call (as it does in
the SFT step: label positions per micro-batch vary), and how many Triton variants Liger compiled.

The GPU check's first run (2026-12-04, H200) timed the head alone at a fixed token count (Liger 1.6x faster
than the chunked torch path, 3.4x less memory) but the SFT step 8x slower with Liger than with the torch
head. This probe separates a per-call cost from a per-token-count cost, and found neither: the SFT step on
new rows was slow with either head (cuDNN attention plans, bench/sdpa_shapes.py; the 8x was the torch-head
arm reusing the first arm's rows and their plans). What it does: for each head kernel, one
forward + backward of `token_logprobs` (bench/gpu_gates.head_pass, the code the steps run) per token count in
a sequence that repeats some counts, each call timed alone, with the number of compiled variants of Liger's
kernels after it. Then the SFT step (`sft.step.sft_update`) on the tiny shape, step by step, on new rows and
on the same rows again.

    python bench/head_kernel_calls.py --json      # one GPU, ~1 minute; last line = JSON
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch

COUNTS = [4096, 4096, 4100, 4100, 4111, 4096, 8000, 7993, 8000, 4100]


def compiled_variants() -> dict[str, int | None]:
    """Compiled variants per Liger Triton kernel the head path launches (None when Triton's cache layout is
    not the one read here)."""
    out = {}
    try:
        from liger_kernel.ops import cross_entropy, fused_linear_cross_entropy
    except ImportError:
        return out
    for mod in (cross_entropy, fused_linear_cross_entropy):
        for name in dir(mod):
            k = getattr(mod, name)
            if not hasattr(k, "run") or not name.endswith("kernel"):
                continue
            caches = getattr(k, "device_caches", None)
            if caches is not None:
                out[name] = sum(len(c[0]) for c in caches.values())
            elif isinstance(getattr(k, "cache", None), dict):
                out[name] = sum(len(c) for c in k.cache.values())
            else:
                out[name] = None
    return out


def head_calls(shape: str, mode: str, device) -> list[dict]:
    import gpu_check
    import gpu_gates

    s = gpu_check.SHAPES[shape]
    head = gpu_gates.LMHead(s["hidden_size"], s["vocab_size"], device, torch.bfloat16)
    rows = []
    for n in COUNTS:
        hidden, targets, upstream = gpu_gates.head_inputs(head, n, seed=n)
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        gpu_gates.head_pass(head, mode, hidden, targets, upstream, 1.0)
        torch.cuda.synchronize(device)
        rows.append({"tokens": n, "ms": 1000 * (time.perf_counter() - t), "variants": compiled_variants()})
    return rows


def sft_steps(device, steps: int = 6) -> dict:
    import gpu_check

    from rstar2_core.models.backend import TorchBackend
    from rstar2_core.models.token_logprobs import set_head_kernel
    from rstar2_core.sft.step import sft_update

    model = gpu_check.build_model("tiny", device, torch.bfloat16)
    backend = TorchBackend(model, lr=1e-5, total_steps=100, warmup_steps=0, schedule="constant")
    out = {}
    for mode in ("torch", "liger"):
        set_head_kernel(model, mode)
        new, same = [], []
        for i in range(steps):
            rows = gpu_check.sft_rows(model.config.vocab_size, 8, 2048, seed=100 * i + (mode == "liger"))
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            m = sft_update(backend, rows, micro_batch_size=8, pad_id=0)
            torch.cuda.synchronize(device)
            new.append({"s": time.perf_counter() - t, "label_tokens": m["sft/label_tokens"]})
        for _ in range(3):
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            sft_update(backend, rows, micro_batch_size=8, pad_id=0)
            torch.cuda.synchronize(device)
            same.append(time.perf_counter() - t)
        out[mode] = {"new_rows": new, "same_rows_s": same, "variants": compiled_variants()}
    return out


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (what it measures, cuDNN plans and Triton kernels, exists only there)")
    device = torch.device("cuda")
    t0 = time.perf_counter()
    res: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "counts": COUNTS}
    for shape in ("tiny", "0.5b"):
        for mode in ("torch", "liger"):
            rows = head_calls(shape, mode, device)
            res[f"{shape}/{mode}"] = rows
            print(f"[{time.perf_counter() - t0:6.1f}s] {shape} {mode}: "
                  + ", ".join(f"{r['tokens']}:{r['ms']:.1f}ms" for r in rows), flush=True)
            print(f"          variants after: {rows[-1]['variants']}", flush=True)
    res["sft_tiny"] = sft_steps(device)
    for mode, r in res["sft_tiny"].items():
        print(f"[{time.perf_counter() - t0:6.1f}s] SFT tiny {mode}: new rows "
              + ", ".join(f"{x['s']:.3f}s ({x['label_tokens']:.0f} labels)" for x in r["new_rows"])
              + "; same rows " + ", ".join(f"{x:.3f}s" for x in r["same_rows_s"]), flush=True)
    res["wall_s"] = time.perf_counter() - t0
    if a.json:
        print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
