"""Client side of the deployments: start a run of `rstar2/full-recipe` (or any deployment), show its
progress while it runs, retry a failed run exactly as the UI's Retry button does, print the summary.

    python -m flows.client run rstar2/full-recipe --param profile=tiny --set rl.stages.0.steps=2
    python -m flows.client run rstar2/full-recipe --env RSTAR2_FAULT_INJECT=rl-stage-1:step=2 \
        --set pipeline.task_retries=0
    python -m flows.client retry <flow-run-id>
    python -m flows.client summary <flow-run-id>

Invariant: `retry_flow_run(id, ui="v2" | "classic")` sends exactly what that UI sends (state Scheduled named
"AwaitingRetry"). See docs/pipeline.md, "Retry from the UI" and "Try it" (`--env`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
)
from prefect.states import Scheduled

from rstar2_cli.common import add_override_args

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


async def start_run(deployment: str, parameters: dict, env: dict[str, str] | None = None) -> UUID:
    """A new flow run of `deployment`; `env` becomes the environment of its process (job variable `env`)."""
    async with get_client() as c:
        dep = await c.read_deployment_by_name(deployment)
        fr = await c.create_flow_run_from_deployment(dep.id, parameters=parameters,
                                                     job_variables={"env": dict(env)} if env else None)
        return fr.id


UI_RETRY_FORCE = {"v2": True, "classic": False}
"""The `force` flag each Prefect UI's Retry sends (prefect/server/ui-v2: the flow run menu's retry
dialog; prefect/server/ui: retryFlowRun)."""


class RetryRefused(RuntimeError):
    """The server did not accept a retry (its answer and reason in the message); the run was not rescheduled."""


async def retry_flow_run(flow_run_id: UUID | str, ui: str = "v2") -> None:
    """What the Retry of Prefect's `ui` ("v2": the new UI, the default page; "classic") sends. Raises
    RetryRefused when the server does not accept it. Once accepted, the run's latest state may already be the
    worker's Pending rather than AwaitingRetry."""
    if ui not in UI_RETRY_FORCE:
        raise ValueError(f"retry_flow_run: ui={ui!r}; valid: {sorted(UI_RETRY_FORCE)}")
    async with get_client() as c:
        result = await c.set_flow_run_state(UUID(str(flow_run_id)),
                                            Scheduled(name="AwaitingRetry", message="Retry from the UI"),
                                            force=UI_RETRY_FORCE[ui])
    if result.status.value != "ACCEPT":
        raise RetryRefused(f"retry of flow run {flow_run_id}: the server answered {result.status.value} "
                           f"({getattr(result.details, 'reason', None) or 'no reason given'}); the run was not rescheduled")


async def task_runs(c, flow_run_id: UUID) -> list:
    """The stage task runs of a flow run and of its subflow runs (not the subflows' own entries)."""
    subs = await c.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
    ids = [flow_run_id] + [s.id for s in subs]
    trs = await c.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=ids)))
    # a subflow run is itself a task run of its parent: skip those dummy entries
    return [t for t in trs if not re.fullmatch(r"(recipe-stages|rstar2)-\d+", t.name)]


async def _task_lines(c, flow_run_id: UUID) -> list[str]:
    trs = await task_runs(c, flow_run_id)
    return [f"{t.name}: {t.state.name if t.state else '?'}" for t in sorted(trs, key=lambda t: t.expected_start_time or t.created)]


def expected_tasks(parameters: dict) -> int | None:
    """Task runs in the stage DAG of a full-recipe run with these parameters (None if not a recipe run)."""
    from rstar2_core.config import ConfigError, load_config

    try:
        cfg = load_config(parameters.get("profile", "tiny"), list(parameters.get("overrides") or []))
    except ConfigError:
        return None
    stages = cfg.rl.stages
    evals = 1 + {"all": len(stages), "rl": len(stages), "last": 1}[cfg.pipeline.eval_stages]  # + the SFT baseline
    return 4 + len(stages) + sum(s.dataset == "hard_subset" for s in stages) + evals + 1


async def watch(flow_run_id: UUID, timeout_s: float = 3600, poll_s: float = 2.0, quiet: bool = False,
                total: int | None = None) -> str:
    """Poll until the flow run is terminal; print a line per change in its (sub)flow's task runs, with
    tasks done out of `total` and a rough ETA (elapsed time per finished task) when `total` is known."""
    t0 = time.time()
    seen: set[str] = set()
    async with get_client() as c:
        while True:
            fr = await c.read_flow_run(flow_run_id)
            state = fr.state.type.value if fr.state else "PENDING"
            if not quiet:
                lines = await _task_lines(c, flow_run_id)
                done = sum(line.endswith(": Completed") for line in lines)
                for line in lines:
                    if line not in seen:
                        seen.add(line)
                        el = time.time() - t0
                        eta = f", ETA {el / done * (total - done):.0f} s" if total and done else ""
                        frac = f" ({done}/{total} tasks{eta})" if total else ""
                        print(f"[{el:6.0f} s]{frac} {line}", flush=True)
            if state in TERMINAL and fr.state.name not in ("AwaitingRetry",):
                if not quiet:
                    print(f"[{time.time() - t0:6.0f} s] flow run {fr.name}: {fr.state.name} {fr.state.message or ''}",
                          flush=True)
                return fr.state.name
            if time.time() - t0 > timeout_s:
                raise TimeoutError(f"flow run {flow_run_id} still {fr.state.name} after {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)


async def summary_markdown(flow_run_id: UUID) -> str | None:
    """The `recipe-summary` markdown artifact of a finished full-recipe run."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    async with get_client() as c:
        arts = await c.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=["recipe-summary"])))
        return arts[-1].data if arts else None


def _parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise SystemExit(f"--env {it!r}: expected NAME=VALUE, e.g. RSTAR2_FAULT_INJECT=rl-stage-1:step=2")
        env[k] = v
    return env


def _flow_run_id(text: str) -> UUID:
    try:
        return UUID(text)
    except ValueError:
        raise SystemExit(f"{text!r} is not a flow run id (a UUID, as printed by `python -m flows.client run` "
                         "and shown in the Prefect UI)") from None


def _parse_params(items: list[str], overrides: list[str]) -> dict:
    params: dict = {}
    for it in items:
        k, _, v = it.partition("=")
        try:
            params[k] = json.loads(v)
        except json.JSONDecodeError:
            params[k] = v
    if overrides:
        params["overrides"] = list(params.get("overrides", [])) + overrides
    return params


def main(argv: list[str] | None = None) -> int:
    """The commands below; a Prefect API that does not answer ends them with one line naming it."""
    import httpx

    try:
        return _main(argv)
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        from prefect.settings import PREFECT_API_URL

        raise SystemExit(f"the Prefect API at {PREFECT_API_URL.value()} does not answer ({type(e).__name__}: {e}); "
                         "start it (scripts/services.sh up) or set PREFECT_API_URL to your server's API") from None


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.client")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="start a deployment run and watch it")
    r.add_argument("deployment", nargs="?", default="rstar2/full-recipe")
    r.add_argument("--param", action="append", default=[], metavar="NAME=JSON")
    add_override_args(r)
    r.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment variable of this flow run's process only (repeatable)")
    r.add_argument("--timeout", type=float, default=3600)
    r.add_argument("--id-file", help="write the flow run id here")
    t = sub.add_parser("retry", help="retry a failed flow run as the UI does, and watch it")
    t.add_argument("flow_run_id")
    t.add_argument("--ui", choices=sorted(UI_RETRY_FORCE), default="v2",
                   help="send what this Prefect UI's Retry sends (default v2, the UI the server opens)")
    s = sub.add_parser("summary", help="print the recipe summary of a finished run")
    s.add_argument("flow_run_id")
    a = ap.parse_args(argv)
    ui = os.environ.get("PREFECT_API_URL", "http://127.0.0.1:4200/api").removesuffix("/api")
    if a.cmd == "run":
        params = _parse_params(a.param, a.overrides)
        fid = asyncio.run(start_run(a.deployment, params, _parse_env(a.env)))
        if a.id_file:
            with open(a.id_file, "w") as f:
                f.write(str(fid))
        print(f"flow run {fid}: {ui}/v2/runs/flow-run/{fid}", flush=True)
        total = expected_tasks(params) if a.deployment.endswith("full-recipe") else None
        state = asyncio.run(watch(fid, a.timeout, total=total))
    elif a.cmd == "retry":
        fid = _flow_run_id(a.flow_run_id)
        try:
            asyncio.run(retry_flow_run(fid, a.ui))
        except RetryRefused as e:
            raise SystemExit(str(e)) from None
        state = asyncio.run(watch(fid))
    else:
        fid, state = _flow_run_id(a.flow_run_id), "Completed"
    md = asyncio.run(summary_markdown(fid))
    if md:
        print(md)
    elif a.cmd == "summary":
        raise SystemExit(f"flow run {fid} has no recipe summary: check the id (a finished rstar2/full-recipe run's)")
    return 0 if state == "Completed" else 1


if __name__ == "__main__":
    sys.exit(main())
