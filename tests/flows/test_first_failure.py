"""When several tasks of the recipe fail, the flow run fails with the error of the one that failed first
in time: the cause. The deployment test met the case: RL stage 1 lost a node (`NodeLost`), then "eval sft",
earlier in DAG order but started after it, found the node gone (`LayoutDoesNotFit`) and its error became
the run's message."""

from __future__ import annotations

import time

import pytest
from prefect import flow, task

from flows.full_recipe import _first_failure_or


@task(retries=0)
def fails_later() -> None:
    time.sleep(1.5)
    raise LookupError("a consequence: the layout does not fit what is left")


@task(retries=0)
def fails_first() -> None:
    raise RuntimeError("the cause: a node was lost")


@pytest.mark.slow
def test_the_run_fails_with_the_error_that_came_first(prefect_harness):
    @flow
    def recipe() -> None:
        later = fails_later.submit()          # first in DAG order
        first = fails_first.submit()
        return _first_failure_or(later, [later, first])

    state = recipe(return_state=True)
    assert state.is_failed() and "the cause: a node was lost" in state.message, state.message
