"""The cluster's device check: every GPU actor reports its device by identity (UUID, PCI address) and its
Ray GPU id; `runtime/devices.device_conflicts` refuses two actors Ray gave different GPUs on one device,
or one Ray GPU on two devices (a colocated trainer rank and engine share their id), and `memory_shortfalls`
a device with less memory than `cluster.gpu_memory_gb`, which the memory plan assumed.

`check_runtime_devices` runs in `RayRuntime`'s start-up once trainer shards and engines are built
(`DeviceConflict`, not retried). `live_device_check` serves `rstar2 plan --address`: it places the layout's
groups for a moment with two half-GPU probes per GPU bundle, one masked by Ray and one with every
`RAY_EXPERIMENTAL_NOSET_*` set (as vLLM starts its TP workers); trade-off: it takes the GPUs for seconds,
so it runs only when they are free now, and says why it skipped otherwise. See docs/ray-runtime.md.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from typing import Any

import ray

from rstar2_core.runtime.devices import (
    NOSET_VARS,
    DeviceReport,
    DeviceResolutionError,
    check_devices,
    device_conflicts,
    memory_shortfalls,
    resolve_device,
)
from rstar2_core.runtime.layout import ClusterLayout, NodeResources, fit_layout
from rstar2_core.runtime.ray.errors import ActorFailure, LayoutDoesNotFit, PlacementTimeout
from rstar2_core.runtime.ray.placement import ActorGroup, bundle_strategy

PROBE_TIMEOUT_S = 120.0
"""Seconds `live_device_check` waits for the layout's placement groups and then for its probes."""
_NOSET_ALL = {v: "1" for v in NOSET_VARS.values()}


def runtime_device_reports(group: ActorGroup, trainer: Any | None, engines: Sequence[Any]) -> list[DeviceReport]:
    """Each trainer shard's and each engine's devices (`DeviceReport`s), asked through the group (an actor
    death surfaces as the group's failure)."""
    refs, names = [], []
    if trainer is not None:
        for rank, name in enumerate(trainer.names):
            refs.append(trainer.actor(rank).device_report.remote(name))
            names.append(name)
    for e in engines:
        refs.append(e.handle.device_reports.remote(e.name))
        names.append(e.name)
    out: list[DeviceReport] = []
    for got in group.get(refs, names):
        out.extend(got if isinstance(got, list) else [got])
    return out


def check_runtime_devices(group: ActorGroup, trainer: Any | None, engines: Sequence[Any],
                          planned_gib: float | None = None) -> list[DeviceReport]:
    """The stage's device reports, after refusing any conflict or a device smaller than `planned_gib`
    (`cluster.gpu_memory_gb`; `DeviceConflict`, see the module docstring)."""
    reports = runtime_device_reports(group, trainer, engines)
    check_devices(reports, planned_gib)
    return reports


@ray.remote(num_cpus=0)
class DeviceProbe:
    """A short-lived actor on half a GPU bundle that resolves its device the way the stage's actors do."""

    def report(self, name: str) -> tuple[str, Any]:
        """("ok", (DeviceReport, how it was resolved)) | ("no-device", text) | ("error", text)."""
        import torch

        from rstar2_core.runtime.ray.device_binding import local_report, node_label, ray_gpu_ids

        if not torch.cuda.is_available():
            return "no-device", f"{name} on {node_label()}: torch sees no GPU"
        try:
            b = resolve_device(ray_gpu_ids(), os.environ, torch.cuda.device_count(), rocm=torch.version.hip is not None)
            return "ok", (local_report(name, b.index), b.reason)
        except DeviceResolutionError as e:
            return "error", f"{name} on {node_label()}: {e}"


def probe_devices(layout: ClusterLayout, timeout_s: float = PROBE_TIMEOUT_S,
                  planned_gib: float | None = None) -> tuple[list[str], list[str]]:
    """(lines, problems) of probing every GPU bundle of `layout` on the connected cluster (see the module
    docstring); the placement groups and probes are removed before it returns. Raises `LayoutDoesNotFit` /
    `PlacementTimeout` when the groups cannot be placed."""
    group = ActorGroup(layout, timeout_s=timeout_s, prefix=f"rstar2-devcheck-{uuid.uuid4().hex[:6]}-")
    try:
        names, refs = [], []
        for spec in layout.placement_groups:
            for b, bundle in enumerate(spec.bundles):
                if bundle.role != "gpu":
                    continue
                for kind, env in (("ray", None), ("noset", _NOSET_ALL)):
                    name = f"node{spec.node}/gpu{b}/{kind}"
                    opts: dict[str, Any] = {"num_gpus": 0.5, **bundle_strategy(group.pg(spec.node), b)}
                    if env:
                        opts["runtime_env"] = {"env_vars": env}
                    refs.append(group.spawn(name, DeviceProbe, **opts).report.remote(name))
                    names.append(name)
        results = group.get(refs, names, timeout=timeout_s)
    finally:
        group.shutdown()
    return _summarise(results, layout, planned_gib)


def _summarise(results: list[tuple[str, Any]], layout: ClusterLayout,
               planned_gib: float | None = None) -> tuple[list[str], list[str]]:
    """(lines, problems) from the probes' answers (pure); `planned_gib`: `cluster.gpu_memory_gb`."""
    ok = [v for k, v in results if k == "ok"]
    blind = [v for k, v in results if k == "no-device"]
    errors = [v for k, v in results if k == "error"]
    if blind and not ok and not errors:
        return ([(f"device check skipped: none of the {len(blind)} probes on the layout's GPU bundles sees a GPU (the "
                 "cluster's GPUs are logical Ray resources)")],
                [("the profile computes on real GPUs (cluster.logical_gpus = false) but no probe on a GPU bundle sees a "
                 "device: set cluster.logical_gpus = true for this cluster, or run on GPU nodes")])
    reports = [r for r, _ in ok]
    problems = (errors + [f"{b}, although Ray gave it a GPU" for b in blind] + device_conflicts(reports)
                + memory_shortfalls(reports, planned_gib))
    by_node: dict[str, set[str]] = {}
    for r in reports:
        by_node.setdefault(r.node, set()).add(r.device)
    gpus = sum(1 for pg in layout.placement_groups for b in pg.bundles if b.role == "gpu")
    lines = [f"device check: {len(results)} probes on {gpus} GPU bundle(s), as Ray sets them up and with "
             f"RAY_EXPERIMENTAL_NOSET_* set (vLLM's TP workers): "
             + ("each bound the device Ray assigned" if not problems else f"{len(problems)} problem(s)")]
    lines += [f"  {node}: {len(devices)} distinct device(s)" for node, devices in sorted(by_node.items())]
    return lines, problems


def live_device_check(address: str, layout: ClusterLayout, nodes: list[NodeResources],
                      timeout_s: float = PROBE_TIMEOUT_S, planned_gib: float | None = None) -> tuple[list[str], list[str]]:
    """(lines, problems) of the device check on the live cluster at `address` (`rstar2 plan --address`),
    or one line saying why it was skipped (see the module docstring). `planned_gib`: `cluster.gpu_memory_gb`,
    compared with each probed device's memory."""
    if layout.device != "cuda":
        return [("device check skipped: the layout computes on the CPU (no GPUs, or cluster.logical_gpus): no actor "
                "binds a GPU")], []
    if not any(n.total.get("GPU", 0) for n in nodes):
        return ["device check skipped: no live node offers GPUs"], []
    if not fit_layout(layout, nodes, free_only=True).fits:
        return ["device check skipped: it places the layout's GPU bundles, and they do not fit what is free now"], []
    from rstar2_core.runtime.ray.connect import driver_connection

    with driver_connection(address):
        try:
            return probe_devices(layout, timeout_s, planned_gib)
        except (LayoutDoesNotFit, PlacementTimeout) as e:
            return [(f"device check skipped: the layout's placement groups were not placed ({type(e).__name__}: "
                    f"{str(e)[:200]})")], []
        except ray.exceptions.GetTimeoutError:
            return [f"device check skipped: the probes did not answer within {timeout_s:.0f} s"], []
        except ActorFailure as e:
            return ["device check failed: a probe died"], [f"device check: {e}"]

