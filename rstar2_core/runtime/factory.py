"""`open_runtime`: the runtime a stage runs on, built from its `RuntimeSpec` (specs.py).

    async with open_runtime(cfg, policy_url=url, max_model_len=n, trainer=TrainerSpec("rl", 510, 20, "constant",
                                                                                      RL_STEP)) as rt:
        outcome = await rl_step(rt, chat, batch, rl=cfg.rl, rollout=cfg.rollout, limits=limits, seed=seed,
                                pad_id=pad)

This is where the root `Config` stops: it becomes a `RuntimeSpec` once, and `cluster.runtime` picks the
backend, `local` (runtime/local/) or `ray` (runtime/ray/). Invariant: both backends are imported lazily,
so opening a local runtime never imports Ray. See docs/runtime.md, "The runtime seam".
"""

from __future__ import annotations

from rstar2_core.config import Config
from rstar2_core.runtime.protocol import StageRuntime, TrainerSpec
from rstar2_core.runtime.specs import RuntimeSpec

__all__ = ["open_runtime", "runtime_for"]


def open_runtime(cfg: Config, *, policy_url: str, max_model_len: int | None = None,
                 trainer: TrainerSpec | None = None, engines: bool = True, sandbox: bool = True,
                 grader: bool = True) -> StageRuntime:
    """The runtime of `cfg.cluster.runtime` for a policy checkpoint; use it as `async with`.

    `max_model_len`: longest sequence (prompt + response) an engine must hold (None: the model's limit);
    `trainer`: build the trainer for this schedule and step body (None: sampling only); `engines`,
    `sandbox`, `grader`: leave out what the stage does not use (SFT needs only the trainer)."""
    return runtime_for(RuntimeSpec.from_config(cfg, policy_url=policy_url, max_model_len=max_model_len,
                                               trainer=trainer, engines=engines, sandbox=sandbox, grader=grader))


def runtime_for(spec: RuntimeSpec) -> StageRuntime:
    """The backend of `spec.kind`, not yet entered."""
    if spec.kind == "local":
        from rstar2_core.runtime.local import LocalRuntime

        return LocalRuntime(spec)
    from rstar2_core.runtime.ray import RayRuntime

    return RayRuntime(spec)
