"""Inference engines as Ray actors, with trainer -> engine weight sync after every RL step.

- `EngineActor(factory)`: a Ray actor (async: many `generate` calls in flight) holding one engine from
  `rstar2_core.rollout` (`HFEngine`, or the vLLM adapter `VLLMEngine`) built *inside* the actor by a
  zero-argument factory (`engine_factory(spec)`), so GPU state never crosses processes.
- `RemoteEngine(handle)`: the driver-side proxy; it implements the `Engine` protocol
  (rollout/types.py), so `rollout_groups(engines=[RemoteEngine, ...])` schedules over the cluster
  unchanged. An actor death surfaces as `ActorFailure` (retryable, errors.py).
- `engine_actor_options(slot, pg, spec)`: Ray options for one `EngineSlot` of the layout (layout.py).
  TP = 1: the actor takes `slot.gpu_fraction` of its bundle's GPU (0.5 when colocated with a trainer
  shard, which pins both to the same device). TP > 1: the actor takes no GPU and vLLM's Ray executor
  (`distributed_executor_backend="ray"`) starts one worker per TP rank on the slot's bundles of the
  same placement group (`VLLM_RAY_BUNDLE_INDICES`, `VLLM_RAY_PER_WORKER_GPUS`, captured child tasks).
- `sync_weights(engines, weights)`: pushes new policy weights, per `rollout.weight_sync`:
  * `state_dict`: the trainer's full state dict is put in the Ray object store **once** and every
    engine actor receives the same object reference; Ray moves it once per node (not per engine) and
    each engine copies it host -> device and loads it (`Engine.update_weights`). Cost for Qwen3-14B in
    bf16 (~29.5 GB): one `ray.put` (~29.5 GB written to the head's shared memory, seconds), one
    transfer per node (8 x 29.5 GB over the interconnect, ~1.5 s each at 200 Gb/s, in parallel), and
    per engine a host read + H2D copy (~1-2 s at PCIe/Infinity-Fabric rates); vLLM reshards for TP in
    `load_weights`. The object store must hold one copy per node (size object_store_memory for it).
  * `checkpoint`: engines reload the checkpoint URI the trainer just published (`_COMPLETE` marker
    required): nothing goes through Ray, but each engine reads the whole checkpoint (32 engines x
    29.5 GB from S3 per step: use a node-local or shared file system for this mode).
  * Not implemented (the faster path for 14B colocated): NCCL/RCCL broadcast from trainer rank 0 over
    a process group joined by the engines' TP workers, or CUDA IPC handles between colocated
    processes (what verl and OpenRLHF do): no host copy, ~0.1-0.3 s per update on MI300X/H100 links.
  The measured cost of a sync is returned (`WeightSyncReport`), for `rollout/weight_sync_s`.

Colocated engines must free GPU memory while the trainer steps: `EngineActor.release_memory()` /
`resume()` call the engine's `sleep()` / `wake_up()` when it has them (vLLM's sleep mode), else they
report that nothing was released.

    with ActorGroup(layout) as group:
        engines = start_engines(group, layout, spec)
        groups = await rollout_groups(engines, sandbox, chat, problems, n=32, limits=limits)
        report = sync_weights(engines, backend_state_dict, mode=cfg.rollout.weight_sync)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

import ray

from rstar2_core.cluster.errors import ActorFailure
from rstar2_core.cluster.layout import ClusterLayout, EngineSlot
from rstar2_core.cluster.placement import _ACTOR_DEATHS, ActorGroup, bundle_strategy
from rstar2_core.rollout.types import GenerationOutput, SamplingParams


@dataclass(frozen=True)
class EngineSpec:
    """What an engine actor builds: engine kind, checkpoint, and its sizing (from `cfg.rollout`)."""

    kind: Literal["hf", "vllm"]
    checkpoint_url: str
    max_model_len: int
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    max_batch_size: int = 64
    kv_capacity_tokens: int | None = None
    dtype: str = "bfloat16"
    device: str = "cuda"
    seed: int = 0

    @classmethod
    def from_config(cls, cfg: Any, checkpoint_url: str, max_model_len: int, device: str = "cuda") -> EngineSpec:
        ro = cfg.rollout
        return cls(ro.engine, checkpoint_url, max_model_len, ro.tensor_parallel_size, ro.gpu_memory_utilization,
                   ro.max_batch_size, ro.kv_capacity_tokens or None, cfg.model.dtype, device, cfg.rl.seed)


def build_engine(spec: EngineSpec):
    """Build the engine of `spec` in this process (called inside the actor)."""
    if spec.kind == "hf":
        import torch

        from rstar2_core.models.io import load_model_and_tokenizer
        from rstar2_core.rollout.hf_engine import HFEngine

        model, tok = load_model_and_tokenizer(spec.checkpoint_url, dtype=getattr(torch, spec.dtype),
                                              device=spec.device)
        return HFEngine(model, tok, max_batch_size=spec.max_batch_size, device=spec.device,
                        max_seq_len=spec.max_model_len, kv_capacity_tokens=spec.kv_capacity_tokens)
    if spec.kind == "vllm":
        from rstar2_core.rollout.vllm_engine import VLLMEngine

        extra = {"distributed_executor_backend": "ray"} if spec.tensor_parallel_size > 1 else {}
        return VLLMEngine(spec.checkpoint_url, max_model_len=spec.max_model_len,
                          tensor_parallel_size=spec.tensor_parallel_size,
                          gpu_memory_utilization=spec.gpu_memory_utilization, dtype=spec.dtype, seed=spec.seed,
                          kv_capacity_tokens=spec.kv_capacity_tokens, **extra)
    raise ValueError(f"unknown engine kind {spec.kind!r}; valid: ['hf', 'vllm']")


def engine_factory(spec: EngineSpec, index: int = 0) -> Callable[[], Any]:
    """Zero-argument factory for an actor; each engine gets its own sampling seed."""
    return partial(build_engine, replace(spec, seed=spec.seed + index))


class EngineActor:
    """Ray actor around one `Engine` (the async methods make it an async actor: requests interleave)."""

    def __init__(self, factory: Callable[[], Any]):
        self.engine = factory()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        return await self.engine.generate(prompt_ids, params)

    def kv_capacity_tokens(self) -> int:
        return int(self.engine.kv_capacity_tokens())

    def kv_tokens_per_sequence(self) -> int:
        return int(getattr(self.engine, "kv_tokens_per_sequence", lambda: 0)())

    def update_weights(self, weights: dict[str, Any] | str) -> float:
        """Load new weights (a state dict resolved from the object store, or a checkpoint URI); seconds."""
        t0 = time.perf_counter()
        self.engine.update_weights(weights)
        return time.perf_counter() - t0

    def release_memory(self) -> bool:
        if hasattr(self.engine, "sleep"):
            self.engine.sleep()
            return True
        return False

    def resume(self) -> bool:
        if hasattr(self.engine, "wake_up"):
            self.engine.wake_up()
            return True
        return False

    def pid(self) -> int:
        return os.getpid()

    async def close(self) -> None:
        await self.engine.close()


class RemoteEngine:
    """Driver-side `Engine` over an `EngineActor` handle."""

    def __init__(self, handle: Any, name: str):
        self.handle, self.name = handle, name
        self._capacity: int | None = None
        self._per_seq: int | None = None

    def _fail(self, e: BaseException) -> ActorFailure:
        return ActorFailure(self.name, e)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        try:
            return await self.handle.generate.remote(list(prompt_ids), params)
        except _ACTOR_DEATHS as e:
            raise self._fail(e) from e

    def _get(self, ref: Any) -> Any:
        try:
            return ray.get(ref)
        except _ACTOR_DEATHS as e:
            raise self._fail(e) from e

    def kv_capacity_tokens(self) -> int:
        if self._capacity is None:
            self._capacity = self._get(self.handle.kv_capacity_tokens.remote())
        return self._capacity

    def kv_tokens_per_sequence(self) -> int:
        if self._per_seq is None:
            self._per_seq = self._get(self.handle.kv_tokens_per_sequence.remote())
        return self._per_seq

    def update_weights(self, weights: dict[str, Any] | str) -> None:
        self._get(self.handle.update_weights.remote(weights))

    async def close(self) -> None:
        try:
            await self.handle.close.remote()
        except _ACTOR_DEATHS:
            pass  # already gone: nothing to close


def engine_actor_options(slot: EngineSlot, pg: Any | None) -> dict[str, Any]:
    """Ray actor options for one engine slot (see the module docstring)."""
    if slot.tp > 1:
        env = {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, slot.bundle_indices)),
               "VLLM_RAY_PER_WORKER_GPUS": f"{slot.gpu_fraction:g}"}
        return {"num_cpus": 1, "num_gpus": 0, "runtime_env": {"env_vars": env},
                **bundle_strategy(pg, slot.bundle_indices[0])}
    first = slot.bundle_indices[0] if slot.bundle_indices else -1
    return {"num_cpus": 1 if first >= 0 else 0, "num_gpus": slot.gpu_fraction, **bundle_strategy(pg, first)}


def start_engines(group: ActorGroup, layout: ClusterLayout, spec: EngineSpec | None = None, *,
                  factory: Callable[[int], Callable[[], Any]] | None = None) -> list[RemoteEngine]:
    """One `EngineActor` per engine slot of `layout`, in `group`; waits until every engine is built.
    `factory(i)` overrides how engine i is built (tests use a fake engine)."""
    if (spec is None) == (factory is None):
        raise ValueError("start_engines needs exactly one of spec= or factory=")
    names, out = [], []
    for slot in layout.engines:
        name = f"engine-{slot.index}"
        make = factory(slot.index) if factory is not None else engine_factory(spec, slot.index)
        handle = group.spawn(name, EngineActor, make, **engine_actor_options(slot, group.pg(slot.node)))
        names.append(name)
        out.append(RemoteEngine(handle, name))
    group.get([group.actors[n].__ray_ready__.remote() for n in names], names)
    return out


@dataclass(frozen=True)
class WeightSyncReport:
    mode: str
    bytes: int
    seconds: float
    engine_seconds: tuple[float, ...]

    def metrics(self) -> dict[str, float]:
        return {"rollout/weight_sync_s": self.seconds, "rollout/weight_sync_gb": self.bytes / 1e9,
                "rollout/weight_sync_engine_max_s": max(self.engine_seconds, default=0.0)}


def _nbytes(state: dict[str, Any]) -> int:
    return int(sum(t.numel() * t.element_size() for t in state.values() if hasattr(t, "element_size")))


def sync_weights(engines: list[RemoteEngine], weights: Any,
                 mode: Literal["state_dict", "checkpoint"] = "state_dict") -> WeightSyncReport:
    """Push new weights to every engine and wait (no request may be in flight). `weights` is, for mode
    state_dict, a CPU state dict or `(ObjectRef, bytes)` from `TrainerGroup.weights_ref()`; for mode
    checkpoint, the URI of a complete checkpoint."""
    if mode == "state_dict" and isinstance(weights, tuple) and len(weights) == 2 \
            and isinstance(weights[0], ray.ObjectRef):
        payload, size = weights
    elif mode == "state_dict":
        if not isinstance(weights, dict):
            raise ValueError("rollout.weight_sync = \"state_dict\" needs a state dict; pass backend.model's "
                             "state_dict() (CPU tensors) or use weight_sync = \"checkpoint\" with a URI")
        payload, size = ray.put(weights), _nbytes(weights)   # one copy in the object store for all engines
    elif mode == "checkpoint":
        if not isinstance(weights, str):
            raise ValueError("rollout.weight_sync = \"checkpoint\" needs the URI of a complete checkpoint")
        payload, size = weights, 0
    else:
        raise ValueError(f"unknown weight_sync mode {mode!r}; valid: ['state_dict', 'checkpoint']")
    t0 = time.perf_counter()
    refs = [e.handle.update_weights.remote(payload) for e in engines]
    secs = []
    for e, ref in zip(engines, refs):
        secs.append(e._get(ref))
    return WeightSyncReport(mode, size, time.perf_counter() - t0, tuple(secs))
