"""The nightly evaluation as production runs it: prefect.yaml's `nightly-eval` deployed, the Prefect server's
scheduler creates its next run from the deployment's schedule (03:00 UTC), and that scheduled run, brought
forward to now, is picked up by the worker and runs the flow to its end against a champion registered in
MLflow as an operator promotes one."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from deployment_services import E2E_OVERRIDES, ROOT

RSTAR2 = str(Path(sys.executable).with_name("rstar2"))


async def _scheduled_runs(deployment: str) -> tuple[object, list]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    async with get_client() as c:
        dep = await c.read_deployment_by_name(deployment)
        runs = await c.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.SCHEDULED]))))
        return dep, sorted(runs, key=lambda r: r.expected_start_time)


async def _start_now(flow_run_id) -> None:
    """The scheduled run's start brought forward to now (its state stays Scheduled: the worker's next poll
    takes it, as it takes it at 03:00)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    async with get_client() as c:
        await c.set_flow_run_state(flow_run_id, Scheduled(scheduled_time=datetime.now(UTC)), force=True)


async def _delete(deployment_id) -> None:
    from prefect.client.orchestration import get_client

    async with get_client() as c:
        await c.delete_deployment(deployment_id)


@pytest.mark.slow
def test_a_scheduled_nightly_run_goes_through_the_worker(stack, tmp_path):
    from flows.client import watch
    from rstar2_core.config import load_config
    from tasks import nightly, tracking
    from tasks.registry import _ensure_model

    # a champion to evaluate: a tiny checkpoint (`rstar2 model prepare`), promoted by hand as an operator would
    ckpt = tmp_path / "champion"
    p = subprocess.run([RSTAR2, "model", "prepare", "--profile", "tiny", "--out", str(ckpt)], env=stack.env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = load_config("tiny", E2E_OVERRIDES)
    c = tracking.client(cfg)
    name = cfg.tracking.registered_model
    _ensure_model(c, name)
    mv = c.create_model_version(name, source=ckpt.as_uri(), tags={"checkpoint_url": str(ckpt)})
    c.set_registered_model_alias(name, "champion", mv.version)

    # prefect.yaml's nightly-eval, with this stack's sizes as its parameters; its schedule is prefect.yaml's
    params = {"profile": "tiny", "overrides": E2E_OVERRIDES, "model": "champion", "benchmarks": None}
    subprocess.run([str(ROOT / ".venv/bin/prefect"), "--no-prompt", "deploy", "--name", "nightly-eval",
                    "--params", json.dumps(params)], cwd=ROOT, env={**stack.env, "RSTAR2_REPO": str(ROOT)},
                   check=True, timeout=300, capture_output=True)
    deadline = time.monotonic() + 240               # the scheduler's loop runs every 60 s
    dep, runs = asyncio.run(_scheduled_runs("rstar2/nightly-eval"))
    try:
        while not runs:
            assert time.monotonic() < deadline, "the server's scheduler created no run for nightly-eval"
            time.sleep(2)
            dep, runs = asyncio.run(_scheduled_runs("rstar2/nightly-eval"))
        first = runs[0]
        now = datetime.now(UTC)
        at = first.expected_start_time.astimezone(UTC)
        assert (at.hour, at.minute) == (3, 0) and now < at <= now + timedelta(days=1), at     # the next 03:00 UTC
        assert first.auto_scheduled and first.parameters == params, (first.auto_scheduled, first.parameters)

        asyncio.run(_start_now(first.id))
        state = asyncio.run(watch(first.id, timeout_s=900, quiet=True))
        assert state == "Completed", stack.worker_log()      # only the worker runs a deployment's scheduled run
        night = nightly.previous(cfg)                          # tonight's record, written by that flow run
        assert night is not None and night["flow_run_id"] == str(first.id), night
        assert str(night["version"]) == str(mv.version), night
    finally:
        asyncio.run(_delete(dep.id))                 # no nightly left to fire at 03:00 in a later test
