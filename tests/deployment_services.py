"""The local service stack of the deployment tests (scripts/services.sh: Prefect server, process worker;
prefect.yaml's full-recipe deployed), the quick demo's sizes, and what the tests read back from the worker."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from uuid import UUID

from rstar2_cli.common import read_overrides_file
from rstar2_cli.rehearsal_stack import free_port

ROOT = Path(__file__).resolve().parents[1]

# The quick demo's sizes (what `make demo-quick` runs), with threads instead of Ray and no task retries.
QUICK = read_overrides_file(ROOT / "scripts" / "demo-quick.overrides")
E2E_EXTRA = ["pipeline.eval_stages=rl"]
# threads in the flow process take no per-task Ray reservations: the profile's are dropped with them
NO_RAY = ["cluster.use_ray=false", "cluster.resources={}"]
E2E_OVERRIDES = [*NO_RAY, "pipeline.task_retries=0", *QUICK, *E2E_EXTRA]


@contextlib.contextmanager
def services_up(home: Path, **extra_env: str):
    """scripts/services.sh up (no MLflow UI) under `home`, full-recipe deployed; yields (api, env), where env
    is what a shell of that stack has; `services.sh down` on the way out."""
    env = {**os.environ, "RSTAR2_HOME": str(home), "RSTAR2_PREFECT_PORT": str(free_port()),
           "RSTAR2_NO_MLFLOW_UI": "1", **extra_env}
    env.pop("PREFECT_API_URL", None)
    env.pop("RSTAR2_FAULT_INJECT", None)  # the rehearsal injects it into its own flow run
    subprocess.run(["bash", "scripts/services.sh", "up"], cwd=ROOT, env=env, check=True, timeout=600)
    try:
        api = next(line.split("=", 1)[1] for line in (home / "services.env").read_text().splitlines()
                   if line.startswith("export PREFECT_API_URL="))
        env["PREFECT_API_URL"] = api
        subprocess.run([str(ROOT / ".venv/bin/prefect"), "--no-prompt", "deploy", "--name", "full-recipe"],
                       cwd=ROOT, env={**env, "RSTAR2_REPO": str(ROOT)}, check=True, timeout=300,
                       capture_output=True)
        yield api, env
    finally:
        subprocess.run(["bash", "scripts/services.sh", "down"], cwd=ROOT, env=env, timeout=120, check=False)


def stop_prefect_server(home: Path) -> None:
    """Stop the stack's Prefect server (its process group, by PID) and wait until it is gone."""
    pid = int((home / "pids" / "prefect-server.pid").read_text())
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)


def start_prefect_server(env: dict[str, str]) -> None:
    """`services.sh up` again: the server on its old port (RSTAR2_PREFECT_PORT) and database."""
    subprocess.run(["bash", "scripts/services.sh", "up"], cwd=ROOT, env={k: v for k, v in env.items()
                   if k != "PREFECT_API_URL"}, check=True, timeout=600)


def flow_run_processes(home: Path) -> list[int]:
    """PIDs of the flow-run processes the stack's worker started (its children) that are still alive."""
    import psutil

    worker = psutil.Process(int((home / "pids" / "prefect-worker.pid").read_text()))
    return [p.pid for p in worker.children() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def worker_log_tail(home: Path, chars: int = 6000) -> str:
    """The end of the process worker's log (the flow run's traceback), for a failed run's assertion."""
    log = home / "logs" / "prefect-worker.log"
    return log.read_text(errors="replace")[-chars:] if log.exists() else f"no worker log at {log}"


async def attempt_process_exited(flow_run_id: UUID, timeout_s: float = 300) -> None:
    """Return once the worker has seen the failed attempt's process exit ("exited cleanly" or "exited with
    status code"), as a person pressing Retry after the run ended does."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    deadline = time.monotonic() + timeout_s
    async with get_client() as c:
        while time.monotonic() < deadline:
            logs = await c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200,
                                     sort=LogSort.TIMESTAMP_DESC)
            if any(m in log.message for log in logs for m in ("exited with status code", "exited cleanly")):
                return
            await asyncio.sleep(1)
    raise AssertionError(f"the worker did not report the exit of flow run {flow_run_id}'s process in {timeout_s:.0f} s")


def copy_profiles(dest: Path) -> Path:
    shutil.copytree(ROOT / "configs", dest)
    return dest
