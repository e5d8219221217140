"""The flow-run process of every deployment (the work pools' `command`: `python -m flows.flow_process`):
Prefect's own engine (what `python -m prefect.engine` runs), with one change to its exit status. Prefect's
process worker marks a run Crashed when its process exits non-zero; a failed flow's process exits 1 seconds
after the API accepted Failed (the failure hook, the task runner's teardown), so a Retry pressed in those
seconds was overwritten by Crashed. Here a process whose final state the API accepted exits 0; one that
ends before that (killed, out of memory, the API unreachable at the end) still exits non-zero and is marked
Crashed. docs/faults.md, "The Prefect API goes away" and "A Retry pressed right after Failed"."""

from __future__ import annotations

import runpy
import sys

_accepted: list[str] = []


def final_state_accepted(state) -> None:
    """Called first by each flow's failure hook, which Prefect calls once the API accepted the state."""
    _accepted.append(f"{state.type.value} ({state.name})")


def main() -> None:
    try:
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code in (0, None) or not _accepted:
            raise
        print(f"flows.flow_process: the API accepted this run's final state {_accepted[-1]}; exiting 0 instead "
              f"of {exc.code} so that the worker does not mark the run Crashed over a Retry", file=sys.stderr)
        raise SystemExit(0) from None


if __name__ == "__main__":
    from flows.flow_process import main as _main  # the module's own globals, which the failure hooks update

    _main()
