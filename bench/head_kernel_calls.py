"""Per-call cost of the LM-head kernels on a GPU as the token count changes from call to call (as it does in
the SFT step: label positions per micro-batch vary), and how many Triton variants Liger compiled.

For each head kernel, one forward + backward of `token_logprobs` (bench/gpu_gates.head_forward_backward, the
code the steps run) per token count in a sequence that repeats some counts, each call timed alone, with the
number of compiled variants of Liger's kernels after it. What it found on an H200 (2026-12-04), and why the
SFT half of its first form moved to bench/sdpa_shapes.py: docs/production.md, "Figures from an H200".

    python bench/head_kernel_calls.py --json      # one GPU, ~15 s; last line = JSON"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_gates
import gpu_probes
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
    s = gpu_probes.SHAPES[shape]
    head = gpu_gates.LMHead(s["hidden_size"], s["vocab_size"], device, torch.bfloat16)
    rows = []
    for n in COUNTS:
        args = (head, mode, *gpu_gates.head_inputs(head, n, seed=n))
        ms = 1000 * gpu_probes.timed(lambda a=args: gpu_gates.head_forward_backward(*a), device)
        rows.append({"tokens": n, "ms": ms, "variants": compiled_variants()})
    return rows


def run(_a, device) -> dict:
    res: dict = {"counts": COUNTS}
    for shape in ("tiny", "0.5b"):
        for mode in ("torch", "liger"):
            rows = head_calls(shape, mode, device)
            res[f"{shape}/{mode}"] = rows
            gpu_probes.log(f"{shape} {mode}: " + ", ".join(f"{r['tokens']}:{r['ms']:.1f}ms" for r in rows)
                          + f"; Liger variants after: {rows[-1]['variants']}")
    return res


def main() -> dict:
    return gpu_probes.gpu_probe(__doc__, run)


if __name__ == "__main__":
    main()
