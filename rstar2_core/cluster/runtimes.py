"""`open_runtime`: the runtime a stage runs on, chosen by `cluster.runtime` (rstar2_core/runtime/protocol.py).

    async with open_runtime(cfg, policy_url=url, max_model_len=n, trainer=TrainerSpec("rl", 510, 20, "constant",
                                                                                      RL_STEP)) as rt:
        outcome = await rl_step(rt, chat, batch, cfg=cfg, limits=limits, seed=seed, pad_id=pad)

`local` -> `runtime.local.LocalRuntime` (everything in this process; with `sandbox.backend = "ray"` its
sandbox is the Ray actor pool across the cluster's nodes); `ray` -> `cluster.runtime.RayRuntime`
(engine actors, trainer shards and the sandbox pool on the layout's placement groups). It lives here,
above both implementations and below the stages in the import layers: the stages (rl/, sft/, eval/)
call it, the runtimes never import the stages.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from rstar2_core.runtime.protocol import TrainerSpec

RUNTIMES = ("local", "ray")


def open_runtime(cfg: Any, *, policy_url: str, max_model_len: int | None = None, trainer: TrainerSpec | None = None,
                 engines: bool = True, sandbox: bool = True, grader: bool = True):
    """The runtime of `cfg.cluster.runtime` for a policy checkpoint; use it as `async with`.

    `max_model_len`: longest sequence (prompt + response) an engine must hold (None: the model's limit);
    `trainer`: build the trainer for this schedule and step body (None: sampling only); `engines`,
    `sandbox`, `grader`: leave out what the stage does not use (SFT needs only the trainer)."""
    kind = cfg.cluster.runtime
    kwargs = {"policy_url": policy_url, "max_model_len": max_model_len, "trainer": trainer, "engines": engines,
              "sandbox": sandbox, "grader": grader}
    if kind == "local":
        from rstar2_core.runtime.local import LocalRuntime

        pool = partial(_ray_pool, cfg) if cfg.sandbox.backend == "ray" else None
        return LocalRuntime(cfg, sandbox_factory=pool, **kwargs)
    if kind == "ray":
        from rstar2_core.cluster.runtime import RayRuntime

        return RayRuntime(cfg, **kwargs)
    raise ValueError(f"unknown cluster.runtime {kind!r}; valid: {list(RUNTIMES)}")


def _ray_pool(cfg: Any, sandbox_cfg: Any):
    """The sandbox actor pool over every node of the Ray cluster (the local runtime with sandbox.backend = ray)."""
    from rstar2_core.cluster.ray_init import ensure_ray
    from rstar2_core.cluster.sandbox_pool import RaySandboxPool

    ensure_ray(cfg)
    return RaySandboxPool(sandbox_cfg)
