"""Inside a GPU actor: bind the device Ray assigned it (runtime/devices.py resolves which) and report it by
identity for the start-up check (runtime/ray/device_check.py). A trainer shard calls
`torch.cuda.set_device`; an engine with TP 1 narrows its visibility variables before the engine is built
(vLLM builds on device 0 of the engine-core process it starts, which inherits them); an engine with
TP > 1 leaves its workers to vLLM's Ray executor, which binds them by their Ray ids the same way. Only
where the layout computes on real GPUs (`layout.device == "cuda"`). See docs/ray-runtime.md, "Devices by
identity".
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from types import SimpleNamespace
from typing import Any

import ray

from rstar2_core.runtime.devices import (
    DeviceBinding,
    DeviceReport,
    consistent_visibility,
    device_identity,
    narrowed_visibility,
    resolve_device,
)


def ray_gpu_ids() -> list[str]:
    """The GPU ids Ray assigned this actor (one for a whole GPU or a share of one)."""
    return [str(x) for x in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def node_label() -> str:
    """This actor's node as the device check names it: `node <id8> (<ip>)`."""
    return f"node {ray.get_runtime_context().get_node_id()[:8]} ({ray.util.get_node_ip_address()})"


def _rocm() -> bool:
    import torch

    return torch.version.hip is not None


def bind_trainer_device(environ: MutableMapping[str, str] | None = None) -> DeviceBinding:
    """Resolve this trainer shard's device and make it torch's current device; on ROCm first keep
    `CUDA_VISIBLE_DEVICES` equal to HIP's list (`consistent_visibility`), before the runtime reads them."""
    import torch

    env = os.environ if environ is None else environ
    rocm = _rocm()
    env.update(consistent_visibility(env, rocm=rocm))     # before the GPU runtime reads them
    binding = resolve_device(ray_gpu_ids(), env, torch.cuda.device_count(), rocm=rocm)
    torch.cuda.set_device(binding.index)
    return binding


def bind_engine_device(environ: MutableMapping[str, str] | None = None) -> DeviceBinding:
    """Narrow this engine actor's visibility variables to the GPU Ray assigned it (TP 1), so that the
    engine's device 0 is that GPU. Chosen over passing an index: vLLM 0.32 with TP 1 builds on local rank
    0 of the engine-core process it starts itself, and what that process inherits is ours to set. No
    device is counted first: that could start the GPU runtime here, after which this process would ignore
    a narrowed variable (the HF engine builds in this process). Returns the binding before narrowing."""
    env = os.environ if environ is None else environ
    rocm = _rocm()
    binding = resolve_device(ray_gpu_ids(), env, None, rocm=rocm)
    env.update(narrowed_visibility(binding, rocm=rocm))
    return binding


def local_report(actor: str, index: int, ray_gpu: str | None = None) -> DeviceReport:
    """This process's device `index` by identity, with this actor's node and Ray GPU id."""
    import torch

    ids = ray_gpu_ids()
    gpu = ray_gpu if ray_gpu is not None else (ids[0] if ids else "none")
    props = torch.cuda.get_device_properties(index)
    return DeviceReport(actor, node_label(), gpu, device_identity(props), _gib(props.total_memory))


def _gib(total_memory: int | None) -> float | None:
    return total_memory / 2**30 if total_memory else None


def engine_reports(actor: str, engine: Any) -> list[DeviceReport]:
    """The devices an engine actor's engine computes on: each vLLM worker's (`worker_devices`: plain
    device properties, since rollout/ cannot import this package). TP 1: its one worker in the engine-core
    process, with this actor's Ray GPU; TP > 1: `<actor>/tp<i>` with the GPU vLLM took for it from its
    workers' Ray ids (their node is this actor's: an engine's bundles are on one node). Else this process's
    current device (the HF engine)."""
    workers = getattr(engine, "worker_devices", None)
    if workers is None:
        import torch

        return [local_report(actor, torch.cuda.current_device())]
    found = workers()
    ids, node = ray_gpu_ids(), node_label()
    if len(found) == 1:
        return [DeviceReport(actor, node, ids[0] if ids else "none", device_identity(SimpleNamespace(**found[0])),
                             _gib(found[0].get("total_memory")))]
    return [DeviceReport(f"{actor}/tp{i}", node, str(w["ray_gpu"]) if w.get("ray_gpu") is not None else f"?{i}",
                         device_identity(SimpleNamespace(**w)), _gib(w.get("total_memory"))) for i, w in enumerate(found)]
