"""GraderPool: same results as in-process grading, hard timeouts on a real sympy hang, dead workers replaced."""

from __future__ import annotations

import time

import grader_hooks
import pytest

from rstar2_core.reward import GradeResult, GraderPool, grade_response
from rstar2_core.reward.pool import next_check

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
    t0 = time.monotonic()
    out = pool.grade_many(items)
    # the sleeping item uses no CPU, so it looks starved and gets the full grace (3 x 1.5 s) before the kill
    assert time.monotonic() - t0 >= 3 * 1.5 - 0.1
    assert [r.reason for r in out] == ["grader_timeout", "grader_error", "grader_error", "grader_error", "correct"]
    assert [r.extracted for r in out[:2]] == ["1", "2"]
    assert pool.grade_many([(r"\boxed{6}", "6")] * 4) == [GradeResult(1.0, "6", "correct")] * 4


def test_invalid_items_do_not_reach_workers(pool):
    out = pool.grade_many([(1, "1"), ("x",), None, (r"\boxed{1}", "1")])
    assert [r.reason for r in out] == ["invalid_request"] * 3 + ["correct"]
    assert pool.grade_many([]) == []


def test_next_check_stops_busy_items_and_gives_starved_ones_more_time():
    # started at 0, timeout 2 s, grace 3 (hard stop at 6 s); called at or after 2 s of wall time
    assert next_check(0.0, 2.0, 2.0, 3.0, cpu_used=1.9) is None      # it had the CPU: a real hang
    assert next_check(0.0, 2.0, 2.0, 3.0, cpu_used=None) is None     # no CPU figure: wall clock only
    assert next_check(0.0, 2.0, 2.0, 1.0, cpu_used=0.0) is None      # grace 1: wall clock only
    assert next_check(0.0, 2.0, 2.0, 3.0, cpu_used=0.2) == 2.8       # starved: look again when it could have had 1 s
    assert next_check(0.0, 5.9, 2.0, 3.0, cpu_used=0.0) == 6.0       # never past the hard stop
    assert next_check(0.0, 6.0, 2.0, 3.0, cpu_used=0.0) is None


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="timeout_s"):
        GraderPool(timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        GraderPool(workers=-1)
    with pytest.raises(ValueError, match="starved_grace"):
        GraderPool(starved_grace=0.5)


_ORPHAN_SCRIPT = r"""
import os, threading, time
from rstar2_core.reward import GraderPool
pool = GraderPool(workers=1, timeout_s=600)
pool.start()
threading.Thread(target=pool.grade_many, args=([(r"\boxed{(10^{8})!}", "5")],), daemon=True).start()
while not any(w.busy for w in pool._workers):
    time.sleep(0.05)
print(pool._workers[0].proc.pid, flush=True)
time.sleep(0.5)
os._exit(0)  # the parent dies abruptly while its worker is deep in a hang
"""


def test_worker_dies_with_its_parent():
    import subprocess
    import sys

    import psutil

    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    with proc.stdout:  # not read to EOF: an orphaned worker would hold the pipe open
        pid = int(proc.stdout.readline())
        assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        psutil.Process(pid).kill()
        pytest.fail("the grader worker outlived its parent")


def test_workers_that_never_get_ready_are_a_retryable_infrastructure_error(monkeypatch):
    import rstar2_core.reward.pool as pool_mod
    from rstar2_core.errors import GraderUnavailable, InfraError

    # workers that start but never report ready (an overloaded node): the pool gives up after its start timeout
    monkeypatch.setattr(pool_mod, "_WORKER_CMD", "import time; time.sleep(60)")
    p = GraderPool(workers=1, timeout_s=1.0, start_timeout_s=1.0)
    try:
        with pytest.raises(GraderUnavailable, match="became ready within 1 s") as err:
            p.grade_many([(r"<answer>\boxed{1}</answer>", "1")])
        assert isinstance(err.value, InfraError)
    finally:
        p.close()
