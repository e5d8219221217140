"""Ray dispatch of stage tasks: the runner built from the config starts a local Ray (no dashboard, short
temp dir), tasks run in Ray worker processes with the resources of `cfg.cluster.resources.<kind>`,
compute with as many torch threads as the CPUs they reserve (also in a worker Ray reuses across task
sizes), and see the flow process's state settings."""

from __future__ import annotations

import os

import pytest
from prefect import flow, task

from rstar2_core.config import load_config
from tasks.runners import placement, task_runner, use_task_threads


@task
def where(cfg, kind: str) -> dict:
    import ray
    import torch

    use_task_threads(cfg, kind)
    return {"pid": os.getpid(), "home": os.environ.get("RSTAR2_HOME"), "threads": torch.get_num_threads(),
            "resources": ray.get_runtime_context().get_assigned_resources()}


@pytest.mark.slow
def test_tasks_run_on_ray_with_configured_resources(prefect_harness, tmp_path, monkeypatch):
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path))
    monkeypatch.setenv("RSTAR2_RAY_TMP", f"/tmp/rstar2-ray-test-{os.getpid()}")
    cfg = load_config("tiny", ["cluster.use_ray=true", "cluster.resources.rl.num_cpus=2",
                               "cluster.resources.eval.num_cpus=0.5"])

    @flow
    def probe() -> list[dict]:
        out = []
        for kind in ("eval", "rl", "eval"):  # one after the other: Ray may hand them the same worker
            with placement(cfg, kind):
                out.append(where.submit(cfg, kind).result())
        return out

    ev, rl, ev2 = probe.with_options(task_runner=task_runner(cfg))()
    assert rl["pid"] != os.getpid() and rl["home"] == str(tmp_path)
    assert rl["resources"] == {"CPU": 2.0} and ev["resources"] == {"CPU": 0.5}
    assert (ev["threads"], rl["threads"], ev2["threads"]) == (1, 2, 1)
