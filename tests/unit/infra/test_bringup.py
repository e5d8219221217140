"""`rstar2 deploy` (rstar2_cli/bringup.py) against a real Prefect server (the test harness): the pool gets
infra's base job template whether it did not exist or a worker created it first with Prefect's default
template, prefect.yaml's deployments land on it, a second run changes nothing, and what is not ours is
named."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from rstar2_cli.bringup import ROOT, TEMPLATE, BringupError, bring_up, deployment_specs, problems

pytestmark = pytest.mark.slow
OURS = json.loads(TEMPLATE.read_text())
NAMES = ("full-recipe", "evaluate", "nightly-eval")


@pytest.fixture(scope="module")
def api():
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield PREFECT_API_URL.value()


async def _pool(name: str):
    from prefect.client.orchestration import get_client

    async with get_client() as c:
        return await c.read_work_pool(name)


async def _deployment(name: str):
    from prefect.client.orchestration import get_client

    async with get_client() as c:
        return await c.read_deployment_by_name(f"rstar2/{name}")


def test_a_missing_pool_is_created_with_our_template_and_a_rerun_changes_nothing(api):
    first = bring_up(pool="rstar2-cluster", log=lambda m: None)
    assert first.pool_action == "created" and first.deployments == NAMES
    assert asyncio.run(_pool("rstar2-cluster")).base_job_template == OURS
    for name in NAMES:
        assert asyncio.run(_deployment(name)).work_pool_name == "rstar2-cluster"
    before = {n: asyncio.run(_deployment(n)) for n in NAMES}
    # the nightly evaluation's schedule, read back from the server as prefect.yaml writes it (the others have none)
    (nightly,) = before["nightly-eval"].schedules
    assert (nightly.schedule.cron, nightly.schedule.timezone, nightly.active) == ("0 3 * * *", "UTC", True)
    assert not before["full-recipe"].schedules and not before["evaluate"].schedules

    again = bring_up(pool="rstar2-cluster", log=lambda m: None)          # (c) the same command a second time
    assert again.pool_action == "unchanged" and again.deployments == NAMES
    assert asyncio.run(_pool("rstar2-cluster")).base_job_template == OURS
    for n in NAMES:                    # the same deployments (ids), on the same pool, with the same parameters
        after = asyncio.run(_deployment(n))
        assert (after.id, after.work_pool_name, after.parameters, after.entrypoint) == (
            before[n].id, before[n].work_pool_name, before[n].parameters, before[n].entrypoint)


def test_a_pool_a_worker_created_first_gets_our_template(api):
    """What the Ray head's `prefect-worker` container does when it starts before step 3: its first poll
    creates the pool with the process worker's default template (a real worker, one poll)."""
    from prefect.workers.process import ProcessWorker

    pool = "rstar2-worker-first"
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_WORKER_HEARTBEAT_SECONDS": "5"}
    subprocess.run([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process",
                    "--name", "rstar2-head", "--run-once"], env=env, check=True, capture_output=True, timeout=120)
    assert asyncio.run(_pool(pool)).base_job_template == ProcessWorker.get_default_base_job_template()

    report = bring_up(pool=pool, log=lambda m: None)
    assert report.pool_action == "updated"
    assert asyncio.run(_pool(pool)).base_job_template == OURS
    assert {asyncio.run(_deployment(n)).work_pool_name for n in NAMES} == {pool}
    assert bring_up(pool=pool, log=lambda m: None).pool_action == "unchanged"


def test_what_is_not_ours_is_named(api):
    """The read-back names a foreign template and deployments that differ from prefect.yaml (here: the
    earlier tests left them on another pool, or none exist yet)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    async def foreign_pool() -> None:
        async with get_client() as c:
            await c.create_work_pool(WorkPoolCreate(name="rstar2-foreign", type="process",
                                                    base_job_template=ProcessWorker.get_default_base_job_template()))

    asyncio.run(foreign_pool())
    specs = deployment_specs(ROOT / "prefect.yaml")
    found = asyncio.run(problems(OURS, specs, "rstar2-foreign"))
    assert any("base job template differs from ours in ['variables']" in p for p in found), found
    assert all(any(f"deployment {n!r}" in p for p in found) for n in NAMES), found


def test_no_api_or_a_silent_one_is_refused_at_once(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: None}), pytest.raises(BringupError, match="--api-url"):
        bring_up(log=lambda m: None)
    with pytest.raises(BringupError, match="did not answer /health within 2 s"):
        bring_up("http://127.0.0.1:9/api", health_timeout_s=2, log=lambda m: None)
