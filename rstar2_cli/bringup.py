"""The production Prefect side brought up as infra/README.md step 3 gives it, safe to rerun (`rstar2 deploy`).

    report = bring_up("http://prefect-server.rstar2.svc:4200/api")      # or PREFECT_API_URL's value

Order: wait for the API's /health -> the `rstar2-cluster` pool (type process) created with
infra/prefect/base-job-template.json, or the template of a pool that exists replaced by it (a worker creates
the pool on its first poll, with Prefect's default template unless given ours) -> prefect.yaml's
deployments, one `prefect deploy --name N --pool rstar2-cluster` each (`--all` ignores `--pool`) -> the
pool's template and the deployments read back from the server, `BringupError` naming what is not ours.
Invariant: a second run changes nothing and succeeds. See infra/README.md, step 3.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
POOL = "rstar2-cluster"
POOL_TYPE = "process"
TEMPLATE = ROOT / "infra" / "prefect" / "base-job-template.json"
HEALTH_TIMEOUT_S = 300.0
DEPLOY_TIMEOUT_S = 600.0
DEFAULT_HEARTBEAT_S = 30.0     # PREFECT_WORKER_HEARTBEAT_SECONDS's default: how often a worker re-reads its pool


class BringupError(RuntimeError):
    """The Prefect side is not as infra/ describes it after bring-up (or could not be brought up): the
    message names each difference and what to do."""


@dataclass(frozen=True)
class DeploymentSpec:
    """One deployment of prefect.yaml as the server must hold it (its anchors resolved)."""

    name: str
    entrypoint: str
    parameters: dict
    pull: list


@dataclass(frozen=True)
class BringupReport:
    """What `bring_up` did: `pool_action` is "created", "updated" (its template was replaced) or "unchanged"."""

    api_url: str
    pool_action: str
    deployments: tuple[str, ...]
    workers_online: tuple[str, ...]
    seconds: float


def deployment_specs(prefect_yaml: Path) -> list[DeploymentSpec]:
    """prefect.yaml's deployments, in file order, each with the project's pull steps."""
    doc = yaml.safe_load(prefect_yaml.read_text())
    pull = doc.get("pull") or []
    return [DeploymentSpec(d["name"], d["entrypoint"], dict(d.get("parameters") or {}), d.get("pull", pull))
            for d in doc["deployments"]]


async def wait_healthy(timeout_s: float) -> None:
    """Return once the API answers /health; `BringupError` after `timeout_s` with the last error."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    async with get_client() as c:
        while (err := await c.api_healthcheck()) is not None:
            if time.monotonic() > deadline:
                raise BringupError(f"the Prefect API at {c.api_url} did not answer /health within {timeout_s:.0f} s "
                                   f"({type(err).__name__}: {err}); is the prefect-server Deployment up "
                                   "(`kubectl -n rstar2 rollout status deploy/prefect-server`)?")
            await asyncio.sleep(1.0)


async def ensure_pool(template: dict, pool: str = POOL) -> str:
    """The pool with `template` as its base job template: "created", "updated" or "unchanged". A pool of
    another type is refused (Prefect cannot change a pool's type): delete it and run again."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    async with get_client() as c:
        try:
            existing = await c.read_work_pool(pool)
        except ObjectNotFound:
            try:
                await c.create_work_pool(WorkPoolCreate(name=pool, type=POOL_TYPE, base_job_template=template))
                return "created"
            except ObjectAlreadyExists:        # a worker created it between the read and the create
                existing = await c.read_work_pool(pool)
        if existing.type != POOL_TYPE:
            raise BringupError(f"work pool {pool!r} exists with type {existing.type!r}, ours is {POOL_TYPE!r} and "
                               f"Prefect cannot change a pool's type: `prefect work-pool delete {pool}`, then run "
                               "this again")
        if existing.base_job_template == template:
            return "unchanged"
        await c.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))
        return "updated"


def run_deploys(specs: list[DeploymentSpec], api_url: str, project_dir: Path, env: Mapping[str, str],
                pool: str = POOL, timeout_s: float = DEPLOY_TIMEOUT_S) -> None:
    """`prefect --no-prompt deploy --name N --pool <pool>` for each deployment, from `project_dir` (where
    prefect.yaml is), with this interpreter's Prefect."""
    for spec in specs:
        cmd = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--name", spec.name, "--pool", pool]
        r = subprocess.run(cmd, cwd=project_dir, env={**env, "PREFECT_API_URL": api_url}, capture_output=True,
                           text=True, timeout=timeout_s, check=False)
        if r.returncode != 0:
            raise BringupError(f"prefect deploy --name {spec.name} --pool {pool} failed ({r.returncode}):\n"
                               f"{r.stdout[-3000:]}{r.stderr[-3000:]}")


async def problems(template: dict, specs: list[DeploymentSpec], pool: str = POOL) -> list[str]:
    """Where the server's pool or deployments differ from `template` and `specs` ([] = they are ours)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.exceptions import ObjectNotFound

    out: list[str] = []
    async with get_client() as c:
        try:
            wp = await c.read_work_pool(pool)
        except ObjectNotFound:
            return [f"work pool {pool!r} does not exist"]
        if wp.type != POOL_TYPE:
            out.append(f"work pool {pool!r} has type {wp.type!r}, not {POOL_TYPE!r}")
        if wp.base_job_template != template:
            keys = sorted(k for k in set(wp.base_job_template) | set(template)
                          if wp.base_job_template.get(k) != template.get(k))
            out.append(f"work pool {pool!r}'s base job template differs from ours in {keys}")
        found = await c.read_deployments(deployment_filter=DeploymentFilter(
            name=DeploymentFilterName(any_=[s.name for s in specs])))
    for s in specs:
        mine = [d for d in found if d.name == s.name and d.entrypoint == s.entrypoint]
        if not mine:
            out.append(f"deployment {s.name!r} (entrypoint {s.entrypoint}) is not on the server")
        for d in mine:
            for what, got, want in (("work pool", d.work_pool_name, pool), ("parameters", d.parameters, s.parameters),
                                    ("pull steps", d.pull_steps, s.pull)):
                if got != want:
                    out.append(f"deployment {s.name!r} {what} is {got!r}, prefect.yaml says {want!r}")
    return out


async def _online_workers(pool: str) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import WorkerStatus

    async with get_client() as c:
        return [w for w in await c.read_workers_for_work_pool(pool) if w.status == WorkerStatus.ONLINE]


def bring_up(api_url: str | None = None, template: dict | Path = TEMPLATE, project_dir: Path = ROOT,
             pool: str = POOL, env: Mapping[str, str] | None = None, health_timeout_s: float = HEALTH_TIMEOUT_S,
             log: Callable[[str], None] = print) -> BringupReport:
    """See the module docstring. `api_url`: the Prefect API (default: PREFECT_API_URL's setting; refused when
    neither is set, which would deploy into a throwaway in-process server); `template`: the pool's base job
    template (a dict, or a JSON file); `env`: the environment of the `prefect deploy` processes (default
    this one's). When the template of a pool with online workers was replaced, waits one worker heartbeat
    from the replacement: a worker polling by REST re-reads its pool once per heartbeat, and a flow run
    it submits before then would start with the old template."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    t0 = time.monotonic()
    api_url = api_url or PREFECT_API_URL.value()
    if not api_url:
        raise BringupError("no Prefect API given: pass --api-url or export PREFECT_API_URL "
                           "(http://prefect-server.rstar2.svc:4200/api in the cluster)")
    tmpl = template if isinstance(template, dict) else json.loads(Path(template).read_text())
    specs = deployment_specs(project_dir / "prefect.yaml")
    with temporary_settings({PREFECT_API_URL: api_url}):
        asyncio.run(wait_healthy(health_timeout_s))
        action = asyncio.run(ensure_pool(tmpl, pool))
        changed_at = time.monotonic()
        log(f"[deploy] work pool {pool!r}: {action} (base job template: ours)")
        run_deploys(specs, api_url, project_dir, os.environ if env is None else env, pool)
        log(f"[deploy] deployed {', '.join(s.name for s in specs)} on {pool!r}")
        workers = asyncio.run(_online_workers(pool))
        if action == "updated" and workers:
            beat = max(float(w.heartbeat_interval_seconds or DEFAULT_HEARTBEAT_S) for w in workers)
            left = changed_at + beat + 2.0 - time.monotonic()
            if left > 0:
                log(f"[deploy] waiting {left:.0f} s for worker(s) {', '.join(w.name for w in workers)} to re-read "
                    "the pool's template (one heartbeat)")
                time.sleep(left)
        found = asyncio.run(problems(tmpl, specs, pool))
    if found:
        raise BringupError("after bring-up the Prefect server does not hold what infra/ describes:\n  - "
                           + "\n  - ".join(found))
    return BringupReport(api_url, action, tuple(s.name for s in specs), tuple(w.name for w in workers),
                         time.monotonic() - t0)
