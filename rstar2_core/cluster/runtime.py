"""`StageRuntime`: every Ray actor an RL stage needs, placed per the layout, started in a safe order and
stopped together. The glue between `rl.stage` and this package.

Start order: placement groups (one per node, layout.py) -> trainer shards (they briefly hold the full
model on their GPU before ZeRO partitions it, so they go before the engines reserve KV-cache memory) ->
inference engines -> the sandbox pool on the layout's sandbox bundles (`cluster/sandbox_pool.py`).
If any start fails, whatever started is stopped before the error propagates. An actor death later
raises `ActorFailure` (retryable) from the call that noticed it, after the whole group was shut down;
`close()` then only closes the sandbox pool. Use it as a context manager.

    with StageRuntime(cfg, policy_url=sft_url, max_model_len=prompt_len + stage.max_response_tokens,
                      total_steps=sum(s.steps for s in cfg.rl.stages)) as rt:
        groups = run_rollout_groups(rt.engines, rt.sandbox, chat, problems, n=32, limits=limits)
        metrics = rt.trainers.rl_update(kept, advantages, pad_id=pad_id)
        report = rt.sync_weights()                       # cfg.rollout.weight_sync
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from rstar2_core.cluster.engines import EngineSpec, WeightSyncReport, start_engines, sync_weights
from rstar2_core.cluster.layout import ClusterLayout, compute_layout
from rstar2_core.cluster.placement import ActorGroup
from rstar2_core.cluster.trainer import TrainerGroup


def load_policy(checkpoint_url: str, dtype: str):
    """The policy model of a checkpoint on the CPU (the trainer shard moves it to its GPU)."""
    import torch

    from rstar2_core.models.io import load_model_and_tokenizer

    return load_model_and_tokenizer(checkpoint_url, dtype=getattr(torch, dtype), device="cpu")[0]


def backend_kwargs(cfg: Any, total_steps: int) -> dict:
    """`DeepSpeedBackend` arguments of the RL actor from `cfg.rl` / `cfg.model` (constant lr after warm-up)."""
    rl = cfg.rl
    return {"zero_stage": rl.zero_stage, "lr": rl.lr, "total_steps": max(1, total_steps),
            "warmup_steps": rl.warmup_steps, "schedule": "constant", "weight_decay": rl.weight_decay,
            "betas": tuple(rl.betas), "grad_clip": rl.grad_clip, "micro_batch_size": rl.micro_batch_size,
            "gradient_checkpointing": cfg.model.gradient_checkpointing}


def _ray_sandbox(sandbox_cfg: Any, placements: list[tuple]):
    from rstar2_core.cluster.sandbox_pool import RaySandboxPool

    return RaySandboxPool(sandbox_cfg, placements=placements)


class StageRuntime:
    """Trainer shards, engines and sandbox of one RL stage (see the module docstring).

    `model_factory`, `engine_factory` (index -> zero-argument engine builder) and `sandbox_factory`
    (sandbox config, [(placement group, bundle index, CPUs)]) -> pool) replace the production builders
    (tests pass fakes); `layout` replaces `compute_layout(cfg)`."""

    def __init__(self, cfg: Any, *, policy_url: str, max_model_len: int, total_steps: int,
                 layout: ClusterLayout | None = None, model_factory: Callable[[], Any] | None = None,
                 engine_factory: Callable[[int], Callable[[], Any]] | None = None,
                 sandbox_factory: Callable[[Any, list[tuple]], Any] | None = None, timeout_s: float = 600.0):
        self.cfg = cfg
        self.layout = layout or compute_layout(cfg)
        self.sandbox = None
        self.group = ActorGroup(self.layout, timeout_s=timeout_s)
        try:
            self.trainers = TrainerGroup(self.group, self.layout,
                                         model_factory or partial(load_policy, policy_url, cfg.model.dtype),
                                         backend_kwargs(cfg, total_steps))
            spec = None if engine_factory else EngineSpec.from_config(cfg, policy_url, max_model_len)
            self.engines = start_engines(self.group, self.layout, spec, factory=engine_factory)
            placements = [(self.group.pg(s.node), s.bundle_index, s.cpus) for s in self.layout.sandbox_actors]
            self.sandbox = (sandbox_factory or _ray_sandbox)(cfg.sandbox, placements)
        except BaseException:
            self.close()
            raise

    def sync_weights(self, checkpoint_url: str | None = None) -> WeightSyncReport:
        """Push the trainers' current weights to every engine (`cfg.rollout.weight_sync`); mode
        `checkpoint` needs the URL of the checkpoint the stage just published."""
        mode = self.cfg.rollout.weight_sync
        if mode == "checkpoint":
            if not checkpoint_url:
                raise ValueError("rollout.weight_sync = \"checkpoint\" needs checkpoint_url= (the complete "
                                 "checkpoint just written); or use weight_sync = \"state_dict\"")
            return sync_weights(self.engines, checkpoint_url, mode="checkpoint")
        return sync_weights(self.engines, self.trainers.weights_ref(), mode="state_dict")

    def close(self) -> None:
        """Stop the sandbox pool, every actor and the placement groups. Idempotent."""
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
        self.group.shutdown()

    def __enter__(self) -> StageRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
