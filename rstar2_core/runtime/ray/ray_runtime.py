"""`RayRuntime`: the `StageRuntime` (runtime/protocol.py) on a Ray cluster, built from a `RuntimeSpec`.

Start order: Ray -> one placement group per node -> the remote model into each node's cache (model_prefetch.py)
-> trainer shards (before the engines reserve KV-cache memory) -> inference engines -> on real GPUs, the
device check (runtime/ray/device_check.py) -> the sandbox pool on the layout's sandbox bundles -> the grader
pool in this driver process. Invariant: whatever started is stopped on every failure path and on leaving the
`async with` (each cleanup step runs even when one before it fails; a cleanup error never replaces the error
being raised), and one runtime per process holds the cluster at a time (`_OPEN`).
See docs/ray-runtime.md, "Start order and teardown".

    async with RayRuntime(spec) as rt:      # what open_runtime(cfg, ...) does for cluster.runtime = "ray"
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, Self

from rstar2_core.config import ConfigError
from rstar2_core.config.pipeline_sections import ClusterConfig
from rstar2_core.config.rollout_sections import SandboxConfig
from rstar2_core.config.runtime_rules import computes_on_gpu
from rstar2_core.runtime.protocol import OwnedGrader, RuntimeUsage, WeightSyncReport
from rstar2_core.runtime.ray.connect import ensure_ray, holds_runtime_slot
from rstar2_core.runtime.ray.device_check import check_runtime_devices
from rstar2_core.runtime.ray.engine_actors import RemoteEngine, start_engines
from rstar2_core.runtime.ray.model_prefetch import model_needs, prefetch_models
from rstar2_core.runtime.ray.node_kill import kill_local_raylet
from rstar2_core.runtime.ray.placement import (
    RUNTIME_GROUP_PREFIX,
    ActorGroup,
    kill_and_wait,
    remove_stale_runtime_groups,
    wait_node_dead,
)
from rstar2_core.runtime.ray.trainer_shards import TrainerGroup
from rstar2_core.runtime.ray.weight_sync import make_weight_sync
from rstar2_core.runtime.sandboxes import ray_sandbox_pool, service_sandbox
from rstar2_core.runtime.specs import RuntimeSpec

_OPEN = threading.Lock()
log = logging.getLogger(__name__)


def load_policy(checkpoint_url: str, dtype: str):
    """The policy model of a checkpoint on the CPU (the trainer shard moves it to its device)."""
    from rstar2_core.models.io import load_model_and_tokenizer

    return load_model_and_tokenizer(checkpoint_url, dtype=dtype, device="cpu")[0]


def actor_threads(cluster: ClusterConfig) -> int:
    """torch threads per engine/trainer actor (`cluster.actor_torch_threads`; 0 = 1 where the actors
    compute on the CPU)."""
    if cluster.actor_torch_threads:
        return cluster.actor_torch_threads
    return 0 if computes_on_gpu(cluster) else 1


class RayRuntime:
    """Trainer shards, engines, sandbox pool and grader of one stage on Ray (see the module docstring).

    `model_factory`, `engine_factory` (index -> zero-argument engine builder), `sandbox_factory`
    ((sandbox config, [(placement group, bundle, CPUs)]) -> pool) and `tokenizer` replace the production
    builders (tests pass fakes); `node_killer` (Ray node id -> PID killed) carries out the `kill-node`
    fault (default: `node_kill.kill_local_raylet`, a raylet of this machine)."""

    kind = "ray"

    def __init__(self, spec: RuntimeSpec, *, model_factory: Any = None, engine_factory: Any = None,
                 sandbox_factory: Any = None, tokenizer: Any = None,
                 node_killer: Callable[[str], int] | None = None):
        from rstar2_core.models.backend import backend_options
        from rstar2_core.models.io import load_tokenizer

        if spec.layout is None:
            raise ValueError("RayRuntime needs a RuntimeSpec with its layout (RuntimeSpec.from_config with "
                             "cluster.runtime = \"ray\")")
        self.spec, self.policy_url = spec, spec.policy_url
        self.engines: list[RemoteEngine] = []
        self.trainer: TrainerGroup | None = None
        self.sandbox = None
        self.grader = None
        self._grader = OwnedGrader()
        self._node_killer = node_killer or kill_local_raylet
        self.group: ActorGroup | None = None
        self._holds_lock = False
        if not _OPEN.acquire(blocking=False):
            log.info("another stage's RayRuntime is open in this process; waiting for it to close (a runtime's "
                     "layout takes the cluster)")
            _OPEN.acquire()
        self._holds_lock = True
        try:   # from here on every failure releases _OPEN (through _shutdown), or a retry here would wait forever
            cluster, timeout = spec.cluster, spec.cluster.placement_timeout_s
            self.weight_sync_mode = spec.weight_sync
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec.policy_url)
            ensure_ray(cluster)
            if (spec.trainer is not None or spec.engines) and not spec.shared_storage:
                _refuse_node_local_storage()     # ranks write shards, engines read the policy, on their nodes
            self.layout = spec.layout
            prefix = f"{RUNTIME_GROUP_PREFIX}{uuid.uuid4().hex[:6]}-"
            stale = remove_stale_runtime_groups(prefix, holds_runtime_slot())
            if stale:
                log.warning("removed %d placement groups a killed runtime left behind (%s): they held the "
                            "cluster this runtime needs", len(stale), ", ".join(stale))
            self.group = ActorGroup(self.layout, timeout_s=timeout, prefix=prefix,
                                    node_death_wait_s=cluster.node_death_wait_s)
            needs = model_needs(self.layout, spec.policy_url if spec.trainer is not None and model_factory is None
                                else None, None if engine_factory else [e.checkpoint_url for e in spec.engines])
            if needs:          # the download apart from placement: the actors then load from the node's disk
                took = prefetch_models(self.group, needs, cluster.model_download_timeout_s)
                log.info("the model is on %d node(s) in %.0f s (cluster.model_download_timeout_s = %.0f)",
                         len(took), max(took.values(), default=0.0), cluster.model_download_timeout_s)
            threads = actor_threads(cluster)
            if spec.trainer is not None:
                t = spec.trainer
                opts = backend_options(t.optim, t.model, total_steps=t.spec.total_steps,
                                       warmup_steps=t.spec.warmup_steps, schedule=t.spec.schedule)
                self.trainer = TrainerGroup(self.group, self.layout,
                                            model_factory or partial(load_policy, spec.policy_url, t.model.dtype),
                                            opts, t.spec.step, threads=threads, ready_timeout_s=timeout)
            if spec.engines:
                self.engines = start_engines(self.group, self.layout, None if engine_factory else spec.engines,
                                             threads=threads, factory=engine_factory, ready_timeout_s=timeout)
            if self.layout.device == "cuda" and (self.trainer is not None or self.engines):
                reports = check_runtime_devices(self.group, self.trainer, self.engines,     # DeviceConflict
                                                cluster.gpu_memory_gb)
                log.info("devices by identity: %s", "; ".join(f"{r.actor} {r.node} Ray GPU {r.ray_gpu} = {r.device}"
                                                               for r in reports))
            if spec.sandbox is not None and spec.sandbox.backend == "service":
                self.sandbox = service_sandbox(spec.sandbox)     # its own CPU nodes; entered in __aenter__
            elif spec.sandbox is not None:
                placements = [(self.group.pg(s.node), s.bundle_index, s.cpus) for s in self.layout.sandbox_actors]
                self.sandbox = (sandbox_factory or _ray_sandbox)(spec.sandbox, placements)
            self.weight_sync = (make_weight_sync(self.weight_sync_mode, self)
                                if spec.trainer is not None and spec.engines else None)
        except BaseException as e:
            self._shutdown(e)
            raise

    async def __aenter__(self) -> Self:
        try:
            if self.sandbox is not None and hasattr(self.sandbox, "health"):
                await self.sandbox.health()
            if self.spec.grader_timeout_s is not None:
                self.grader = self._grader.open(self.spec.grader_timeout_s)
        except BaseException as e:
            await self._aclose(e)
            raise
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self._aclose(exc)      # a failure to close does not replace the block's own error

    # --------------------------------------------------------------------------------------- steps
    def training(self) -> AbstractContextManager[None]:
        """Around an optimizer step and its weight sync: colocated vLLM engines sleep while the trainer
        steps (`rollout.release_memory_during_training`; rstar2_core/runtime/ray/weight_sync.py), a no-op otherwise."""
        return self.weight_sync.training() if self.weight_sync is not None else nullcontext()

    def sync_weights(self, checkpoint_url: str | None = None) -> WeightSyncReport:
        if self.weight_sync is None:
            raise ValueError("sync_weights needs a runtime with both a trainer and engines")
        return self.weight_sync.push(checkpoint_url)

    async def inject_fault(self, kind: str) -> None:
        import ray

        if kind == "kill-engine":
            kill_and_wait(self.group.actors["engine-0"])
        elif kind == "kill-trainer":
            if self.trainer is None:
                raise ValueError("kill-trainer: this runtime has no trainer")
            kill_and_wait(self.trainer.actor(min(1, self.trainer.world - 1)))
        elif kind == "kill-node":
            if self.trainer is None:
                raise ValueError("kill-node: this runtime has no trainer (the fault takes trainer rank 1's node)")
            name = self.trainer.names[min(1, self.trainer.world - 1)]
            node = self.group.nodes.get(name)
            if node is None:
                raise ValueError(f"kill-node: the node of {name} is not known")
            pid = self._node_killer(node)
            log.warning("fault kill-node: SIGKILLed the raylet (pid %d) and the workers of node %s, which holds %s",
                        pid, node[:8], ", ".join(sorted(a for a, n in self.group.nodes.items() if n == node)))
            wait_node_dead(node)     # as kill-engine waits for the death to be visible: the step goes on after
        elif kind == "kill-sandbox" and getattr(self.sandbox, "transport", None) == "handle":
            from rstar2_core.runtime.ray.tool_service import kill_one_replica

            name = kill_one_replica(self.sandbox.sc.app_name)    # Serve replaces it; lost batches are sent again
            log.warning("fault kill-sandbox: killed tool service replica %s", name)
        elif kind == "kill-sandbox":
            slots = getattr(self.sandbox, "slots", None)
            if not slots:
                raise ValueError("kill-sandbox: this runtime has no Ray sandbox pool to kill an actor of")
            kill_and_wait(slots[0].actor)     # the pool replaces it on its next call, answering that call `internal`
        elif kind == "engine-errors":
            ray.get(self.group.actors["engine-0"].fail_requests.remote(True))
        elif kind == "stale-weights":
            if self.trainer is None:
                raise ValueError("stale-weights: this runtime has no trainer whose weights the engine could differ from")
            ref, _ = self.trainer.weights_ref()
            ray.get(self.group.actors["engine-0"].load_stale_weights.remote(ref))
        else:
            raise ValueError(f"fault kind {kind!r} is not carried out by a runtime")

    def usage(self) -> RuntimeUsage:
        busy: tuple[float, ...] = ()
        if self.engines:
            busy = tuple(self.engines[0].get([e.handle.busy_seconds.remote() for e in self.engines]))
        return RuntimeUsage(busy, max(1, self.spec.tensor_parallel_size) if self.layout.device == "cuda" else 1,
                            tuple(self.trainer.busy) if self.trainer is not None else (),
                            nodes=len(set(self.group.nodes.values())) or 1)

    # ------------------------------------------------------------------------------------ closing
    async def aclose(self) -> None:
        """Close the engines (all at once, each at most `engines.CLOSE_TIMEOUT_S`: the actors are killed
        next in any case), then stop the rest (`_shutdown`)."""
        await self._aclose(None)

    async def _aclose(self, error: BaseException | None) -> None:
        engines, self.engines = self.engines, []
        results = await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
        for e, r in zip(engines, results):
            if isinstance(r, BaseException):
                log.warning("%s did not close (%s: %s); its actor is killed", e.name, type(r).__name__, r)
        try:
            if self.sandbox is not None and hasattr(self.sandbox, "aclose"):   # a tool service client's connections
                await self.sandbox.aclose()
        except Exception as e:  # noqa: BLE001 - a client that fails to close must not keep the actors alive
            log.warning("the tool service client did not close (%s: %s)", type(e).__name__, e)
        finally:                # also when the close is cancelled: the actors and placement groups go
            self._shutdown(error)

    def _shutdown(self, error: BaseException | None = None) -> None:
        """Close the sandbox pool and the grader pool, kill every actor and free the placement groups, then
        release `_OPEN`. Each step runs even when one before it raised: a sandbox close that fails must not
        leave the actors and placement groups to the next runtime (whose placement would time out). The
        first cleanup error is raised after all the steps, unless the caller is stopping the runtime
        because of `error`: then it is logged, and `error` stays the one that propagates."""
        def close_sandbox():
            if self.sandbox is not None:
                sb, self.sandbox = self.sandbox, None
                sb.close()

        def close_grader():
            if self._grader.close():     # the pool this runtime opened (callers may swap `grader`)
                self.grader = None

        def release():
            if self._holds_lock:
                self._holds_lock = False
                _OPEN.release()

        first: BaseException | None = None
        for step in (close_sandbox, close_grader, self.group.shutdown if self.group is not None else None, release):
            try:
                if step is not None:
                    step()
            except BaseException as e:   # noqa: BLE001 - the later steps must still run; raised below
                first = first or e
        if first is None:
            return
        if error is None or not isinstance(first, Exception):
            raise first
        log.warning("stopping the runtime after %s: %s failed too: %s", type(error).__name__,
                    type(first).__name__, first)


def _refuse_node_local_storage() -> None:
    """On a cluster of several live nodes, trainer ranks write checkpoint shards and engines read the
    policy from their own nodes: a local root not declared shared would leave the driver an incomplete
    checkpoint and the engines no policy."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    if len(alive) > 1:
        raise ConfigError(f"the Ray cluster has {len(alive)} live nodes and storage.root is a local folder not "
                          "declared shared: trainer ranks on other nodes write their checkpoint shards there and "
                          "engines read the policy from it, and a node-local disk leaves the driver an incomplete "
                          "checkpoint. Use an s3:// storage.root, "
                          "or set storage.shared_filesystem = true when every node mounts it at the same path")


def _ray_sandbox(sandbox_cfg: SandboxConfig, placements: list[tuple]):
    return ray_sandbox_pool(sandbox_cfg, placements=placements)
