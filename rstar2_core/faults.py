"""Fault injection for tests and demos: `RSTAR2_FAULT_INJECT=<stage>:step=<n>` makes `<stage>` raise
`InjectedFault` when its step n (1-based) begins, once: a marker under $RSTAR2_HOME/faults records
that it fired, so a retried run goes through. Several faults: separate with commas."""

from __future__ import annotations

import os
from pathlib import Path


class InjectedFault(RuntimeError):
    """Raised by `maybe_inject_fault`; the pipeline treats it as a retryable infrastructure error."""


def _marker_dir() -> Path:
    return Path(os.environ.get("RSTAR2_HOME", Path(__file__).resolve().parents[1] / ".rstar2")) / "faults"


def parse_fault_spec(spec: str) -> list[tuple[str, int]]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        stage, sep, rest = part.partition(":")
        if not sep or not rest.startswith("step=") or not rest[5:].isdigit() or not stage:
            raise ValueError(f"RSTAR2_FAULT_INJECT entry {part!r} must look like <stage>:step=<n>, "
                             "e.g. rl-stage-1:step=3")
        out.append((stage, int(rest[5:])))
    return out


def maybe_inject_fault(stage: str, step: int) -> None:
    """Call at the start of each step (1-based) of `stage`."""
    spec = os.environ.get("RSTAR2_FAULT_INJECT", "")
    if not spec:
        return
    for name, at in parse_fault_spec(spec):
        if name == stage and at == step:
            marker = _marker_dir() / f"{stage}-step{step}.fired"
            if marker.exists():
                return
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text("fired\n")
            raise InjectedFault(f"injected fault in {stage} at step {step} (RSTAR2_FAULT_INJECT={spec})")
