"""Inference engines as Ray actors: `EngineActor` (one engine built inside the actor) and `RemoteEngine`.

`EngineActor` builds its engine with `runtime.engine_builder.build_engine` (the local runtime's builder),
so GPU state never crosses processes; `RemoteEngine` is the driver-side proxy implementing the `Engine`
protocol, so `rollout_groups` schedules over the cluster unchanged; `engine_actor_options` gives the Ray
options of one `EngineSlot` of the layout (a GPU share, or vLLM's TP workers on the slot's bundles).
Invariant: an actor death noticed by any call (`generate` included) shuts the whole group down first and
surfaces as `ActorFailure` or `NodeLost` (retryable). See docs/ray-runtime.md, "Engine actors".

    engines = start_engines(group, layout, runtime_spec.engines)     # one EngineSpec per engine slot
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from rstar2_core import storage
from rstar2_core.rollout.types import GenerationOutput, SamplingParams
from rstar2_core.runtime.engine_builder import EngineFault, EngineSpec, build_engine, engine_busy_seconds
from rstar2_core.runtime.layout import ENGINE_ACTOR_CPUS, ClusterLayout, EngineSlot
from rstar2_core.runtime.ray.errors import ActorFailure, ray_actor_deaths
from rstar2_core.runtime.ray.placement import ActorGroup, bundle_strategy

_ACTOR_DEATHS = ray_actor_deaths()   # the one list: runtime/ray/errors.py

VISIBLE_DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
"""What an actor with `num_gpus: 0` inherits from Ray that would hide the GPUs from vLLM's Ray executor."""


def clear_visible_devices(spec: EngineSpec | None, environ: dict | None = None) -> list[str]:
    """Drop the visible-device variables in an engine actor whose TP workers vLLM places with its own Ray
    executor (`distributed_executor_backend="ray"`, the actor itself holds no GPU): whatever they say here
    (empty, where Ray sets them for an actor with no GPU: older Ray, or RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO;
    or what the node set) is not this engine's GPUs, and vLLM would plan its workers on it (vLLM's
    examples/rl clear them the same way). The workers are separate Ray actors: they inherit the node's
    variables, not these, and vLLM binds each to the GPU it took from their Ray ids (docs/ray-runtime.md,
    "Devices by identity"). Returns the names removed."""
    env = os.environ if environ is None else environ
    if spec is None or spec.distributed_executor_backend != "ray":
        return []
    return [k for k in VISIBLE_DEVICE_VARS if env.pop(k, None) is not None]


def bind_engine(spec: EngineSpec | None):
    """On real GPUs, an engine with TP 1 narrows its visibility variables to the GPU Ray assigned it, so
    that the engine's device 0 is that GPU (runtime/ray/device_binding.py; returns the `DeviceBinding`).
    None elsewhere: CPU and logical-GPU engines, and TP > 1 engines, whose workers vLLM's Ray executor binds."""
    if spec is None or spec.device != "cuda" or spec.distributed_executor_backend == "ray":
        return None
    from rstar2_core.runtime.ray.device_binding import bind_engine_device

    return bind_engine_device()


def set_torch_threads(threads: int) -> None:
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


class EngineActor:
    """Ray actor around one `Engine` (the async methods make it an async actor: requests interleave).
    `factory` replaces `build_engine(spec)` (tests pass a fake engine)."""

    def __init__(self, spec: EngineSpec | None, threads: int = 0, factory: Callable[[], Any] | None = None,
                 storage_s3: dict | None = None):
        if storage_s3:
            storage.configure_s3(**storage_s3)      # the driver's S3 endpoint: the engine loads its checkpoint
        set_torch_threads(threads)
        clear_visible_devices(spec)
        self.binding = bind_engine(spec)
        self.engine = factory() if factory is not None else build_engine(spec)
        self._fail = False

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        if self._fail:
            raise EngineFault("engine-errors fault: this engine fails every request (RSTAR2_FAULT_INJECT)")
        return await self.engine.generate(prompt_ids, params)

    def fail_requests(self, on: bool = True) -> None:
        self._fail = on

    def load_stale_weights(self, state_dict: dict[str, Any]) -> None:
        """The `stale-weights` fault: load `state_dict` moved by noise (rstar2_core.faults.stale_weights)."""
        from rstar2_core.faults import stale_weights

        self.engine.update_weights(stale_weights(state_dict))

    def kv_capacity_tokens(self) -> int:
        return int(self.engine.kv_capacity_tokens())

    def kv_tokens_per_sequence(self) -> int:
        return int(getattr(self.engine, "kv_tokens_per_sequence", lambda: 0)())

    def busy_seconds(self) -> float:
        return engine_busy_seconds(self.engine)

    def update_weights(self, weights: dict[str, Any] | str) -> float:
        """Load new weights (a state dict resolved from the object store, or a checkpoint URI); seconds."""
        t0 = time.perf_counter()
        self.engine.update_weights(weights)
        return time.perf_counter() - t0

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call an engine method by name (the vLLM weight-transfer and sleep/wake calls)."""
        return getattr(self.engine, method)(*args, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def device_reports(self, name: str) -> list:
        """The devices this engine computes on, by identity (runtime/ray/device_check.py); real GPUs only."""
        from rstar2_core.runtime.ray.device_binding import engine_reports

        return engine_reports(name, self.engine)

    async def close(self) -> None:
        await self.engine.close()


class RemoteEngine:
    """Driver-side `Engine` over an `EngineActor` handle; `tp` = GPUs the engine spans; `on_failure()` runs
    before an actor death is raised as `ActorFailure` (the group's shutdown)."""

    def __init__(self, handle: Any, name: str, tp: int = 1,
                 on_failure: Callable[[str, BaseException], BaseException] | None = None):
        self.handle, self.name, self.tp = handle, name, tp
        self.on_failure = on_failure
        self._capacity: int | None = None
        self._per_seq: int | None = None

    def _fail(self, e: BaseException) -> BaseException:
        if self.on_failure is not None:
            return self.on_failure(self.name, e)
        return ActorFailure(self.name, e)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        try:
            return await self.handle.generate.remote(list(prompt_ids), params)
        except _ACTOR_DEATHS as e:
            raise self._fail(e) from e

    def get(self, ref: Any) -> Any:
        try:
            return ray.get(ref)
        except _ACTOR_DEATHS as e:
            raise self._fail(e) from e

    def kv_capacity_tokens(self) -> int:
        if self._capacity is None:
            self._capacity = self.get(self.handle.kv_capacity_tokens.remote())
        return self._capacity

    def kv_tokens_per_sequence(self) -> int:
        if self._per_seq is None:
            self._per_seq = self.get(self.handle.kv_tokens_per_sequence.remote())
        return self._per_seq

    def update_weights(self, weights: dict[str, Any] | str) -> None:
        self.get(self.handle.update_weights.remote(weights))

    async def close(self, timeout_s: float | None = None) -> None:
        """Shut the engine down (vLLM stops its workers); `TimeoutError` after `timeout_s` (None:
        `CLOSE_TIMEOUT_S`) when the actor does not answer."""
        try:
            await asyncio.wait_for(self.handle.close.remote(), CLOSE_TIMEOUT_S if timeout_s is None else timeout_s)
        except _ACTOR_DEATHS:
            pass  # already gone: nothing to close


CLOSE_TIMEOUT_S = 30.0
"""Seconds `RemoteEngine.close` waits for an engine (`RayRuntime.aclose` closes them all at once, then kills
every actor in any case): an engine stuck in a call that never returns, e.g. in the NCCL weight transfer
of a peer that died, never answers. As long as the sandbox pool's close waits for its actors."""


INSECURE_SERIALIZATION_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
"""Set on engine actors with `rollout.weight_sync = "ipc"` (see `engine_actor_options`)."""


def engine_actor_options(slot: EngineSlot, pg: Any | None, weight_transfer: str | None = None) -> dict[str, Any]:
    """Ray actor options for one engine slot (see the module docstring).

    `weight_transfer = "ipc"` adds `VLLM_ALLOW_INSECURE_SERIALIZATION=1` to the actor's environment (its
    engine-core process and vLLM's TP workers inherit it): the IPC update info holds
    `torch.multiprocessing.reductions.reduce_tensor` handles, which vLLM's msgpack encoder refuses unless
    that variable lets it fall back to pickle (vLLM's examples/rl/rlhf_ipc.py sets it, "needed for ipc
    handle serialization"). Trade-off: those engine processes then also unpickle what reaches their
    internal sockets, so anyone who can write to them can run code; acceptable on the cluster's
    isolated network, and only the `ipc` engines get it."""
    env = dict(INSECURE_SERIALIZATION_ENV) if weight_transfer == "ipc" else {}
    if slot.tp > 1:
        env.update({"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, slot.bundle_indices)),
                    "VLLM_RAY_PER_WORKER_GPUS": f"{slot.gpu_fraction:g}"})
        return {"num_cpus": ENGINE_ACTOR_CPUS, "num_gpus": 0, "runtime_env": {"env_vars": env},
                **bundle_strategy(pg, slot.bundle_indices[0])}
    first = slot.bundle_indices[0] if slot.bundle_indices else -1
    opts = {"num_cpus": ENGINE_ACTOR_CPUS if first >= 0 else 0, "num_gpus": slot.gpu_fraction, **bundle_strategy(pg, first)}
    if env:
        opts["runtime_env"] = {"env_vars": env}
    return opts


def start_engines(group: ActorGroup, layout: ClusterLayout, specs: Sequence[EngineSpec] | None = None, *,
                  threads: int = 0, factory: Callable[[int], Callable[[], Any]] | None = None,
                  ready_timeout_s: float | None = None) -> list[RemoteEngine]:
    """One `EngineActor` per engine slot of `layout` (slot i builds `specs[i]`), in `group`; waits until
    every engine is built, at most `ready_timeout_s` (then `ActorStartTimeout` naming the engines still
    pending, retryable). `factory(i)` overrides how engine i is built (tests use a fake engine)."""
    if (specs is None) == (factory is None):
        raise ValueError("start_engines needs exactly one of specs= or factory=")
    if specs is not None and len(specs) != len(layout.engines):
        raise ValueError(f"{len(specs)} engine specs for the layout's {len(layout.engines)} engine slots")
    names, out = [], []
    for slot in layout.engines:
        name = f"engine-{slot.index}"
        if factory is not None:
            args = (None, threads, factory(slot.index))
        else:
            args = (specs[slot.index].for_actor(layout.device, tp_over_ray=slot.tp > 1), threads, None,
                    storage.s3_settings())
        opts = engine_actor_options(slot, group.pg(slot.node), specs[0].weight_transfer if specs else None)
        handle = group.spawn(name, EngineActor, *args, **opts)
        names.append(name)
        out.append(RemoteEngine(handle, name, slot.tp, on_failure=group.failure))
    group.wait_ready(names, ready_timeout_s, "engine actors")
    return out
