"""The runtime seam: what a stage needs (engines, sandbox, grader, trainer, weight sync) behind one protocol.

    async with open_runtime(cfg, policy_url=url, max_model_len=n, trainer=TrainerSpec(...)) as rt:
        groups = await rollout_groups(rt.engines, rt.sandbox, chat, problems, n=32, limits=limits)
        with rt.training():        # colocated vLLM engines may sleep while the trainer steps
            metrics = rt.trainer.step(list(zip(kept, advantages)), micro_batch_size=8, pad_id=pad, ...)
            report = rt.sync_weights()

Invariant: stage code sees only this protocol and hands the runtime the body of its optimizer step
(`TrainerSpec.step`, a `TrainerStep`), so the runtime never imports a stage and the same step runs on
one CPU or 64 GPUs. See docs/runtime.md, "The runtime seam".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from rstar2_core.rollout.types import Engine


@dataclass(frozen=True)
class TrainerStep:
    """The body of one optimizer step, as every trainer rank runs it, handed to the runtime by the stage
    (rl.trainer.RL_STEP, sft.step.SFT_STEP), so the runtime and its actors need not import the stages:

    - `update(backend, items, *, total_tokens, num_micro_batches, loss_scale, **kwargs) -> metrics`: one
      rank's forward/backward passes over its `items` and the optimizer step;
    - `weight(item) -> float`: the tokens an item trains on (the loss's denominator; weight 0 items are left out);
    - `merge(per_rank_metrics, per_rank_weights) -> metrics`: the step's metrics from every rank's;
    - `length(item) -> float`: the tokens its forward computes (how items are balanced over ranks);
    - `cut(items, *, micro_batch_size, max_tokens_per_micro_batch=None, **kwargs) -> [[index, ...], ...]`:
      the micro-batches `update` runs over these items (the Ray trainer sizes every rank's count with it)."""

    update: Callable[..., dict[str, float]]
    weight: Callable[[Any], float]
    merge: Callable[[Sequence[dict[str, float]], Sequence[float]], dict[str, float]]
    length: Callable[[Any], float]
    cut: Callable[..., list[list[int]]]


@dataclass(frozen=True)
class TrainerSpec:
    """What the trainer optimises: the config section (`rl` or `sft`), its schedule length, and the step body."""

    section: Literal["rl", "sft"]
    total_steps: int
    warmup_steps: int
    schedule: Literal["cosine", "constant"]
    step: TrainerStep


@dataclass(frozen=True)
class WeightSyncReport:
    """One trainer -> engines weight push: mode, bytes moved per engine, wall seconds."""

    mode: str
    bytes: int
    seconds: float
    engine_seconds: tuple[float, ...] = ()

    def metrics(self) -> dict[str, float]:
        return {"sync/seconds": self.seconds, "sync/bytes": float(self.bytes),
                "sync/engine_max_s": max(self.engine_seconds, default=0.0)}


@dataclass(frozen=True)
class RuntimeUsage:
    """Cumulative busy seconds of each engine (x its devices) and each trainer rank since the runtime
    opened; `devices_per_engine` = its tensor-parallel size (1 for CPU processes); `nodes` = the machines
    (Ray nodes) its engines and trainer ranks run on (1 for the local runtime)."""

    engine_busy_s: tuple[float, ...] = ()
    devices_per_engine: int = 1
    trainer_busy_s: tuple[float, ...] = ()
    nodes: int = 1
    extra: dict = field(default_factory=dict)


class OwnedGrader:
    """The grader pool a runtime opens on entry and closes when it closes, the same for every runtime.
    Steps use `runtime.grader`; a caller may replace that with its own grader (bench/vs_trl.py,
    bench/runtime.py), and the runtime still closes only the pool it opened."""

    def __init__(self) -> None:
        self.pool: Any = None

    def open(self, timeout_s: float) -> Any:
        from rstar2_core.reward import GraderPool

        self.pool = GraderPool(timeout_s=timeout_s).__enter__()
        return self.pool

    def close(self) -> bool:
        """Close the pool if one is open; True if it was."""
        if self.pool is None:
            return False
        pool, self.pool = self.pool, None
        pool.__exit__(None, None, None)
        return True


@runtime_checkable
class PolicyTrainer(Protocol):
    """The policy's optimiser: one process (local) or `world_size` data-parallel ranks (Ray)."""

    world_size: int

    def step(self, items: Sequence[Any], *, micro_batch_size: int, **kwargs: Any) -> dict[str, float]:
        """One optimizer step on `items` (RL: (trajectory, advantage) pairs; SFT: packed rows) with the
        spec's `TrainerStep` on every rank: items split by weight, equal micro-batch counts, merged metrics."""
        ...

    def reset_optimizer(self) -> None: ...

    def load_state(self, checkpoint_url: str) -> bool:
        """Restore optimizer/scheduler state saved with the checkpoint (same world size); False if none."""
        ...

    def save(self, staging_url: str, optimizer: bool = True) -> None:
        """Write the HF weights (and, with `optimizer`, each rank's optimizer state) into a folder being
        published (runtime/checkpoint.py)."""
        ...

    def close(self) -> None: ...


class StageRuntime(Protocol):
    kind: str
    weight_sync_mode: str       # rollout.weight_sync, resolved for this runtime
    engines: list[Engine]
    sandbox: Any
    grader: Any
    trainer: PolicyTrainer | None
    tokenizer: Any

    def training(self) -> AbstractContextManager[None]:
        """A context around one optimizer step and its `sync_weights`: the engines may release device
        memory for the trainer inside it (colocated vLLM sleep mode, `rollout.release_memory_during_training`)
        and serve again once the sync, or a normal exit without one, brought them back."""
        ...

    def sync_weights(self, checkpoint_url: str | None = None) -> WeightSyncReport:
        """Push the trainer's current weights to every engine (`rollout.weight_sync`)."""
        ...

    async def inject_fault(self, kind: str) -> None:
        """Carry out a fault of rstar2_core.faults (kill-engine, kill-trainer, kill-node, engine-errors, stale-weights)."""
        ...

    def usage(self) -> RuntimeUsage: ...

    async def aclose(self) -> None: ...

