"""The engine simulation behind bench/scheduler.py (bench/engine_sim.py: a benchmark's model, not part of
the package): its engine model, its workloads, and that it drives the core's policies the way
`rollout_groups` does."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rstar2_core.rollout.admission import KVAdmission, StaticAdmission, static_assignment
from rstar2_core.rollout.length_model import LengthModel


def _engine_sim():
    path = Path(__file__).resolve().parents[3] / "bench" / "engine_sim.py"
    spec = importlib.util.spec_from_file_location("engine_sim", path)
    mod = sys.modules.setdefault("engine_sim", importlib.util.module_from_spec(spec))
    if not hasattr(mod, "simulate"):
        spec.loader.exec_module(mod)
    return mod


_sim = _engine_sim()
Cost, SimTrajectory, simulate, workload = _sim.Cost, _sim.SimTrajectory, _sim.simulate, _sim.workload

COST = Cost(a=0.01, b=0.001, c=2e-6, p=5e-4)


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
    together = workload(64, 3000, 12288, 300, seed=1, group_size=8, problem_share=1.0)
    totals = [t.response_tokens for t in together]
    for g in range(8):                                              # same length within a group (turn cuts aside)
        assert max(totals[g * 8:(g + 1) * 8]) - min(totals[g * 8:(g + 1) * 8]) <= 120 * 10
    assert [t.group for t in together[:9]] == [0] * 8 + [1]
    apart = workload(4000, 3000, 10 ** 9, 300, seed=1, group_size=8, problem_share=0.0)
    assert 2500 < statistics.mean(t.response_tokens for t in apart) < 3500   # lognormal with the asked mean
    with pytest.raises(ValueError, match="problem_share"):
        workload(4, 3000, 12288, 300, seed=1, problem_share=1.5)


def test_one_trajectory_costs_its_prefill_decode_steps_and_tool_waits():
    tr = SimTrajectory(0, 0, prompt=100, turns=[40, 60], tools=[0.5], tool_tokens=20)
    res = simulate([tr], StaticAdmission(1), 1, 10_000, COST)
    expect = (COST.p * 100 + COST.steps(40, 1, 100)            # prompt, first turn
              + 0.5                                            # tool
              + COST.p * 20 + COST.steps(60, 1, 160))          # tool response, second turn
    assert res.makespan_s == pytest.approx(expect)
    assert res.recomputed_tokens == res.evictions == res.preemptions == 0


class Recorder:
    """Wraps a policy and records the calls the simulation makes."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.stats = inner.stats

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*args):
            out = fn(*args)
            if name in ("begin_turn", "end_turn", "release"):
                self.calls.append((name, *args))
            return out
        return call


def test_drives_the_policy_with_turn_boundaries_as_rollout_groups_does():
    tr = SimTrajectory(0, 0, prompt=100, turns=[40, 60], tools=[0.5], tool_tokens=20)
    pol = Recorder(KVAdmission([10_000], max_response_tokens=200))
    simulate([tr], pol, 1, 10_000, COST)
    assert pol.calls == [("end_turn", 0, 140), ("begin_turn", 0, 160), ("end_turn", 0, 220), ("release", 0, 220)]
    assert pol.inner.lengths.n_observed == 1                   # the finished length reached the model


def test_kv_aware_never_recomputes_and_static_does_when_cache_overflows():
    trajs = workload(8 * 40, 3000, 8192, 300, seed=3, group_size=8, problem_share=0.5)
    capacity = 6 * (300 + 8192)
    kv = simulate(trajs, KVAdmission([capacity] * 8, max_response_tokens=8192), 8, capacity, COST)
    paper = simulate(trajs, KVAdmission([capacity] * 8, max_response_tokens=8192, reserve="max"), 8, capacity, COST)
    st_ = simulate(trajs, StaticAdmission(8), 8, capacity, COST)
    assert kv.recomputed_tokens == paper.recomputed_tokens == 0
    assert st_.recomputed_tokens > 0 and st_.evictions + st_.preemptions > 0   # 40 per engine overflow 6 full ones
    assert kv.mean_batch > paper.mean_batch                     # learnt lengths run more at once than max reservations


def test_a_warm_length_model_admits_more_at_once():
    trajs = workload(4 * 64, 2000, 8192, 300, seed=4, group_size=8, problem_share=0.25)
    capacity = 8 * (300 + 8192)
    warm = LengthModel(8192)
    for t in workload(4 * 64, 2000, 8192, 300, seed=40, group_size=8, problem_share=0.25):
        warm.observe(t.response_tokens)
    cold = simulate(trajs, KVAdmission([capacity] * 4, max_response_tokens=8192), 4, capacity, COST)
    hot = simulate(trajs, KVAdmission([capacity] * 4, max_response_tokens=8192, lengths=warm), 4, capacity, COST)
    assert hot.mean_batch > cold.mean_batch and hot.recomputed_tokens == 0


def test_modes_agree_when_nothing_constrains_them():
    """One engine whose cache holds every trajectory at full length: both policies start everything at once."""
    trajs = workload(24, 2000, 4096, 300, seed=5, group_size=4, problem_share=0.3)
    capacity = 24 * (300 + 4096)
    kv = simulate(trajs, KVAdmission([capacity], max_response_tokens=4096), 1, capacity, COST)
    st_ = simulate(trajs, StaticAdmission(1), 1, capacity, COST)
    assert kv.makespan_s == pytest.approx(st_.makespan_s)
    assert kv.recomputed_tokens == st_.recomputed_tokens == 0
