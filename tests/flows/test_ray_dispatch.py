"""Ray dispatch of stage tasks: tasks run in Ray worker processes with the resources of
`cfg.cluster.resources.<kind>`, compute with as many torch threads as the CPUs they reserve (also in a
worker Ray reuses across task sizes), and see the flow process's state settings; a stage task's error
reaches the flow as the project's own error, named in the flow run's message and classed by the retry
rule as in process. The module's flows share one local Ray started as the runner starts one."""

from __future__ import annotations

import os
import shutil

import pytest
import ray.exceptions as rex
from prefect import flow, task

from flows.full_recipe import _first_failure_or
from rstar2_core.config import load_config
from rstar2_core.errors import InfraFailureShareExceeded, StageTrainedNothing, StaleEngineWeights
from rstar2_core.runtime.ray.errors import ActorFailure
from tasks.retry import is_infrastructure_error
from tasks.runners import placement, ray_init_kwargs, task_runner, use_task_threads
from tasks.stages import _stage_task

RAY = ["cluster.use_ray=true", "cluster.resources.rl.num_cpus=2", "cluster.resources.eval.num_cpus=0.5"]


@pytest.fixture(scope="module")
def flow_ray(tmp_path_factory):
    """A local Ray started from this process as `task_runner(cfg)`'s RayTaskRunner starts one for a flow run
    (`ray_init_kwargs`: 2 CPUs, the runtime slot, no dashboard), with RSTAR2_HOME set to the folder it
    yields for the module's duration. The runner finds it running and uses it: one Ray start (seconds of
    the 2 cores) for the module instead of one per flow."""
    import ray

    home = tmp_path_factory.mktemp("ray-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RSTAR2_HOME", str(home))
        ray_tmp = f"/tmp/rstar2-ray-test-{os.getpid()}"
        mp.setenv("RSTAR2_RAY_TMP", ray_tmp)
        ray.init(**ray_init_kwargs(load_config("tiny", RAY).cluster))
        try:
            yield home
        finally:
            ray.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)


@task
def where(cfg, kind: str) -> dict:
    import ray
    import torch

    use_task_threads(cfg, kind)
    return {"pid": os.getpid(), "home": os.environ.get("RSTAR2_HOME"), "threads": torch.get_num_threads(),
            "resources": ray.get_runtime_context().get_assigned_resources(), "nice": os.nice(0)}


@pytest.mark.slow
def test_tasks_run_on_ray_with_configured_resources(prefect_harness, flow_ray):
    cfg = load_config("tiny", RAY)

    @flow
    def probe() -> list[dict]:
        out = []
        for kind in ("eval", "rl", "eval"):  # one after the other: Ray may hand them the same worker
            with placement(cfg, kind):
                out.append(where.submit(cfg, kind).result())
        return out

    ev, rl, ev2 = probe.with_options(task_runner=task_runner(cfg))()
    assert rl["pid"] != os.getpid() and rl["home"] == os.environ["RSTAR2_HOME"] == str(flow_ray)
    assert rl["resources"] == {"CPU": 2.0} and ev["resources"] == {"CPU": 0.5}
    assert (ev["threads"], rl["threads"], ev2["threads"]) == (1, 2, 1)
    # the stages compute at the flow's priority, not at Ray's default worker niceness of 15 (below every
    # service of a one-machine run: ray_init.WORKER_NICENESS)
    assert rl["nice"] == ev["nice"] == os.nice(0)


# What a stage raises (the messages abridged from where the core raises them).
STAGE_ERRORS = {
    "ActorFailure": lambda: ActorFailure("engine-0", rex.ActorDiedError()),
    "InfraFailureShareExceeded": lambda: InfraFailureShareExceeded(
        "75% of this step's trajectories failed for infrastructure reasons (engine errors 3)"),
    "StaleEngineWeights": lambda: StaleEngineWeights(
        "engine vs trainer log-prob gap 0.3100 per sampled token exceeds rl.max_engine_logprob_gap = 0.05"),
    "StageTrainedNothing": lambda: StageTrainedNothing(
        "RL stage 'rl-stage-1' ran its 3 steps without one optimizer step"),
}


@_stage_task(name="failing-stage")   # the stage tasks' own options (tasks/stages.py)
def failing_stage(error: str, label: str) -> None:
    raise STAGE_ERRORS[error]()


@pytest.mark.slow
@pytest.mark.parametrize("error", list(STAGE_ERRORS))
def test_a_stage_error_on_ray_reaches_the_flow_as_its_own_type(prefect_harness, flow_ray, error):
    cfg = load_config("tiny", RAY)
    original = STAGE_ERRORS[error]()

    @flow
    def stages() -> None:
        with placement(cfg, "rl"):
            fut = failing_stage.with_options(retries=0).submit(error, label=f"rl-stage-1 ({error})")
        return _first_failure_or(fut, [fut])   # how recipe_stages surfaces a failed task

    state = stages.with_options(task_runner=task_runner(cfg))(return_state=True)
    seen = state.result(raise_on_failure=False)
    assert state.is_failed() and f"{error}: {original}" in state.message, state.message
    assert type(seen) is type(original) and str(seen) == str(original)
    assert is_infrastructure_error(seen) == is_infrastructure_error(original) == (error != "StageTrainedNothing")
    if error == "ActorFailure":
        assert seen.actor == "engine-0" and type(seen.cause) is rex.ActorDiedError
