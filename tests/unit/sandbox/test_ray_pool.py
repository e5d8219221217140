"""The Ray actor pool: same answers as the local service, bounded in-flight per actor, a dead actor
replaced and its calls run again on the replacement (`internal` only when that fails too), grading on the
actors. Local Ray, 2 CPUs (slow)."""

from __future__ import annotations

import asyncio
import time
import uuid

import psutil
import pytest

from rstar2_core.config import SandboxConfig
from rstar2_core.sandbox import ExecutionRequest, Status

pytestmark = pytest.mark.slow


def small_cfg(**kw) -> SandboxConfig:
    return SandboxConfig(**{"workers": 2, "timeout_s": 2.0, "cpu_time_s": 4.0, "memory_mb": 256, **kw})


@pytest.fixture(scope="module")
def pool():
    from ray_local import local_ray_session

    from rstar2_core.runtime.ray.sandbox_pool import RaySandboxPool

    with local_ray_session("sbx"):
        p = RaySandboxPool(small_cfg(preload=["math"], backend="ray"), max_inflight_per_actor=3, chunk=2)
        yield p
        p.close()


def test_pool_answers_in_order_with_backpressure(pool):
    reqs = [ExecutionRequest(code=f"import time; time.sleep(0.05); print({i})", id=str(i)) for i in range(12)]
    reqs.append(ExecutionRequest(code=None, id="bad"))  # type: ignore[arg-type]
    res = asyncio.run(pool.run_batch(reqs))
    assert [r.id for r in res] == [str(i) for i in range(12)] + ["bad"]
    assert [r.stdout for r in res[:12]] == [f"{i}\n" for i in range(12)]
    assert res[-1].status is Status.INVALID_REQUEST
    assert 0 < pool.peak_inflight <= 3
    assert pool.run_sync(ExecutionRequest(code="1 + 1")).stdout == "2\n"


def test_a_dead_actors_calls_run_again_on_its_replacement_and_answer_internal_only_if_that_dies_too(pool,
                                                                                                  monkeypatch):
    import ray

    async def killed_mid_call():
        """Kill the actor running the call once the call's process exists (it names itself, seen from the
        host as in test_confinement), so the kill lands mid-call, not before it or after it."""
        name = "slow" + uuid.uuid4().hex[:8]
        code = (f"import ctypes, time\nctypes.CDLL(None).prctl(15, b'{name}', 0, 0, 0)\n"  # PR_SET_NAME
                "time.sleep(1.5)\nprint('ran')")
        task = asyncio.ensure_future(pool.run(ExecutionRequest(code=code, id="slow")))
        deadline = time.monotonic() + 30
        while not any(p.info["name"] == name for p in psutil.process_iter(["name"])):
            assert time.monotonic() < deadline and not task.done(), "the call's process never started"
            await asyncio.sleep(0.02)
        ray.kill(next(s for s in pool.slots if s.inflight).actor)
        return await task

    before = pool.replacements
    res = asyncio.run(killed_mid_call())
    assert res.status is Status.OK and res.stdout == "ran\n" and res.id == "slow"   # ran again, on the new actor
    assert pool.replacements == before + 1 and pool.retried == 1
    replace = pool._replace

    def replace_with_a_dead_one(s, gen):          # the replacement dies too: the call answers `internal`
        replace(s, gen)
        ray.kill(s.actor)

    monkeypatch.setattr(pool, "_replace", replace_with_a_dead_one)
    res = asyncio.run(killed_mid_call())
    assert res.status is Status.INTERNAL and res.id == "slow" and pool.retried == 2
    monkeypatch.undo()
    first = asyncio.run(pool.health())            # the health check finds the dead replacement, replaces it
    assert [h["healthy"] for h in first].count(False) == 1
    assert all(h["healthy"] for h in asyncio.run(pool.health()))
    assert pool.run_sync(ExecutionRequest(code="print('back')")).stdout == "back\n"


def test_grading_runs_on_the_actors(pool):
    out = asyncio.run(pool.grade_many([("<answer>\\boxed{42}</answer>", "42"), ("<answer>\\boxed{41}</answer>", "42")]))
    assert [g.reward for g in out] == [1.0, 0.0]


def test_pool_on_a_placement_group_bundle(pool):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from rstar2_core.runtime.ray.sandbox_pool import RaySandboxPool

    pg = placement_group([{"CPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    p2 = RaySandboxPool(small_cfg(preload=["math"], backend="ray", workers=0), placements=[(pg, 0, 1)])
    try:
        assert [s.workers for s in p2.slots] == [2]
        res = asyncio.run(p2.run_batch([ExecutionRequest(code="6 * 7", id="pg")]))
        assert (res[0].id, res[0].stdout) == ("pg", "42\n")
    finally:
        p2.close()
        remove_placement_group(pg)
