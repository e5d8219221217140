"""The sandbox spread over a Ray cluster: one `SandboxActor` per node (or `cfg.ray_actors_per_node`),
each running a `LocalSandbox` on that node's CPUs, behind the same async API as the local service
(`await pool.run(req)`, `await pool.run_batch(reqs)`, `run_sync`, `close()`).

Placement: one actor per node (node affinity), or one per given placement-group bundle (the layout's
sandbox bundles). Invariant: at most `max_inflight_per_actor` requests are outstanding on an actor
(callers beyond that wait, so a burst queues in the caller, not in the object store), and an actor that
dies is replaced on its node, the requests it held run once more on the replacement (`internal` only if
that fails too: how many calls meet a dead actor depends on timing). Runtimes open it through
runtime/sandboxes.py. See docs/sandbox.md, "How it works" (Ray pool).
"""

from __future__ import annotations

import asyncio
import math
from typing import Self

import ray
from ray.exceptions import ActorUnschedulableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rstar2_core.config import SandboxConfig
from rstar2_core.sandbox.service import validate
from rstar2_core.sandbox.types import ExecutionRequest, ExecutionResult, Status, invalid_result

_WAIT_S = 0.002   # how often a caller held back by backpressure looks for room again


@ray.remote
class SandboxActor:
    """A LocalSandbox on one node; async methods, so one actor serves many calls at once."""

    def __init__(self, cfg: dict, workers: int):
        from rstar2_core.sandbox.service import LocalSandbox

        self.cfg = SandboxConfig.model_validate({**cfg, "workers": workers, "backend": "local"})
        self.sb = LocalSandbox(self.cfg).start()
        self.graders = None

    async def run_batch(self, reqs: list[ExecutionRequest]) -> list[ExecutionResult]:
        return await self.sb.run_batch(reqs)

    def ping(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "workers": self.sb.workers,
                "stats": self.sb.stats()}

    def grade_many(self, items: list[tuple[str, str]]) -> list:
        from rstar2_core.reward import GraderPool

        if self.graders is None:
            self.graders = GraderPool(workers=max(1, self.sb.workers // 2)).__enter__()
        return self.graders.grade_many(items)

    def close(self) -> None:
        if self.graders is not None:
            self.graders.__exit__(None, None, None)
            self.graders = None
        self.sb.close()


class _Slot:
    __slots__ = ("actor", "generation", "inflight", "node_id", "options", "workers")

    def __init__(self, node_id: str, workers: int, options: dict):
        self.node_id, self.workers, self.options = node_id, workers, options
        self.actor = None
        self.inflight = 0
        self.generation = 0


class RaySandboxPool:
    """Sandbox actors over every alive Ray node with CPUs."""

    def __init__(self, cfg: SandboxConfig, max_inflight_per_actor: int = 0, chunk: int = 16,
                 placements: list[tuple[PlacementGroup, int, int]] | None = None):
        """`placements`: (placement group, bundle index, CPUs) per actor, e.g. from the sandbox slots of
        `rstar2_core/runtime/layout.py`; the actor then holds that bundle's CPUs. Without it: `ray_actors_per_node`
        actors (default 1) on every alive node with CPUs, pinned by node affinity, reserving no CPU in
        Ray's accounting (they use the node's CPUs outside of Ray tasks)."""
        if not ray.is_initialized():
            raise RuntimeError("RaySandboxPool needs Ray: call ray.init() (or ray.init(address=...)) first, "
                               "or use sandbox.backend = 'local'")
        self.cfg, self.chunk = cfg, max(1, chunk)
        self._cfg_dict = cfg.model_dump()
        self.slots: list[_Slot] = []
        if placements:
            for pg, index, cpus in placements:
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
                self.slots.append(_Slot(f"pg{pg.id.hex()[:8]}/{index}", cfg.workers or 2 * max(1, cpus),
                                        {"num_cpus": cpus, "scheduling_strategy": strategy}))
        per_node = cfg.ray_actors_per_node or 1
        for node in [] if placements else ray.nodes():
            cpus = int(node.get("Resources", {}).get("CPU", 0))
            if not node.get("Alive") or cpus <= 0:
                continue
            workers = cfg.workers or max(1, 2 * cpus // per_node)
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            self.slots += [_Slot(node["NodeID"], workers, {"num_cpus": 0, "scheduling_strategy": strategy})
                           for _ in range(per_node)]
        if not self.slots:
            raise RuntimeError("no alive Ray node with CPUs: nothing to run the sandbox on")
        for s in self.slots:
            self._start(s)
        self.max_inflight = {id(s): max_inflight_per_actor or 4 * s.workers for s in self.slots}
        self.peak_inflight = 0
        self.replacements = 0
        self.retried = 0
        self._closed = False

    def _start(self, s: _Slot) -> None:
        s.actor = SandboxActor.options(max_concurrency=1000, **s.options).remote(self._cfg_dict, s.workers)
        s.generation += 1

    def _replace(self, s: _Slot, generation: int) -> None:
        if s.generation != generation or self._closed:
            return  # another caller already replaced it
        try:
            ray.kill(s.actor)
        except Exception:  # noqa: BLE001, S110 - it is dead already
            pass
        self.replacements += 1
        self._start(s)

    # -- lifecycle
    async def __aenter__(self) -> Self:
        await self.health()
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        refs = [s.actor.close.remote() for s in self.slots]
        try:
            ray.get(refs, timeout=30)
        except (RayActorError, GetTimeoutError):
            pass
        for s in self.slots:
            ray.kill(s.actor)

    async def health(self, timeout_s: float = 30.0) -> list[dict]:
        """Ping every actor; replace those that are dead or do not answer in `timeout_s`."""
        out = []
        for s in self.slots:
            gen = s.generation
            try:
                info = await asyncio.wait_for(s.actor.ping.remote(), timeout_s)
                out.append({**info, "healthy": True})
            except (TimeoutError, RayActorError) as e:
                out.append({"node_id": s.node_id, "healthy": False, "error": type(e).__name__})
                self._replace(s, gen)
        return out

    # -- calls
    async def _acquire(self, n: int) -> _Slot:
        while True:
            if self._closed:
                raise RuntimeError("this sandbox pool was closed")
            s = min(self.slots, key=lambda x: x.inflight / self.max_inflight[id(x)])
            if s.inflight == 0 or s.inflight + n <= self.max_inflight[id(s)]:
                s.inflight += n
                self.peak_inflight = max(self.peak_inflight, s.inflight)
                return s
            await asyncio.sleep(_WAIT_S)

    async def _run_chunk(self, reqs: list[ExecutionRequest], retry: bool = True) -> list[ExecutionResult]:
        """`reqs` on the least-loaded actor. An actor found dead is replaced and the chunk runs once more on
        the replacement (each request is a fresh, independent execution: running it again changes nothing
        outside the sandbox); what still fails answers `internal`."""
        s = await self._acquire(len(reqs))
        gen = s.generation
        try:
            return await s.actor.run_batch.remote(reqs)
        except (RayActorError, RayTaskError, ActorUnschedulableError) as e:
            error: Exception = e
            if isinstance(e, RayActorError):
                self._replace(s, gen)
        finally:
            s.inflight -= len(reqs)
        if retry and isinstance(error, RayActorError):
            self.retried += len(reqs)
            return await self._run_chunk(reqs, retry=False)
        why = f"sandbox actor {s.node_id[:12]} failed: {type(error).__name__}"
        return [ExecutionResult(id=r.id, status=Status.INTERNAL, stdout="", stderr=why, exit_code=None,
                                duration_s=0.0, truncated=False) for r in reqs]

    async def run_batch(self, reqs: list[ExecutionRequest]) -> list[ExecutionResult]:
        results: list[ExecutionResult | None] = [None] * len(reqs)
        todo = []
        for i, r in enumerate(reqs):
            why = validate(r)
            if why is None:
                todo.append(i)
            else:
                results[i] = invalid_result(r, why)
        size = max(1, min(self.chunk, math.ceil(len(todo) / max(1, len(self.slots)))))
        parts = [todo[i:i + size] for i in range(0, len(todo), size)]
        answers = await asyncio.gather(*(self._run_chunk([reqs[i] for i in p]) for p in parts))
        for p, ans in zip(parts, answers):
            for i, res in zip(p, ans):
                results[i] = res
        return results  # type: ignore[return-value]

    async def run(self, req: ExecutionRequest) -> ExecutionResult:
        return (await self.run_batch([req]))[0]

    def run_sync(self, req: ExecutionRequest) -> ExecutionResult:
        return asyncio.run(self.run(req))

    async def grade_many(self, items: list[tuple[str, str]]) -> list:
        """Grade (response_text, gold) pairs on the actors; results in order (rstar2_core.reward.GradeResult)."""
        if not items:
            return []
        size = math.ceil(len(items) / len(self.slots))
        parts = [items[i:i + size] for i in range(0, len(items), size)]
        out = await asyncio.gather(*(s.actor.grade_many.remote(p) for s, p in zip(self.slots, parts)))
        return [g for part in out for g in part]

    def stats(self) -> dict[str, float]:
        return {"sandbox/actors": float(len(self.slots)), "sandbox/actor_replacements": float(self.replacements),
                "sandbox/retried_calls": float(self.retried),
                "sandbox/peak_inflight_per_actor": float(self.peak_inflight)}
