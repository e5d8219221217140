"""Learning-rate schedules shared by every training backend (`TorchBackend`, `DeepSpeedBackend`).

Linear warm-up from 0 over `warmup_steps` optimizer steps, then cosine decay to `min_lr_ratio * lr` at
`total_steps` (the paper's SFT) or constant (the paper's RL). `lr_factor(s, ...)` is the multiplier of
the peak lr for step `s` (0-based, the step about to be taken).
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "constant")


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {list(SCHEDULES)}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
