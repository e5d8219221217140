"""Where stage tasks run: a Ray cluster through prefect-ray's `RayTaskRunner`, or threads in the flow
process.

`cfg.cluster.use_ray` picks Ray; `cfg.cluster.ray_address` names an existing cluster, unset starts a local
Ray for the flow run. Per-task resources come from `cfg.cluster.resources[<kind>]` through prefect-ray's
`remote_options`; with `cluster.runtime = "ray"` the stage tasks also ask for the cluster's one
`rstar2_runtime` unit. Invariant: a stage task on Ray computes with as many torch threads as the CPUs it
reserves (`use_task_threads`), so tasks side by side split the cores instead of oversubscribing them.
See docs/pipeline.md, "Ray".
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

from rstar2_core.config import Config
from rstar2_core.config.pipeline_sections import TASK_KINDS
from rstar2_core.config.runtime_rules import runtime_tasks
from rstar2_core.runtime.ray.connect import RUNTIME_RESOURCE, ray_init_kwargs


def task_runner(cfg: Config):
    """The task runner for the recipe's stage tasks."""
    if not cfg.cluster.use_ray:
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=max(2, cfg.cluster.cpus_per_node))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from prefect_ray import RayTaskRunner

    return RayTaskRunner(address=cfg.cluster.ray_address, init_kwargs=ray_init_kwargs(cfg.cluster))


def resources(cfg: Config, kind: str) -> dict:
    """Ray remote options of one task kind: {"num_cpus": ..., "num_gpus": ...} (empty = Ray's default)."""
    if kind not in TASK_KINDS:
        raise ValueError(f"unknown task kind {kind!r}; cluster.resources keys are {list(TASK_KINDS)}")
    r = cfg.cluster.resources.get(kind)
    out: dict = {} if r is None else {"num_cpus": r.num_cpus}
    if r is not None and r.num_gpus:
        out["num_gpus"] = r.num_gpus
    if cfg.cluster.runtime == "ray" and kind in runtime_tasks(cfg):
        out["resources"] = {RUNTIME_RESOURCE: 1}   # one runtime-driving task at a time (rstar2_core/runtime/ray/connect.py)
    return out


@contextlib.contextmanager
def placement(cfg: Config, kind: str) -> Iterator[None]:
    """Submit the tasks inside this block with `kind`'s Ray resources (no-op without Ray)."""
    opts = resources(cfg, kind)
    if not cfg.cluster.use_ray or not opts:
        yield
        return
    from prefect_ray.context import remote_options

    with remote_options(**opts):
        yield


def task_threads(cfg: Config, kind: str) -> int | None:
    """torch intra-op threads of a stage task of `kind`: the CPUs it reserves on Ray, rounded down, at least
    1 (Ray's default reservation is 1 CPU); None without Ray, where the tasks share the flow process and
    its threads."""
    if not cfg.cluster.use_ray:
        return None
    r = cfg.cluster.resources.get(kind)
    return max(1, math.floor(r.num_cpus)) if r is not None else 1


def use_task_threads(cfg: Config, kind: str) -> None:
    """Set this process's torch intra-op threads to `task_threads(cfg, kind)` (no-op without Ray)."""
    n = task_threads(cfg, kind)
    if n is not None:
        import torch

        torch.set_num_threads(n)
