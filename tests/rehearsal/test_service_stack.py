"""The production service stack as infra/ describes it, on this machine (rstar2_cli/rehearsal_stack.py):
PostgreSQL behind the Prefect and MLflow servers, the MLflow server's artifacts on a moto S3, the
`rstar2-cluster` pool from infra's base job template, a worker started with infra's command and
environment (no RSTAR2_REPO of ours), the deployments created as infra/README.md says, a local 2-node Ray
cluster. A run of `rstar2/full-recipe` with the production profile scaled down (the rehearsal's overlay)
reaches the flow through that worker, and, its stores still empty, fails at preflight in seconds naming
every object the operator has not uploaded yet, while the MLflow server and the Ray head answer."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile

import pytest
from deployment_services import attempt_process_exited

pytestmark = [pytest.mark.slow, pytest.mark.rehearsal]


@pytest.fixture(scope="module")
def stack():
    from rstar2_cli.rehearsal import overlay_overrides, tool_service
    from rstar2_cli.rehearsal_stack import ServiceStack
    from rstar2_core.config import load_config

    root = tempfile.mkdtemp(prefix="rstar2-reh-", dir="/tmp")      # Ray's socket paths must stay short
    cfg = load_config("qwen3-14b-mi300x", overlay_overrides())
    try:
        with ServiceStack(root, cfg.cluster, tool_service=tool_service(cfg)) as st:
            st.deploy()
            yield st
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_flow_run_through_the_production_worker_reaches_preflight(stack):
    import psutil
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.client import start_run, watch
    from rstar2_cli.rehearsal import overlay_overrides
    from rstar2_cli.rehearsal_stack import pg_bin

    worker_env = psutil.Process(stack.procs["prefect-worker"].pid).environ()
    assert "RSTAR2_REPO" not in worker_env and worker_env["PREFECT_API_URL"] == stack.prefect_api
    overrides = [*overlay_overrides(), *stack.endpoint_overrides()]

    async def message() -> str:
        async with get_client() as c:
            return (await c.read_flow_run(fid)).state.message or ""

    with temporary_settings({PREFECT_API_URL: stack.prefect_api}):
        fid = asyncio.run(start_run("rstar2/full-recipe", {"profile": "qwen3-14b-mi300x", "overrides": overrides}))
        state = asyncio.run(watch(fid, timeout_s=600, quiet=True))
        assert state == "Failed", (stack.logs / "prefect-worker.log").read_text()[-4000:]
        assert asyncio.run(message())
        # its last lines come seconds after Failed (the failure hook, the teardown): read the log once the
        # worker has seen the process exit, which it reports after relaying the process's output to the end
        asyncio.run(attempt_process_exited(fid))

    log = (stack.logs / "prefect-worker.log").read_text()
    assert "the recipe cannot start" in log, log[-4000:]           # the flow ran: pull step and import worked
    assert "exiting 0 instead of 1" in log    # infra's job template starts flow runs as flows.flow_process
    for missing in ("data.sources.0.url = 's3://rstar2-data/raw/dapo-math-17k.parquet' does not exist",
                    "data.sft_sources.2 = 's3://rstar2-data/sft/chat.parquet' does not exist",
                    "eval.benchmarks.4.url = 's3://rstar2-data/bench/gpqa_diamond.parquet'",
                    "model.name_or_path = 's3://rstar2-models/SmolLM2-135M-Instruct-recipe-format' is not a complete checkpoint"):
        assert missing in log, missing
    assert "MLflow server does not answer" not in log and "no Ray head answers" not in log
    assert "the tool service does not answer" not in log
    # the servers keep their state in PostgreSQL: the flow run is a row there
    rows = subprocess.run([pg_bin("psql"), "-h", "127.0.0.1", "-p",
                           str(stack.pg_port), "-U", "rstar2", "-d", "prefect", "-tAc",
                           f"select count(*) from flow_run where id = '{fid}'"],
                          capture_output=True, text=True, check=True, env={**os.environ, "PGCONNECT_TIMEOUT": "10"})
    assert rows.stdout.strip() == "1"
    tables = subprocess.run([pg_bin("psql"), "-h", "127.0.0.1", "-p", str(stack.pg_port), "-U", "rstar2", "-d",
                             "mlflow", "-tAc", "select count(*) from experiments"], capture_output=True, text=True,
                            check=True)
    assert int(tables.stdout.strip()) >= 1                           # the MLflow server's tables, on PostgreSQL


def test_the_tool_service_runs_on_its_own_node(stack):
    """The production profile's sandbox is the tool service: deployed by `rstar2 tools deploy` on the tool
    node (the only one declaring sandbox.service.node_resource), answering over HTTP, none of its replicas
    on a GPU node."""
    import httpx

    tool_node = stack.cluster.node_id(len(stack.cluster.nodes) - 1)
    seen = {httpx.get(stack.tools_url + "/health", timeout=30).json()["replica"] for _ in range(12)}
    assert seen and {r.split("/")[0] for r in seen} == {tool_node[:12]}, (seen, tool_node)
    one = httpx.post(stack.tools_url + "/run", json={"code": "print(2 ** 10)"}, timeout=60).json()
    assert (one["status"], one["stdout"]) == ("ok", "1024\n"), one


@pytest.mark.rehearsal_run          # ~35 min on 2 cores: make test-all (make test's CI has 90 min in all)
@pytest.mark.timeout(2700)
def test_the_production_profile_runs_to_a_registered_model(stack):
    """`make rehearsal` on the shared stack: the stores filled as an operator would (rehearsal_data.py, the
    base model included), then `rstar2/full-recipe` with the production profile and the overlay through
    the production worker, to its end: every stage ran, a model version is registered in MLflow (PostgreSQL)
    with its artifacts on S3, and the eval table has every benchmark the profile lists. The tool service lost
    one replica as RL stage 2 began (`REPLICA_KILL`): Serve replaced it (same count, one new actor) and the
    run went on to its end."""
    from rstar2_cli.rehearsal import rehearse

    res = rehearse(stack, timeout_s=2400, log=print, deploy=False)
    log = (stack.logs / "prefect-worker.log").read_text(errors="replace")
    assert res["state"] == "Completed", (res["message"], log[-6000:])
    names = list(res["task_seconds"])          # task runs of the flow and its stages subflow, by name
    for task in ("curate", "sft-data", "sft (", "rl-stage-3 hard subset", "register best"):
        assert any(n.startswith(task) for n in names), (task, names)
    assert sum(n.startswith("rl-stage-") and "turns" in n for n in names) == 3, names
    assert sum(n.startswith("eval ") for n in names) >= 4, names             # every checkpoint evaluated
    assert res["model_versions"] and res["mlflow_artifacts_on_s3"] > 0, res
    assert res["faults_fired"] == ["rl-stage-2-step1-kill-sandbox.fired"], res["faults_fired"]
    ts = res["tool_service"]
    assert ts["status_after"] == "RUNNING" and len(ts["replicas_after"]) == len(ts["replicas_before"]) == 2, ts
    assert len(set(ts["replicas_after"]) - set(ts["replicas_before"])) == 1, ts      # one replica replaced
    table = res["summary"]
    for bench in res["eval"]["benchmarks"]:
        assert f"{bench} pass@1" in table.splitlines()[0], (bench, table)
    for stage in ("sft", "rl-stage-1", "rl-stage-2", "rl-stage-3"):
        assert f"| {stage} |" in table, (stage, table)
    print(res["summary"])
