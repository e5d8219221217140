"""Fault injection, to rehearse failures and the UI's Retry: `RSTAR2_FAULT_INJECT=<stage>:step=<n>[:<kind>]`.

When step n (1-based) of `<stage>` begins, the fault of `kind` (`FAULT_KINDS`: raise, kill-engine,
kill-trainer, kill-node, kill-sandbox, engine-errors, stale-weights) happens once per run; several faults: separate
with commas. Invariant: a marker file in the stage's own output folder (`<out_url>/faults/`) records that
it fired, so a retry of the same run goes through and a fresh run (a new output folder) fails again.
`maybe_inject_fault` raises `InjectedFault` for `raise` and returns any other kind, which the stage loop
carries out through its runtime (`StageRuntime.inject_fault`). See docs/runtime.md, "Fault injection".
"""

from __future__ import annotations

import os

from rstar2_core import storage
from rstar2_core.errors import InfraError

FAULT_KINDS = ("raise", "kill-engine", "kill-trainer", "kill-node", "kill-sandbox", "engine-errors", "stale-weights")
STALE_NOISE = 0.5
"""Noise of the `stale-weights` fault, as a share of each tensor's own standard deviation."""


def stale_weights(state_dict: dict, noise: float = STALE_NOISE, seed: int = 0) -> dict:
    """`state_dict` with every floating tensor moved by Gaussian noise of `noise` x its std (seeded)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state_dict.items():
        if v.is_floating_point():
            t = v.detach().float()
            v = (t + noise * t.std().clamp(min=1e-3) * torch.randn(t.shape, generator=g)).to(v.dtype)
        out[k] = v
    return out
ENV = "RSTAR2_FAULT_INJECT"


class InjectedFault(InfraError):
    """Raised by `maybe_inject_fault` for kind `raise`; retried like any infrastructure error."""


def parse_fault_spec(spec: str) -> list[tuple[str, int, str]]:
    """[(stage, step, kind)] of a `RSTAR2_FAULT_INJECT` value."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        stage, sep, rest = part.partition(":")
        step, _, kind = rest.partition(":")
        kind = kind or "raise"
        if not sep or not step.startswith("step=") or not step[5:].isdigit() or not stage or kind not in FAULT_KINDS:
            raise ValueError(f"{ENV} entry {part!r} must look like <stage>:step=<n>[:<kind>] with kind one of "
                             f"{list(FAULT_KINDS)}, e.g. rl-stage-1:step=3 or rl-stage-1:step=2:kill-engine")
        out.append((stage, int(step[5:]), kind))
    return out


def maybe_inject_fault(stage: str, step: int, run_dir: str) -> str | None:
    """Call when step `step` (1-based) of `stage` begins; `run_dir` is the stage's output folder URL,
    where the once-per-run marker lives. Raises `InjectedFault` for kind `raise`; returns the kind of
    any other fault that fired now (the caller carries it out), else None."""
    spec = os.environ.get(ENV, "")
    if not spec:
        return None
    for name, at, kind in parse_fault_spec(spec):
        if name != stage or at != step:
            continue
        marker = storage.join(run_dir, "faults", f"{stage}-step{step}-{kind}.fired")
        if storage.exists(marker):
            continue
        storage.write_text_atomic(marker, f"{kind}\n")
        if kind == "raise":
            raise InjectedFault(f"injected fault in {stage} at step {step} ({ENV}={spec})")
        return kind
    return None
