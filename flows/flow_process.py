"""The flow-run process of every deployment (the work pools' `command`: `python -m flows.flow_process`):
Prefect's own engine (what `python -m prefect.engine` runs), with one change to its exit status. Prefect's
process worker marks a run Crashed when its process exits non-zero; a failed flow's process exits 1 seconds
after the API accepted Failed (the failure hook, the task runner's teardown), so a Retry pressed in those
seconds was overwritten by Crashed. Here a process whose final state the API accepted exits 0; one that
ends before that (killed, out of memory, the API unreachable at the end) still exits non-zero and is marked
Crashed. And a Cancel reaches the run when the worker has lost track of its process (a retry whose
process started before the failed attempt's ended): `watch_for_cancel`, which also runs the `on_cancel`
hooks (a cancelled run's MLflow runs end KILLED). docs/faults.md, "The Prefect API goes away" and "A Retry
pressed right after Failed"."""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

_accepted: list[str] = []
_cancel_hooks: list = []
_cancel_lock = threading.Lock()


def final_state_accepted(state) -> None:
    """Called first by each flow's failure hook, which Prefect calls once the API accepted the state."""
    _accepted.append(f"{state.type.value} ({state.name})")


def on_cancel(fn) -> None:
    """Call `fn()` once if this run is cancelled: when this process first sees the run Cancelling (or ends
    in a cancel), before it stops. The flows register the closing of their MLflow runs as KILLED with it;
    Prefect's `on_cancellation` hooks run in the process worker instead (which loads the flow by its pull
    steps, without the run's environment) and not at all when the worker lost track of the process."""
    _cancel_hooks.append(fn)


def _run_cancel_hooks() -> None:
    with _cancel_lock:
        hooks, _cancel_hooks[:] = list(_cancel_hooks), []
    for fn in hooks:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the cancel goes on; say what was left open
            print(f"flows.flow_process: a cancel hook failed ({exc!r})", file=sys.stderr, flush=True)


CANCEL_GRACE_S = 30.0
"""How long a run may stay Cancelling before its own process ends it. The worker's cancel (Prefect's SIGTERM
with its cancel intent) lands within seconds when it still watches the process; a shorter grace would race
it, a longer one keeps a cancelled run's GPUs busy that much longer when it does not."""


def watch_for_cancel(flow_run_id: str, poll_s: float = 5.0, grace_s: float = CANCEL_GRACE_S,
                     kill_after_s: float = 30.0) -> None:
    """Poll the API for this run's state (a daemon thread); on first seeing it Cancelling, run the
    `on_cancel` hooks; once it has been Cancelling for `grace_s`, do what the worker's cancel does: set
    Cancelled, SIGTERM this process, and end it `kill_after_s` later if it is still alive. Needed because
    Prefect's worker keys processes by flow run: when a failed attempt's process exits after the retry's
    started, the worker forgets the retry's ("Lost connection to flow run ... infrastructure") and a Cancel
    pressed in the UI stayed Cancelling while the run went on. An API that does not answer is polled again
    (the run's own state reports wait it out too)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled

    since, failing = None, False
    while True:
        time.sleep(poll_s)
        try:
            if _state_type(flow_run_id) != StateType.CANCELLING:
                since, failing = None, False
                continue
            failing = False
            if since is None:
                since = time.monotonic()
                _run_cancel_hooks()
            if time.monotonic() - since < grace_s:
                continue
            with get_client(sync_client=True) as c:
                c.set_flow_run_state(flow_run_id, Cancelled(message="Cancelled by the flow-run process: the run "
                                     f"was Cancelling for {grace_s:g} s and the worker had not stopped it"),
                                     force=True)
        except Exception as exc:  # noqa: BLE001 - the API away or a transient error: poll again
            if not failing:                       # once a streak, not every poll of a minute-long outage
                print(f"flows.flow_process: reading this run's state failed ({exc!r}); polling on", file=sys.stderr)
            failing = True
            continue
        print(f"flows.flow_process: this run was Cancelling for {grace_s:g} s and its process was not stopped; "
              "set Cancelled, stopping it (SIGTERM)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(kill_after_s)
        os._exit(1)


def _state_type(flow_run_id: str):
    """The run's state type in the API (None before it has one); raises when the API does not answer."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        state = c.read_flow_run(flow_run_id).state
    return None if state is None else state.type


def _was_cancelled(flow_run_id: str) -> bool:
    from prefect.client.schemas.objects import StateType

    try:
        return _state_type(flow_run_id) in (StateType.CANCELLING, StateType.CANCELLED)
    except Exception:  # noqa: BLE001 - the API away: the process's exit is what matters now
        return False


def main() -> None:
    fid = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PREFECT__FLOW_RUN_ID")
    if fid:
        threading.Thread(target=watch_for_cancel, args=(fid,), name="rstar2-cancel-watch", daemon=True).start()
    try:
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
    except BaseException as exc:
        clean = isinstance(exc, SystemExit) and exc.code in (0, None)
        if fid and _cancel_hooks and not clean and not _accepted and _was_cancelled(fid):
            _run_cancel_hooks()       # the worker's SIGTERM came before the watcher saw the run Cancelling
        if not isinstance(exc, SystemExit):
            raise
        if exc.code in (0, None) or not _accepted:
            raise
        print(f"flows.flow_process: the API accepted this run's final state {_accepted[-1]}; exiting 0 instead "
              f"of {exc.code} so that the worker does not mark the run Crashed over a Retry", file=sys.stderr)
        raise SystemExit(0) from None


if __name__ == "__main__":
    from flows.flow_process import main as _main  # the module's own globals, which the failure hooks update

    _main()
