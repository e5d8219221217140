"""The runtime seam every stage runs through (protocol.py): local or Ray, chosen by `cluster.runtime`.

    async with open_runtime(cfg, policy_url=url, max_model_len=n, trainer=TrainerSpec("rl", 510, 20, "constant")) as rt:
        outcome = await rl_step(rt, chat, batch, cfg=cfg, limits=limits, seed=seed, pad_id=pad)

`open_runtime` returns a `LocalRuntime` (runtime/local.py) or a `RayRuntime`
(rstar2_core/cluster/runtime.py, imported only when asked for, so this package needs no Ray).
"""

from __future__ import annotations

from typing import Any

from rstar2_core.runtime.protocol import (
    PolicyTrainer,
    RuntimeUsage,
    StageRuntime,
    TrainerSpec,
    WeightSyncReport,
)

RUNTIMES = ("local", "ray")


def open_runtime(cfg: Any, *, policy_url: str, max_model_len: int | None = None, trainer: TrainerSpec | None = None,
                 engines: bool = True, sandbox: bool = True, grader: bool = True):
    """The runtime of `cfg.cluster.runtime` for a policy checkpoint; use it as `async with`.

    `max_model_len`: longest sequence (prompt + response) an engine must hold (None: the model's limit);
    `trainer`: build the trainer for this schedule (None: sampling only); `engines`, `sandbox`, `grader`:
    leave out what the stage does not use (SFT needs only the trainer)."""
    kind = cfg.cluster.runtime
    kwargs = {"policy_url": policy_url, "max_model_len": max_model_len, "trainer": trainer, "engines": engines,
              "sandbox": sandbox, "grader": grader}
    if kind == "local":
        from rstar2_core.runtime.local import LocalRuntime

        return LocalRuntime(cfg, **kwargs)
    if kind == "ray":
        from rstar2_core.cluster.runtime import RayRuntime

        return RayRuntime(cfg, **kwargs)
    raise ValueError(f"unknown cluster.runtime {kind!r}; valid: {list(RUNTIMES)}")


__all__ = ["RUNTIMES", "PolicyTrainer", "RuntimeUsage", "StageRuntime", "TrainerSpec", "WeightSyncReport",
           "open_runtime"]
