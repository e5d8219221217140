"""`LocalRuntime`: the stage's engines, trainer, sandbox and grader in its own process (the embedded default).

Engines come from `engine_builder.build_engine` on this process's device; the trainer is `LocalTrainer`
(torch, or single-process DeepSpeed); the sandbox `LocalSandbox`, or with `sandbox.backend = "ray"` the
Ray actor pool (through runtime/sandboxes.py); the grader a `GraderPool`; weight sync `state_dict` or
`checkpoint`. Faults: `kill-engine` closes engine 0, `engine-errors` makes it fail every request,
`stale-weights` loads it with noisy weights; `kill-trainer`, `kill-node`, `kill-sandbox` are refused
(no actor to kill). Invariant: nothing here imports runtime/ray/ (nor Ray).
See docs/runtime.md, "The runtime seam".
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Self

from rstar2_core.runtime.engine_builder import FailingEngine, build_engine, engine_busy_seconds
from rstar2_core.runtime.protocol import OwnedGrader, RuntimeUsage, WeightSyncReport
from rstar2_core.runtime.sandboxes import local_sandbox, ray_sandbox_pool, service_sandbox
from rstar2_core.runtime.specs import RuntimeSpec, local_device


def _nbytes(state: dict[str, Any]) -> int:
    return int(sum(t.numel() * t.element_size() for t in state.values() if hasattr(t, "element_size")))


class LocalRuntime:
    kind = "local"

    def __init__(self, spec: RuntimeSpec):
        from rstar2_core.models.io import load_tokenizer

        self.spec, self.policy_url = spec, spec.policy_url
        self.weight_sync_mode = spec.weight_sync
        self.device = local_device()
        self.tokenizer = load_tokenizer(spec.policy_url)
        self.engines: list[Any] = []
        self.trainer = None
        self.sandbox = None
        self.grader = None
        self._grader = OwnedGrader()
        backend = spec.sandbox.backend if spec.sandbox is not None else "local"
        self._sandbox_factory = {"ray": _ray_sandbox, "service": _service_sandbox}.get(backend, _local_sandbox)
        try:
            if spec.trainer is not None:
                from rstar2_core.runtime.local.trainer import LocalTrainer

                self.trainer = LocalTrainer(spec.trainer, spec.policy_url, self.device)
            self.engines = [build_engine(e) for e in spec.engines]
        except BaseException:
            self._close_sync()
            raise

    async def __aenter__(self) -> Self:
        try:
            if self.spec.sandbox is not None:
                self.sandbox = self._sandbox_factory(self.spec)
                await self.sandbox.__aenter__()
            if self.spec.grader_timeout_s is not None:
                self.grader = self._grader.open(self.spec.grader_timeout_s)
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
        elif kind in ("kill-trainer", "kill-node", "kill-sandbox"):
            raise ValueError(f"RSTAR2_FAULT_INJECT kind {kind} kills a Ray actor (or its node): it needs "
                             "cluster.runtime = \"ray\" (the local runtime trains and runs its sandbox in this process)")
        else:
            raise ValueError(f"fault kind {kind!r} is not carried out by a runtime")

    def usage(self) -> RuntimeUsage:
        return RuntimeUsage(tuple(engine_busy_seconds(e) for e in self.engines),
                            self.spec.tensor_parallel_size,
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


def _local_sandbox(spec: RuntimeSpec):
    return local_sandbox(spec.sandbox)


def _service_sandbox(spec: RuntimeSpec):
    """The tool service (`sandbox.backend = "service"`): its handle through `cluster`'s Ray, or its URL."""
    return service_sandbox(spec.sandbox, cluster=spec.cluster)


def _ray_sandbox(spec: RuntimeSpec):
    """The sandbox actor pool over every node of the Ray cluster (`sandbox.backend = "ray"`)."""
    return ray_sandbox_pool(spec.sandbox, cluster=spec.cluster)
