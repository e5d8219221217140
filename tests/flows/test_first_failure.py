"""When several tasks of the recipe fail, the flow run fails with the error of the one that failed first
in time: the cause. The deployment test met the case: RL stage 1 lost a node (`NodeLost`), then "eval sft",
earlier in DAG order but started after it, found the node gone (`LayoutDoesNotFit`) and its error became
the run's message."""

from __future__ import annotations

import threading

import pytest
from prefect import flow, task

from flows.full_recipe import _first_failure_or

FIRST_FAILED = threading.Event()   # set by fails_first's failure hook: its Failed state exists by then


@task(retries=0)
def fails_later() -> None:
    assert FIRST_FAILED.wait(timeout=60), "fails_first's Failed state never came"
    raise LookupError("a consequence: the layout does not fit what is left")


@task(retries=0, on_failure=[lambda task, run, state: FIRST_FAILED.set()])
def fails_first() -> None:
    raise RuntimeError("the cause: a node was lost")


@pytest.mark.slow
def test_the_run_fails_with_the_error_that_came_first(prefect_harness):
    FIRST_FAILED.clear()

    @flow
    def recipe() -> None:
        later = fails_later.submit()          # first in DAG order
        first = fails_first.submit()
        return _first_failure_or(later, [later, first])

    state = recipe(return_state=True)
    assert FIRST_FAILED.is_set()
    assert state.is_failed() and "the cause: a node was lost" in state.message, state.message
