"""The asynchronous step scheduler (rl/pipelined.py) on stand-in rollouts and updates: the staleness bound,
weights pushed only while no batch is in flight and no update runs, rollouts overlapping updates, and
errors on either side stopping the other."""

import asyncio
import threading
import time

import pytest

from rstar2_core.rl.pipelined import StepPlan, run_pipelined
from rstar2_core.rl.step import Grades, RolledOut, StepOutcome
from rstar2_core.runtime.protocol import RuntimeUsage, WeightSyncReport


class _World:
    """A runtime whose engines and trainer only log what they do; every phase takes `phase_s`."""

    def __init__(self, phase_s=0.02, fail_rollout_at=None, fail_update_at=None, rollout_s=None):
        self.phase_s, self.fail_rollout_at, self.fail_update_at = phase_s, fail_rollout_at, fail_update_at
        self.rollout_s = rollout_s or phase_s
        self.log: list[tuple] = []
        self.rolling = self.updating = False
        self.engines_version = 0
        self.trainer_version = 0
        self.lock = threading.Lock()
        self.producer_cancelled = False

    def sync_weights(self, checkpoint_url=None):
        assert not self.rolling, "weights pushed while a batch was in flight"
        assert not self.updating, "weights pushed while an update ran"
        self.engines_version = self.trainer_version
        self.log.append(("push", self.engines_version))
        return WeightSyncReport("test", 10, 0.001, (0.001,))

    async def rollout(self, plan, version):
        assert version == self.engines_version
        self.rolling = True
        self.log.append(("rollout-start", plan.step, version))
        try:
            await asyncio.sleep(self.rollout_s)
            if plan.step == self.fail_rollout_at:
                raise ConnectionError(f"engine died rolling out batch {plan.step}")
        except asyncio.CancelledError:
            self.producer_cancelled = True
            raise
        finally:
            self.rolling = False
        self.log.append(("rollout-end", plan.step))
        usage = RuntimeUsage()
        return RolledOut((), [], Grades([], []), {}, self.phase_s, 0.0, usage, usage, version)

    def update(self, plan, rolled, staleness):
        self.updating = True
        self.log.append(("update-start", plan.step, staleness))
        try:
            time.sleep(self.phase_s)
            if plan.step == self.fail_update_at:
                raise ConnectionError(f"trainer shard died in step {plan.step}")
            self.trainer_version = plan.step
        finally:
            self.updating = False
        self.log.append(("update-end", plan.step))
        return StepOutcome({"rollout/staleness": float(staleness)}, True)


def _run(world: _World, k: int, n: int = 6, start: int = 0):
    plans = [StepPlan(s, (), 0) for s in range(start + 1, start + n + 1)]
    done: list = []

    async def nothing(plan):
        return None

    asyncio.run(run_pipelined(world, plans, max_staleness=k, start_version=start, rollout=world.rollout,
                              update=world.update, before_step=nothing,
                              after_step=lambda p, o: done.append((p.step, o.metrics))))
    return done


@pytest.mark.parametrize("k", [1, 2, 3])
def test_every_step_runs_once_in_order_within_the_bound(k):
    w = _World()
    done = _run(w, k)
    assert [s for s, _ in done] == [1, 2, 3, 4, 5, 6]
    stale = [m["rollout/staleness"] for _, m in done]
    assert stale[0] == 0 and max(stale) <= k and stale[1] == 1, stale
    starts = [e for e in w.log if e[0] == "update-start"]
    assert [e[1] for e in starts] == [1, 2, 3, 4, 5, 6]
    # a batch's recorded version is what the engines held while it rolled out
    rolled = {e[1]: e[2] for e in w.log if e[0] == "rollout-start"}
    assert all(s - 1 - rolled[s] == st for s, st in zip(range(1, 7), stale))


def test_the_next_rollout_runs_while_the_trainer_updates():
    w = _World()
    _run(w, 1)
    events = [e[:2] for e in w.log]
    # batch 2 is launched before step 1's update ends, and so on: the phases overlap
    for s in range(1, 6):
        assert events.index(("rollout-start", s + 1)) < events.index(("update-end", s)), (s, w.log)
    assert any(e[0] == "push" for e in w.log)


def test_a_resumed_schedule_starts_from_the_checkpoints_version():
    w = _World()
    w.engines_version = w.trainer_version = 3
    done = _run(w, 1, n=3, start=3)
    assert [s for s, _ in done] == [4, 5, 6] and done[0][1]["rollout/staleness"] == 0


def test_a_failed_rollout_stops_the_steps_with_its_error():
    w = _World(fail_rollout_at=3)
    with pytest.raises(ConnectionError, match="batch 3"):
        _run(w, 1)
    assert ("update-end", 2) in w.log and not any(e[:2] == ("update-start", 3) for e in w.log)


def test_a_failed_update_cancels_the_rollouts():
    w = _World(phase_s=0.01, rollout_s=0.5, fail_update_at=2)    # batch 3 is still rolling out when step 2 fails
    with pytest.raises(ConnectionError, match="step 2"):
        _run(w, 2)
    assert w.producer_cancelled and not w.rolling
    assert any(e[:2] == ("rollout-start", 3) for e in w.log) and ("rollout-end", 3) not in w.log


def test_the_bound_is_at_least_one():
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        asyncio.run(run_pipelined(_World(), [], max_staleness=0, start_version=0, rollout=None, update=None,
                                  before_step=None, after_step=None))
