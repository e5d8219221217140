"""The local service stack of the deployment tests (scripts/services.sh: Prefect server, process worker;
prefect.yaml's full-recipe deployed), the quick demo's sizes, and what the tests read back from the worker."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from uuid import UUID

from rstar2_cli.common import read_overrides_file
from rstar2_cli.rehearsal_stack import free_port, wait_http

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


@dataclasses.dataclass
class Stack:
    """A running stack of services_up, shared by the tests of tests/integration (each starting its own added
    ~25 s alone, ~51 s beside make demo): `home`, the `api` URL, `env` (what a shell of the stack has) and
    the `profiles` folder its worker reads. Tests run one at a time; `begin` marks the worker log where a test
    starts and `clean` leaves the stack as the next test expects it (server up, no flow run left running or
    scheduled, no flow-run process left, the profiles as shipped), whatever the test did or how it failed."""

    home: Path
    api: str
    env: dict[str, str]
    profiles: Path
    log_from: int = 0

    @property
    def _log(self) -> Path:
        return self.home / "logs" / "prefect-worker.log"

    def begin(self) -> None:
        self.log_from = self._log.stat().st_size if self._log.exists() else 0

    def worker_log(self, chars: int = 6000) -> str:
        """The end of what the process worker logged since `begin` (a failed run's traceback, for an assertion)."""
        if not self._log.exists():
            return f"no worker log at {self._log}"
        with self._log.open("rb") as f:
            f.seek(self.log_from)
            return f.read().decode(errors="replace")[-chars:]

    def processes(self, flow_run_id: UUID | str | None = None) -> list[int]:
        """PIDs of the live flow-run processes the worker started (its children), of `flow_run_id` only when
        given (the worker puts PREFECT__FLOW_RUN_ID in each one's environment)."""
        import psutil

        worker = psutil.Process(int((self.home / "pids" / "prefect-worker.pid").read_text()))
        out = []
        for p in worker.children():
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if flow_run_id is None or p.environ().get("PREFECT__FLOW_RUN_ID") == str(flow_run_id):
                    out.append(p.pid)
            except psutil.Error:
                continue                                 # it ended meanwhile, or has not exec'd yet
        return out

    def stop_server(self) -> None:
        """Stop the Prefect server (its process group, by PID) and wait until it is gone."""
        pid = int((self.home / "pids" / "prefect-server.pid").read_text())
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        os.killpg(pid, signal.SIGKILL)

    def start_server(self) -> None:
        """`services.sh up` again: the server on its old port (RSTAR2_PREFECT_PORT) and database."""
        subprocess.run(["bash", "scripts/services.sh", "up"], cwd=ROOT, env={k: v for k, v in self.env.items()
                       if k != "PREFECT_API_URL"}, check=True, timeout=600, capture_output=True)

    def clean(self, timeout_s: float = 120) -> None:
        try:
            wait_http(f"{self.api}/health", "Prefect server", 5)
        except TimeoutError:                             # a test stopped it and failed before starting it
            self.start_server()
        asyncio.run(_cancel_unfinished_runs(self.api))
        deadline = time.monotonic() + timeout_s
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        import psutil

        for pid in self.processes():                     # one that ignored the cancel, or was left stopped
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                for p in [*proc.children(recursive=True), proc]:
                    p.kill()
        shutil.copytree(ROOT / "configs", self.profiles, dirs_exist_ok=True)


async def _cancel_unfinished_runs(api: str) -> None:
    """Cancel every flow run of the stack that has not reached a final state: a scheduled one (an
    AwaitingRetry the worker would pick up later) at once, a running one through Cancelling, as the UI does."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelled, Cancelling

    live = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]
    with temporary_settings({PREFECT_API_URL: api}):
        async with get_client() as c:
            runs = await c.read_flow_runs(flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=live))))
            for run in runs:
                waiting = run.state_type in (StateType.SCHEDULED, StateType.PAUSED)
                await c.set_flow_run_state(run.id, Cancelled() if waiting else Cancelling(), force=True)


@contextlib.contextmanager
def stack_up(root: Path, **extra_env: str):
    """services_up under `root`/home with its worker reading a copy of the profiles at `root`/configs (a test
    may edit one mid-run; `Stack.clean` restores them); yields the Stack."""
    profiles = Path(shutil.copytree(ROOT / "configs", root / "configs"))
    with services_up(root / "home", RSTAR2_CONFIG_DIR=str(profiles), **extra_env) as (api, env):
        yield Stack(root / "home", api, env, profiles)


async def attempt_process_exited(flow_run_id: UUID, timeout_s: float = 300, attempts: int = 1) -> None:
    """Return once the worker has seen the process of the run's `attempts`-th attempt exit ("exited cleanly"
    or "exited with status code": one report per attempt), as a person pressing Retry after the run ended
    does."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    # the run's logs oldest first, read on from where the last page ended (less a margin, for a log that
    # arrived late; ids counted once); Prefect's text search (LogFilterTextSearch) needs SQLite's concat
    # (3.44+), which this Python's SQLite may lack
    said = ("exited with status code", "exited cleanly")
    only = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    exits: set = set()
    read = 0
    deadline = time.monotonic() + timeout_s
    async with get_client() as c:
        while time.monotonic() < deadline:
            start = max(0, read - 50)
            page = await c.read_logs(only, limit=200, offset=start, sort=LogSort.TIMESTAMP_ASC)
            exits |= {log.id for log in page if any(m in log.message for m in said)}
            read = start + len(page)
            if len(exits) >= attempts:
                return
            if len(page) < 200:
                await asyncio.sleep(1)
    raise AssertionError(f"the worker did not report the exit of flow run {flow_run_id}'s attempt {attempts} process "
                         f"in {timeout_s:.0f} s")
