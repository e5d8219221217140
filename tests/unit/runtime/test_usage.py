"""Where a step's time goes: device-seconds and idle fractions by role from the runtimes' busy counters,
sandbox calls (only those the sandbox ran) with their CPU, tokens generated vs trained, and stage totals."""

from __future__ import annotations

import pytest

from rstar2_core.rollout.types import ToolCallRecord, Trajectory
from rstar2_core.runtime.protocol import RuntimeUsage
from rstar2_core.runtime.usage import accumulate, step_usage_metrics


def _traj(gen: int, calls=()) -> Trajectory:
    return Trajectory((1,), (2,) * (gen + 1), (1,) * gen + (0,), (0.0,) * (gen + 1), "", tuple(calls), 1, 0, "eos",
                      False)


def test_step_usage_by_role():
    ok = ToolCallRecord("python", "ok", False, duration_s=0.2, cpu_s=0.1)
    slow = ToolCallRecord("python", "error", True, duration_s=0.6, cpu_s=0.5)
    unparsed = ToolCallRecord(None, "invalid_json", True)             # never reached the sandbox
    killed = ToolCallRecord("python", "timeout", True, duration_s=4.0, cpu_s=0.1)
    groups = [[_traj(10, [ok]), _traj(30, [slow, unparsed])], [_traj(60, [killed])]]
    before = RuntimeUsage((1.0, 2.0), 2, (5.0, 5.0))
    after_rollout = RuntimeUsage((4.0, 3.0), 2, (5.0, 5.0))         # engines busy 3 + 1 s during the rollout
    after_train = RuntimeUsage((4.0, 3.0), 2, (6.0, 5.5))           # ranks busy 1 + 0.5 s during the update
    m = step_usage_metrics(before, after_rollout, after_train, {"rollout": 4.0, "train": 2.0}, groups,
                           kept=[groups[0][1]], n_trainer_ranks=2)
    assert m["usage/engine_device_s"] == 2 * 2 * 4.0 and m["usage/engine_busy_s"] == (3 + 1) * 2
    assert m["usage/engine_idle_frac"] == pytest.approx(0.5)
    assert m["usage/trainer_device_s"] == 4.0 and m["usage/trainer_idle_frac"] == pytest.approx(1 - 1.5 / 4)
    assert m["usage/sandbox_calls"] == 3 and m["usage/sandbox_call_s"] == pytest.approx(4.8)
    assert m["usage/sandbox_cpu_s"] == pytest.approx(0.7) and m["usage/sandbox_p99_ms"] == pytest.approx(4000)
    assert m["usage/sandbox_timeouts"] == 1
    assert (m["usage/tokens_generated"], m["usage/tokens_trained"]) == (100.0, 30.0)
    assert m["usage/trained_share"] == pytest.approx(0.3)


def test_totals_sum_over_steps_and_derive_their_ratios():
    a = {"usage/engine_device_s": 10.0, "usage/engine_busy_s": 5.0, "usage/tokens_generated": 100.0,
         "usage/tokens_trained": 50.0, "sync/bytes": 8.0, "rollout/pass_rate": 0.5}
    t = accumulate(accumulate({}, a), {**a, "usage/engine_busy_s": 9.0})
    assert t["total/usage/engine_device_s"] == 20.0 and t["total/sync/bytes"] == 16.0
    assert t["total/usage/engine_idle_frac"] == pytest.approx(1 - 14 / 20)
    assert t["total/usage/trained_share"] == pytest.approx(0.5) and "total/rollout/pass_rate" not in t
