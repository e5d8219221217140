"""The Prefect side of a long run's faults, against the real stack of scripts/services.sh (Prefect server on
SQLite, process worker, the full-recipe deployment at the quick demo's sizes): the Prefect server stopped
for 30 s while stages run and started again on the same port and database (the run completes, every task
run Completed in the API), and a Retry pressed while the failed attempt's process is still ending (kept:
the run is not marked Crashed over it). docs/faults.md."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from uuid import UUID

import pytest
from deployment_services import E2E_OVERRIDES, attempt_process_exited

pytestmark = pytest.mark.slow


async def _states(flow_run_id: UUID) -> list[str]:
    from prefect.client.orchestration import get_client

    async with get_client() as c:
        return [f"{s.type.value}:{s.name}" for s in await c.read_flow_run_states(flow_run_id)]


async def _task_states(flow_run_id: UUID) -> list[str]:
    from prefect.client.orchestration import get_client

    from flows.client import _task_lines

    async with get_client() as c:
        return await _task_lines(c, flow_run_id)


def test_prefect_server_down_30_s_mid_stage_the_run_completes(stack):
    """Prefect's client waits out a server it has reached before (it retries a refused connection with
    backoff, ~1 min in all): a flow run whose stages start and end while the server is away reports every
    state once it is back, and completes; the worker reconnects by itself."""
    from flows.client import start_run, watch
    from rstar2_core.config import load_config
    from tasks import tracking
    from tasks.run_store import RunStore

    cfg = load_config("tiny", E2E_OVERRIDES)
    fid = asyncio.run(start_run("rstar2/full-recipe", {"profile": "tiny", "overrides": E2E_OVERRIDES}))
    store = RunStore.for_run(cfg.resolved_storage_root(), str(fid))
    deadline = time.monotonic() + 600
    while store.record("sft-data") is None or store.record("base-model") is None:   # SFT's inputs: it
        assert time.monotonic() < deadline, stack.worker_log()                     # starts in the outage
        time.sleep(0.2)
    assert store.record("sft") is None
    stack.stop_server()
    down_at = time.monotonic()
    try:
        while store.tracking_id("sft") is None:        # SFT's task starts in the outage: its state report
            assert time.monotonic() - down_at < 45, \
                "SFT did not start while the server was away: the outage met no state report"
            time.sleep(0.2)
        time.sleep(max(0.0, 30 - (time.monotonic() - down_at)))   # the outage lasts its 30 s all the same
    finally:
        stack.start_server()
    assert asyncio.run(watch(fid, timeout_s=900, quiet=True)) == "Completed", stack.worker_log()
    tasks = asyncio.run(_task_states(fid))
    assert tasks and all(t.endswith(": Completed") for t in tasks), tasks
    assert not [s for s in asyncio.run(_states(fid)) if s.startswith(("CRASHED", "FAILED"))]
    assert store.record("sft")["attempt"] == 1 and store.record("rl-stage-3")["attempt"] == 1
    assert tracking.metric_steps(cfg, store.tracking_id("rl-stage-1"), "rollout/trajectories") == [1, 2, 3]


def _stop_the_next_flow_run_process(stack, fid: UUID, known: set[int], timeout_s: float = 120) -> int:
    """SIGSTOP the first process the worker starts for flow run `fid` that is not in `known`, as soon as it
    exists (interpreter start-up: long before it runs the deployment's pull step); return its PID."""
    deadline = time.monotonic() + timeout_s
    while not (new := [p for p in stack.processes(fid) if p not in known]):
        assert time.monotonic() < deadline, "the worker started no process for the retry"
        time.sleep(0.02)
    os.kill(new[0], signal.SIGSTOP)
    return new[0]


def _wait_gone(pids, fid: UUID, timeout_s: float = 300) -> None:
    """Return once `pids` have ended and the worker has reported the run's (first) attempt's process exit."""
    import psutil

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"the processes {pids} did not end"
        time.sleep(0.1)
    asyncio.run(attempt_process_exited(fid, timeout_s=timeout_s))    # the worker has seen it and cleaned up


def _retry_while_the_failed_attempts_process_ends(stack, overrides: list[str]) -> UUID:
    """Start a run whose SFT fails at its first step; press Retry the moment the API shows Failed, while the
    failed attempt's process is still ending (held with SIGSTOP until the Retry is in); hold the retry's
    process from its start until the failed attempt's has ended, so that the worker, which keys processes
    by flow run, takes the retry's as ended too. Returns the flow run's id, its retry's process let go."""
    from flows.client import retry_flow_run, start_run

    fid = asyncio.run(start_run("rstar2/full-recipe", {"profile": "tiny", "overrides": overrides},
                                env={"RSTAR2_FAULT_INJECT": "sft:step=1"}))
    deadline = time.monotonic() + 600
    while not (states := asyncio.run(_states(fid))) or not states[-1].startswith("FAILED"):
        assert time.monotonic() < deadline and states[-1:] != ["COMPLETED:Completed"], states
        time.sleep(0.1)
    pids = stack.processes(fid)
    assert pids, "the failed attempt's process had already exited: the race this test pins was missed"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    retry_pid = None
    try:
        asyncio.run(retry_flow_run(fid, "v2"))        # raises unless accepted (the worker may be at Pending now)
        retry_pid = _stop_the_next_flow_run_process(stack, fid, set(pids))
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    try:
        _wait_gone(pids, fid)
    finally:
        os.kill(retry_pid, signal.SIGCONT)
    return fid


def test_a_retry_pressed_while_the_failed_attempts_process_ends_is_kept(stack):
    """The UI's Retry pressed the moment the run shows Failed, while the failed attempt's process is still
    ending (its failure hook, its teardown; the test holds it with SIGSTOP until the Retry is in): the
    worker does not mark the run Crashed when that process exits, and the retry resumes to Completed.
    Before flows/flow_process.py the process exited 1 and the worker's Crashed overwrote the Retry. The
    retry's process is held too, from its start until the failed attempt's has ended: before the local pool
    set working_dir, the worker deleted the retry's temporary start directory then and it died in the pull
    step (FileNotFoundError from os.getcwd; CI, 2026-12-05)."""
    from flows.client import watch
    from rstar2_core.config import load_config
    from tasks.run_store import RunStore

    cfg = load_config("tiny", E2E_OVERRIDES)
    fid = _retry_while_the_failed_attempts_process_ends(stack, E2E_OVERRIDES)
    assert asyncio.run(watch(fid, timeout_s=900, quiet=True)) == "Completed", stack.worker_log()
    history = asyncio.run(_states(fid))
    assert not [s for s in history if s.startswith("CRASHED")], history
    assert history.count("FAILED:Failed") == 1, history
    store = RunStore.for_run(cfg.resolved_storage_root(), str(fid))
    assert store.record("sft")["attempt"] == 2 and store.record("curate")["attempt"] == 1
    assert "exiting 0 instead of 1" in stack.worker_log(200_000)


def test_a_cancel_reaches_a_retry_whose_process_the_worker_lost(stack):
    """The same race, then the UI's Cancel while the retry trains a long RL stage: the worker no longer
    watches that process ("Lost connection"), so before flows/flow_process.py watched its own run the run
    stayed Cancelling and trained on; now its process sets Cancelled after its grace and ends, and the
    stage never finishes. Its MLflow runs, the recipe's and the RL stage's, end KILLED (they stayed RUNNING)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from flows.flow_process import CANCEL_GRACE_S
    from rstar2_core.config import load_config
    from tasks import tracking
    from tasks.run_store import RunStore

    overrides = [*E2E_OVERRIDES, "rl.stages.0.steps=400"]        # hours at these sizes: only a cancel ends it
    cfg = load_config("tiny", overrides)
    fid = _retry_while_the_failed_attempts_process_ends(stack, overrides)
    store = RunStore.for_run(cfg.resolved_storage_root(), str(fid))
    deadline = time.monotonic() + 600
    while store.tracking_id("rl-stage-1") is None:            # the retry is training: its RL stage began
        assert time.monotonic() < deadline, stack.worker_log()
        time.sleep(0.5)
    assert "Lost connection to flow run" in stack.worker_log(200_000), "the race was missed"
    pids = stack.processes(fid)
    assert pids, "the retry's process is not running: nothing for the Cancel to stop"

    async def cancel():
        async with get_client() as c:
            return await c.set_flow_run_state(fid, Cancelling(message="Cancel from the UI"))

    assert asyncio.run(cancel()).status.value == "ACCEPT"
    _wait_gone(pids, fid, timeout_s=CANCEL_GRACE_S + 120)
    history = asyncio.run(_states(fid))
    assert history[-1] == "CANCELLED:Cancelled", history
    assert not [s for s in history if s.startswith("CRASHED")], history
    assert store.record("rl-stage-1") is None
    runs = {k: store.tracking_id(k) for k in ("parent", "sft", "rl-stage-1")}
    status = {k: tracking.client(cfg).get_run(r).info.status for k, r in runs.items()}
    assert status == {"parent": "KILLED", "sft": "FINISHED", "rl-stage-1": "KILLED"}, status
