"""`LocalRuntime`: the stage's engines, trainer, sandbox and grader in its own process (the embedded default).

- engines: `rollout.num_engines` engines built by `runtime.engines.build_engine` on this process's
  device (`cuda` when present, else `cpu`); HF engines decode on their own threads, a vLLM engine
  runs its own workers (tensor parallelism included);
- trainer: `LocalTrainer` (torch, or single-process DeepSpeed);
- sandbox: `LocalSandbox` (forked templates on this host), or what `sandbox_factory` opens (with
  `sandbox.backend = "ray"`, `cluster.open_runtime` passes the Ray actor pool across the nodes);
- grader: a `GraderPool` of worker processes;
- weight sync: `state_dict` (engines load the trainer's tensors in process) or `checkpoint` (engines
  reload the checkpoint the step just published).

Faults: `kill-engine` closes engine 0 (its requests then fail as a dead engine's would),
`engine-errors` makes engine 0 fail every request; `kill-trainer` raises (there is no trainer process
to kill) with the message to use the Ray runtime.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Self

from rstar2_core.runtime.engines import EngineSpec, FailingEngine, build_engine, engine_busy_seconds
from rstar2_core.runtime.protocol import OwnedGrader, RuntimeUsage, TrainerSpec, WeightSyncReport


def local_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _nbytes(state: dict[str, Any]) -> int:
    return int(sum(t.numel() * t.element_size() for t in state.values() if hasattr(t, "element_size")))


class LocalRuntime:
    kind = "local"

    def __init__(self, cfg: Any, *, policy_url: str, max_model_len: int | None = None,
                 trainer: TrainerSpec | None = None, engines: bool = True, sandbox: bool = True,
                 grader: bool = True, sandbox_factory: Callable[[Any], Any] | None = None):
        from rstar2_core.config.runtime_rules import resolved_weight_sync
        from rstar2_core.models.io import load_tokenizer

        self.cfg, self.policy_url = cfg, policy_url
        self.weight_sync_mode = resolved_weight_sync(cfg)
        self.device = local_device()
        self.tokenizer = load_tokenizer(policy_url)
        self.engines: list[Any] = []
        self.trainer = None
        self.sandbox = None
        self.grader = None
        self._grader = OwnedGrader()
        self._want_sandbox, self._want_grader = sandbox, grader
        self._sandbox_factory = sandbox_factory or _local_sandbox
        try:
            if trainer is not None:
                from rstar2_core.runtime.local_trainer import LocalTrainer

                self.trainer = LocalTrainer(cfg, policy_url, trainer, self.device)
            if engines:
                self.engines = [build_engine(EngineSpec.from_config(cfg, policy_url, max_model_len, self.device, i))
                                for i in range(cfg.rollout.num_engines)]
        except BaseException:
            self._close_sync()
            raise

    async def __aenter__(self) -> Self:
        try:
            if self._want_sandbox:
                self.sandbox = self._sandbox_factory(self.cfg.sandbox)
                await self.sandbox.__aenter__()
            if self._want_grader:
                self.grader = self._grader.open(self.cfg)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # --------------------------------------------------------------------------------------- steps
    def training(self) -> AbstractContextManager[None]:
        """Nothing to release: local engines keep their memory (rollout.release_memory_during_training
        is refused for the local runtime)."""
        return nullcontext()

    def sync_weights(self, checkpoint_url: str | None = None) -> WeightSyncReport:
        t0 = time.perf_counter()
        secs: list[float] = []
        if self.weight_sync_mode == "checkpoint":
            if not checkpoint_url:
                raise ValueError("rollout.weight_sync = \"checkpoint\" needs the URL of the checkpoint the step "
                                 "just published")
            payload, size = checkpoint_url, 0
        else:
            if self.trainer is None:
                raise ValueError("sync_weights on a runtime without a trainer")
            payload = self.trainer.weights()
            size = _nbytes(payload)
        for e in self.engines:
            t = time.perf_counter()
            e.update_weights(payload)
            secs.append(time.perf_counter() - t)
        return WeightSyncReport(self.weight_sync_mode, size, time.perf_counter() - t0, tuple(secs))

    async def inject_fault(self, kind: str) -> None:
        if kind == "kill-engine":
            await self.engines[0].close()
        elif kind == "engine-errors":
            self.engines[0] = FailingEngine(self.engines[0])
        elif kind == "stale-weights":
            from rstar2_core.faults import stale_weights

            if self.trainer is None:
                raise ValueError("stale-weights: this runtime has no trainer whose weights the engine could differ from")
            self.engines[0].update_weights(stale_weights(self.trainer.weights()))
        elif kind == "kill-trainer":
            raise ValueError("RSTAR2_FAULT_INJECT kind kill-trainer kills a trainer-shard actor: it needs "
                             "cluster.runtime = \"ray\" (the local runtime trains in this process)")
        else:
            raise ValueError(f"fault kind {kind!r} is not carried out by a runtime")

    def usage(self) -> RuntimeUsage:
        return RuntimeUsage(tuple(engine_busy_seconds(e) for e in self.engines),
                            self.cfg.rollout.tensor_parallel_size,
                            (self.trainer.busy_s,) if self.trainer is not None else ())

    # ------------------------------------------------------------------------------------ closing
    async def aclose(self) -> None:
        engines, self.engines = self.engines, []
        for e in engines:
            await e.close()
        if self.sandbox is not None:
            sb, self.sandbox = self.sandbox, None
            await sb.__aexit__(None, None, None)
        self._close_sync()

    def _close_sync(self) -> None:
        if self._grader.close():     # the pool this runtime opened (callers may swap `grader`)
            self.grader = None
        if self.trainer is not None:
            t, self.trainer = self.trainer, None
            t.close()


def _local_sandbox(sandbox_cfg: Any):
    from rstar2_core.sandbox import LocalSandbox

    return LocalSandbox(sandbox_cfg)
