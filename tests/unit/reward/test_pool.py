"""GraderPool: same results as in-process grading, hard timeouts on a real sympy hang, dead workers replaced."""

from __future__ import annotations

import time

import grader_hooks
import pytest

from rstar2_core.reward import GradeResult, GraderPool, grade_response

pytestmark = pytest.mark.slow

HANG = r"<answer>\boxed{(10^{8})!}</answer>"  # math-verify/sympy evaluate 10^8! to compare: minutes of CPU


@pytest.fixture(scope="module")
def pool():
    with GraderPool(workers=2, timeout_s=1.5, grade_fn=grader_hooks.misbehaving_grade, memory_mb=2048) as p:
        yield p


def test_results_in_order_and_equal_to_in_process(pool):
    items = [(rf"<answer>\boxed{{{i}}}</answer>", str(i if i % 3 else i + 1)) for i in range(12)]
    items += [(r"\boxed{x^2+1}", "1+x^2"), ("no box", "1")]
    assert pool.grade_many(items) == [grade_response(r, g) for r, g in items]


def test_real_hang_times_out_and_pool_keeps_working(pool):
    before = (pool.timeouts, pool.restarts)
    t0 = time.monotonic()
    out = pool.grade_many([(HANG, "5"), (r"\boxed{4}", "4"), (r"\boxed{x+x}", "2x")])
    assert time.monotonic() - t0 < 60  # never hangs (the item itself would run for minutes)
    assert out == [GradeResult(0.0, "(10^{8})!", "grader_timeout"), GradeResult(1.0, "4", "correct"),
                   GradeResult(1.0, "x+x", "correct")]
    assert (pool.timeouts, pool.restarts) == (before[0] + 1, before[1] + 1)
    assert pool.grade_many([(r"\boxed{9}", "9")]) == [GradeResult(1.0, "9", "correct")]


def test_injected_sleep_dead_worker_exception_and_memory(pool):
    items = [(r"\boxed{1}", "__sleep__"), (r"\boxed{2}", "__die__"), (r"\boxed{3}", "__raise__"),
             (r"\boxed{4}", "__memory__"), (r"\boxed{5}", "5")]
    out = pool.grade_many(items)
    assert [r.reason for r in out] == ["grader_timeout", "grader_error", "grader_error", "grader_error", "correct"]
    assert [r.extracted for r in out[:2]] == ["1", "2"]
    assert pool.grade_many([(r"\boxed{6}", "6")] * 4) == [GradeResult(1.0, "6", "correct")] * 4


def test_invalid_items_do_not_reach_workers(pool):
    out = pool.grade_many([(1, "1"), ("x",), None, (r"\boxed{1}", "1")])
    assert [r.reason for r in out] == ["invalid_request"] * 3 + ["correct"]
    assert pool.grade_many([]) == []


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="timeout_s"):
        GraderPool(timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        GraderPool(workers=-1)
