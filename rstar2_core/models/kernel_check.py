"""The start-up comparison of the attention kernels: before a trainer's first optimizer step with the flex
kernel, its first micro-batch runs through `segments` and `flex` (forward + backward, no update) and training
is refused (`AttentionKernelMismatch`, naming `model.attention_kernel`) when the loss or the gradient norms
differ beyond bf16 rounding. Gradients come from `torch.autograd.grad` with a hook per parameter that keeps
only its squared norm: nothing reaches `.grad` or DeepSpeed's accumulation hooks (ZeRO 0-3 alike).

    metrics = run_kernel_check(backend, loss_of, "actor/")   # {} when not due; raises on a mismatch

Invariant: the trainer's state after the check is its state before (tests/unit/models/test_kernel_check.py).
See docs/training-speed.md, "The start-up kernel check" (why this way, tolerances, what ran where).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rstar2_core.errors import AttentionKernelMismatch
from rstar2_core.models.packed_attention import segment_attention, training_kernel

GROUPS = ("attention", "mlp", "embeddings", "norms")
TOLERANCES = {"low": (1e-2, 5e-2), "fp32": (1e-4, 1e-3)}
"""(loss, gradient norm) relative tolerance by compute precision. bf16/fp16: two correct kernels round
differently (1 ulp = 0.4% on an element), which averages to ~1e-3 or less on a micro-batch's loss and on a
group's norm; a broken kernel is off by far more. fp32: ~1e-6 apart (TF32 off)."""
_FLOOR = 1e-12          # a relative difference against ~0 (a zero-weight padding micro-batch) is measured from here


def param_group(name: str) -> str:
    """Which of GROUPS a transformers decoder's parameter belongs to, by its name."""
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    if "embed" in name or "lm_head" in name:
        return "embeddings"
    return "norms"


@dataclass(frozen=True)
class KernelCheck:
    """One comparison: `loss`, `grad_norm` (all trainable parameters), `group_norm` (per GROUPS) and
    `seconds` (forward + backward, the first flex call compiling included) as (reference, candidate); the
    relative differences as every rank agreed them (the largest over ranks)."""

    reference: str
    candidate: str
    loss: tuple[float, float]
    grad_norm: tuple[float, float]
    group_norm: dict[str, tuple[float, float]]
    seconds: tuple[float, float]
    loss_rel_diff: float
    grad_norm_rel_diff: float
    group_rel_diff: dict[str, float]
    loss_tol: float
    grad_tol: float

    @property
    def ok(self) -> bool:
        grads = [self.grad_norm_rel_diff, *self.group_rel_diff.values()]
        return self.loss_rel_diff <= self.loss_tol and max(grads) <= self.grad_tol

    def metrics(self, prefix: str) -> dict[str, float]:
        """`<prefix>kernel_check_...` figures (prefix `actor/` or `sft/`)."""
        p = f"{prefix}kernel_check_"
        out = {f"{p}loss_rel_diff": self.loss_rel_diff, f"{p}grad_norm_rel_diff": self.grad_norm_rel_diff,
               f"{p}loss": self.loss[1], f"{p}grad_norm": self.grad_norm[1], f"{p}passed": float(self.ok),
               f"{p}seconds_{self.reference}": self.seconds[0], f"{p}seconds_{self.candidate}": self.seconds[1]}
        out.update({f"{p}grad_rel_diff_{g}": d for g, d in self.group_rel_diff.items()})
        return out

    def describe(self) -> str:
        worst = max(self.group_rel_diff, key=self.group_rel_diff.__getitem__)
        return (f"loss {self.loss[0]:.6g} vs {self.loss[1]:.6g} (rel diff {self.loss_rel_diff:.2e}, tol "
                f"{self.loss_tol:.0e}); gradient norm {self.grad_norm[0]:.6g} vs {self.grad_norm[1]:.6g} (rel diff "
                f"{self.grad_norm_rel_diff:.2e}, tol {self.grad_tol:.0e}); worst group {worst} (rel diff "
                f"{self.group_rel_diff[worst]:.2e})")


def _rel(ref: float, got: float) -> float:
    d = abs(got - ref) / max(abs(ref), _FLOOR)
    return d if math.isfinite(d) else math.inf


def _grad_group_norms(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, float]:
    """Squared gradient norm of `loss` per GROUPS, gradients never kept (see the module docstring)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sums = {g: torch.zeros((), dtype=torch.float32, device=loss.device) for g in GROUPS}

    def hook(group: str):
        def record(grad: torch.Tensor) -> torch.Tensor:
            sums[group] += torch.linalg.vector_norm(grad, dtype=torch.float32) ** 2
            return grad.new_zeros(()).expand(grad.shape)
        return record

    handles = [p.register_hook(hook(param_group(n))) for n, p in named]
    try:
        if loss.requires_grad:
            torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return {g: float(s) for g, s in sums.items()}


def _timed_pass(model, loss_of, kernel: str) -> tuple[float, dict[str, float], float]:
    t0 = time.perf_counter()
    with segment_attention(model, kernel):      # the backward too: checkpointed layers look the kernel up again
        loss = loss_of(model, kernel)
        sq = _grad_group_norms(model, loss)
    if loss.device.type == "cuda":
        torch.cuda.synchronize(loss.device)
    return float(loss.detach()), sq, time.perf_counter() - t0


def _agreed(values: list[float], device: torch.device) -> list[float]:
    """The largest of each value over the data-parallel ranks (itself in one process)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def compare_kernels(model: torch.nn.Module, loss_of: Callable[[torch.nn.Module, str], torch.Tensor], *,
                    reference: str = "segments", candidate: str = "flex", loss_tol: float = TOLERANCES["low"][0],
                    grad_tol: float = TOLERANCES["low"][1]) -> KernelCheck:
    """Forward + backward of `loss_of(model, kernel)` (a scalar) under each kernel; the figures and verdict.
    Collective across data-parallel ranks when a process group is up: every rank must call it."""
    runs = [_timed_pass(model, loss_of, k) for k in (reference, candidate)]
    (loss_r, sq_r, s_r), (loss_c, sq_c, s_c) = runs
    groups = {g: (math.sqrt(sq_r[g]), math.sqrt(sq_c[g])) for g in GROUPS}
    norm = (math.sqrt(sum(sq_r.values())), math.sqrt(sum(sq_c.values())))
    diffs = [_rel(loss_r, loss_c), _rel(*norm)] + [_rel(*groups[g]) for g in GROUPS]
    diffs = _agreed(diffs, next(model.parameters()).device)     # NaN was made inf by _rel: max is ordered
    return KernelCheck(reference, candidate, (loss_r, loss_c), norm, groups, (s_r, s_c), diffs[0], diffs[1],
                       dict(zip(GROUPS, diffs[2:])), loss_tol, grad_tol)


def attention_setup(model: torch.nn.Module, setting: str, kernel_check: bool | None) -> tuple[str, bool]:
    """(kernel, check due) of a training backend: `setting` (`model.attention_kernel`) resolved for the
    model's device (`training_kernel`: `flex` off CUDA refused), and whether its first step compares the
    kernels (`kernel_check`; None: when the kernel is flex, which only trains on CUDA)."""
    kernel = training_kernel(setting, next(model.parameters()).device)
    return kernel, kernel == "flex" if kernel_check is None else bool(kernel_check)


def low_precision(backend) -> bool:
    """Whether `backend` computes in bf16/fp16 (its parameters, or autocast)."""
    p = next(backend.model.parameters())
    return p.dtype in (torch.bfloat16, torch.float16) or bool(getattr(backend, "use_autocast", False))


def run_kernel_check(backend, loss_of: Callable[[torch.nn.Module, str], torch.Tensor],
                     prefix: str) -> dict[str, float]:
    """The check, once per backend: where `backend.kernel_check_due` (set at its start when its kernel is
    flex), compare `segments` with `backend.attention_kernel` on `loss_of` and clear the flag. Returns the
    `<prefix>kernel_check_...` metrics ({} when not due); raises `AttentionKernelMismatch` on a mismatch."""
    if not getattr(backend, "kernel_check_due", False):
        return {}
    backend.kernel_check_due = False
    model = getattr(backend.model, "module", backend.model)      # a DeepSpeed engine's HF model
    loss_tol, grad_tol = TOLERANCES["low" if low_precision(backend) else "fp32"]
    check = compare_kernels(model, loss_of, reference="segments", candidate=backend.attention_kernel,
                            loss_tol=loss_tol, grad_tol=grad_tol)
    if not check.ok:
        raise AttentionKernelMismatch(
            f"the attention kernels disagree on this trainer's first micro-batch (model.attention_kernel resolved to "
            f"{check.candidate!r}, compared with 'segments'): {check.describe()}. Training stopped before its first "
            'optimizer step. Set model.attention_kernel = "segments" (one SDPA per segment: exact, slower on long '
            "packed rows) and report these figures", check.metrics(prefix))
    return check.metrics(prefix)
