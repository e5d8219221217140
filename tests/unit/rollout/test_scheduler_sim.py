"""The scheduling simulator behind bench/scheduler.py, and the static allocation it shares with rollout_groups."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rstar2_core.rollout.scheduler import static_assignment

_BENCH = Path(__file__).resolve().parents[3] / "bench" / "scheduler.py"
_spec = importlib.util.spec_from_file_location("bench_scheduler", _BENCH)
sim = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sim            # dataclasses look their module up there
_path = list(sys.path)
_spec.loader.exec_module(sim)
sys.path[:] = _path                      # the bench puts bench/ first; keep it off the test session's path

COST = sim.Cost(a=0.01, b=0.001, c=2e-6, p=5e-4)


@given(st.integers(0, 500), st.integers(1, 16))
def test_static_assignment_is_contiguous_and_balanced(n_jobs, n_engines):
    a = static_assignment(n_jobs, n_engines)
    assert len(a) == n_jobs and a == sorted(a)                     # contiguous chunks, in engine order
    sizes = [a.count(k) for k in range(n_engines)]
    assert max(sizes) - min(sizes) <= 1


def test_static_assignment_keeps_groups_together():
    a = static_assignment(8 * 32, 8)                                # 8 engines, one group of 32 each
    assert all(len(set(a[g * 32:(g + 1) * 32])) == 1 for g in range(8))
    with pytest.raises(ValueError, match="at least one engine"):
        static_assignment(4, 0)


def test_workload_problem_share_correlates_a_group():
    together = sim.workload(64, 3000, 12288, 300, seed=1, group_size=8, problem_share=1.0)
    totals = [sum(t.turns) + (len(t.turns) - 1) * t.tool_tokens for t in together]
    for g in range(8):                                              # same length within a group (turn cuts aside)
        assert max(totals[g * 8:(g + 1) * 8]) - min(totals[g * 8:(g + 1) * 8]) <= 120 * 10
    apart = sim.workload(4000, 3000, 10 ** 9, 300, seed=1, group_size=8, problem_share=0.0)
    mean = statistics.mean(sum(t.turns) + (len(t.turns) - 1) * t.tool_tokens for t in apart)
    assert 2500 < mean < 3500                                       # lognormal with the asked mean
    with pytest.raises(ValueError, match="problem_share"):
        sim.workload(4, 3000, 12288, 300, seed=1, problem_share=1.5)


def test_kv_aware_never_recomputes_and_static_does_when_cache_overflows():
    trajs = sim.workload(8 * 40, 3000, 8192, 300, seed=3, group_size=8, problem_share=0.5)
    capacity = 6 * (300 + 8192)
    kv = sim.simulate(trajs, 8, capacity, 8192, COST, "kv_aware")
    st_ = sim.simulate(trajs, 8, capacity, 8192, COST, "static")
    assert kv["recomputed_tokens"] == 0
    assert st_["recomputed_tokens"] > 0                             # 40 per engine overflow 6 full-length sequences
    assert kv["makespan_s"] > 0 and st_["makespan_s"] > 0


def test_modes_agree_when_nothing_constrains_them():
    """One engine whose cache holds every trajectory at full length: both modes admit everything at once."""
    trajs = sim.workload(24, 2000, 4096, 300, seed=5, group_size=4, problem_share=0.3)
    capacity = 24 * (300 + 4096)
    kv = sim.simulate(trajs, 1, capacity, 4096, COST, "kv_aware")
    st_ = sim.simulate(trajs, 1, capacity, 4096, COST, "static")
    assert kv["makespan_s"] == pytest.approx(st_["makespan_s"])
    assert kv["recomputed_tokens"] == st_["recomputed_tokens"] == 0
