"""RL checkpoints: the driver's `rl_state.pt` (step, data cursor, RNG states, tracking run id, the last
step's metrics, usage totals, world size) beside the HF model folder and every trainer rank's state,
published through `runtime.checkpoint.publish_policy_checkpoint`; step and final URLs, keep-last-K pruning.

    steps/step-000003/   resumable step checkpoints (the last `keep_checkpoints` are kept)
    final/               the stage's final checkpoint (always kept; what the next stage starts from)

Invariant: a folder without `_COMPLETE` (a crash mid-write) is never resumed from (`latest_complete`).

See docs/rl.md, "Checkpoints and resume".
"""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from rstar2_core import storage
from rstar2_core.models.io import latest_complete, read_extra

STATE_FILE = "rl_state.pt"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def step_url(out_url: str, step: int) -> str:
    return storage.join(out_url, "steps", f"step-{step:06d}")


def final_url(out_url: str) -> str:
    return storage.join(out_url, "final")


def read_rl_state(checkpoint_url: str) -> dict | None:
    """The `rl_state.pt` of a checkpoint, or None when it has none (e.g. an SFT checkpoint)."""
    if not storage.exists(storage.join(checkpoint_url, STATE_FILE)):
        return None
    return torch.load(io.BytesIO(read_extra(checkpoint_url, STATE_FILE)), weights_only=False)


def latest_step_checkpoint(out_url: str) -> str | None:
    return latest_complete(storage.join(out_url, "steps"))


def prune_step_checkpoints(out_url: str, keep: int) -> list[str]:
    """Remove all but the newest `keep` step checkpoints (and stale incomplete ones); returns removed URLs."""
    dirs = storage.list_dirs(storage.join(out_url, "steps"))
    complete = sorted(u for u in dirs if storage.is_complete(u))
    removed = complete[:-keep] if keep > 0 else complete
    newest = complete[-1] if complete else ""
    removed += [u for u in dirs if not storage.is_complete(u) and u.rsplit("/", 1)[-1].startswith("step-")
                and u < newest]
    for u in removed:
        storage.remove(u)
    return removed
