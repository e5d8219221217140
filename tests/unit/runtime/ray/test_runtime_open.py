"""RayRuntime's process-wide `_OPEN` lock and teardown: a constructor that fails after taking the lock
releases it, so the Prefect retry of the task in the same process does not wait forever; a cleanup step
that fails (a sandbox pool's close) neither skips the actors' shutdown nor the lock's release, nor
replaces the error being raised; an engine that never answers its close does not hold the teardown; the
remote model reaches the nodes before any actor starts.
No Ray needed: the failures happen before (or instead of) `ray.init`, or Ray's parts are stand-ins."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import ClassVar

import pytest

from rstar2_core.config import load_config
from rstar2_core.runtime import RuntimeSpec

RAY = ['cluster.runtime="ray"', 'rl.backend="deepspeed"', 'sft.backend="deepspeed"', 'sandbox.backend="ray"']


def _flaky_tokenizer(url):
    raise OSError(f"S3 503 SlowDown while reading {url}/tokenizer.json")


def _no_ray(cfg):
    raise ConnectionError("Ray head unreachable")


@pytest.mark.parametrize("where", ["tokenizer", "ensure_ray"])
def test_failed_constructor_releases_the_open_lock(monkeypatch, where):
    from rstar2_core.models import io
    from rstar2_core.runtime.ray import ray_runtime as rtmod

    if where == "tokenizer":
        monkeypatch.setattr(io, "load_tokenizer", _flaky_tokenizer)
        kwargs, err = {}, OSError
    else:
        monkeypatch.setattr(rtmod, "ensure_ray", _no_ray)
        kwargs, err = {"tokenizer": object()}, ConnectionError
    cfg = load_config("tiny", RAY)
    assert not rtmod._OPEN.locked()
    try:
        for _ in range(2):   # the retry in the same process fails the same way instead of blocking forever
            with pytest.raises(err):
                rtmod.RayRuntime(RuntimeSpec.from_config(cfg, policy_url="s3://bucket/ckpt", engines=False,
                                                         sandbox=False, grader=False), **kwargs)
            assert not rtmod._OPEN.locked(), "the failed constructor left _OPEN held"
    finally:
        if rtmod._OPEN.locked():     # a leak must fail this test, not hang the next runtime test
            rtmod._OPEN.release()


class _Group:
    """Stands in for ActorGroup (no Ray): counts its shutdowns."""

    made: ClassVar[list[_Group]] = []

    def __init__(self, layout, *, timeout_s, prefix, node_death_wait_s):
        self.shutdowns = 0
        _Group.made.append(self)

    def pg(self, node):
        return None

    def shutdown(self):
        self.shutdowns += 1


class _FailingSandbox:
    """A sandbox pool whose close raises (RaySandboxPool.close lets a RayTaskError of an actor's close through)."""

    def close(self):
        raise RuntimeError("sandbox actor 1: close raised")


class _EngineThatNeverCloses:
    """An engine actor handle stuck in a call that never returns (NCCL with a dead peer): close is never answered."""

    close = SimpleNamespace(remote=lambda: asyncio.sleep(3600))


@pytest.fixture
def offline(monkeypatch):
    """(runtime module, config, open(**kwargs) -> RayRuntime) with Ray's parts stood in for; `_OPEN` is
    released at the end if a test left it held (a leak must fail that test, not hang the next one)."""
    from rstar2_core.runtime.ray import ray_runtime as rtmod

    monkeypatch.setattr(rtmod, "ensure_ray", lambda cfg: None)
    monkeypatch.setattr(rtmod, "ActorGroup", _Group)
    monkeypatch.setattr(rtmod, "holds_runtime_slot", lambda: False)     # both ask a live Ray
    monkeypatch.setattr(rtmod, "remove_stale_runtime_groups", lambda prefix, holds_slot: [])
    monkeypatch.setattr(rtmod, "_refuse_node_local_storage", lambda: None)   # reads ray.nodes()
    monkeypatch.setattr(rtmod, "prefetch_models", lambda group, needs, timeout_s: {})   # Ray tasks per node
    cfg = load_config("tiny", RAY)

    def open_(**kwargs):
        kwargs = {"engines": False, "grader": False, "tokenizer": object(), **kwargs}
        builders = {k: kwargs.pop(k) for k in ("tokenizer", "sandbox_factory", "engine_factory", "model_factory")
                    if k in kwargs}
        return rtmod.RayRuntime(RuntimeSpec.from_config(cfg, policy_url="s3://bucket/ckpt", **kwargs), **builders)

    assert not rtmod._OPEN.locked()
    yield rtmod, open_
    if rtmod._OPEN.locked():
        rtmod._OPEN.release()


def test_a_failing_sandbox_close_still_shuts_the_actors_down_and_releases_the_lock(offline):
    rtmod, open_ = offline
    for _ in range(2):            # the retry in the same process opens the next runtime instead of waiting
        rt = open_(sandbox_factory=lambda sandbox_cfg, placements: _FailingSandbox())
        with pytest.raises(RuntimeError, match="close raised"):
            asyncio.run(rt.aclose())
        assert _Group.made[-1].shutdowns == 1, "the sandbox's close error skipped the actors' shutdown"
        assert not rtmod._OPEN.locked()


def test_a_failing_cleanup_does_not_replace_the_error_being_raised(offline, monkeypatch):
    from rstar2_core.runtime.protocol import TrainerSpec
    from rstar2_core.runtime.ray.errors import ActorFailure

    rtmod, open_ = offline

    async def body():
        async with open_(sandbox_factory=lambda sandbox_cfg, placements: _FailingSandbox()):
            raise ActorFailure("engine-0", "killed")

    with pytest.raises(ActorFailure):          # retryable; the sandbox's RuntimeError would not be
        asyncio.run(body())
    assert _Group.made[-1].shutdowns == 1 and not rtmod._OPEN.locked()
    # the constructor's error, raised after the sandbox pool started, stays the one raised
    monkeypatch.setattr(rtmod, "TrainerGroup", lambda *args, **kwargs: SimpleNamespace())
    monkeypatch.setattr(rtmod, "start_engines", lambda *args, **kwargs: [])

    def bad_sync(mode, rt):
        raise ValueError("rollout.weight_sync: no such backend here")

    monkeypatch.setattr(rtmod, "make_weight_sync", bad_sync)
    with pytest.raises(ValueError, match="no such backend here"):
        open_(trainer=TrainerSpec("rl", 10, 0, "constant", None), engines=True, engine_factory=object(),
              sandbox_factory=lambda sandbox_cfg, placements: _FailingSandbox())
    assert _Group.made[-1].shutdowns == 1 and not rtmod._OPEN.locked()


def test_an_engine_that_never_answers_its_close_does_not_hold_the_teardown(offline, monkeypatch):
    from rstar2_core.runtime.ray import engine_actors as engines
    from rstar2_core.runtime.ray.engine_actors import RemoteEngine

    rtmod, open_ = offline
    monkeypatch.setattr(engines, "CLOSE_TIMEOUT_S", 0.5)
    stuck = [RemoteEngine(_EngineThatNeverCloses(), f"engine-{i}") for i in range(2)]
    monkeypatch.setattr(rtmod, "start_engines", lambda *args, **kwargs: stuck)
    rt = open_(engines=True, engine_factory=object(), sandbox=False)
    asyncio.run(asyncio.wait_for(rt.aclose(), 10))       # 0.5 s for both engines at once, then the kill
    assert _Group.made[-1].shutdowns == 1 and not rtmod._OPEN.locked()


def test_the_remote_model_reaches_the_nodes_before_any_actor_starts(offline, monkeypatch):
    """The download is bounded by cluster.model_download_timeout_s, apart from the placement timeout that
    the trainer shards and engines are then started under (they load from the node's cache)."""
    from rstar2_core.runtime.protocol import TrainerSpec

    rtmod, open_ = offline
    calls = []
    monkeypatch.setattr(rtmod, "prefetch_models", lambda group, needs, timeout_s: calls.append(
        ("prefetch", {u for urls in needs.values() for u in urls}, timeout_s)) or {})
    monkeypatch.setattr(rtmod, "TrainerGroup", lambda *a, **k: calls.append(("trainer", k["ready_timeout_s"])))
    monkeypatch.setattr(rtmod, "start_engines", lambda *a, **k: calls.append(("engines",)) or [])
    monkeypatch.setattr(rtmod, "make_weight_sync", lambda mode, rt: None)
    cfg = load_config("tiny", RAY)
    asyncio.run(open_(trainer=TrainerSpec("rl", 10, 0, "constant", None), sandbox=False).aclose())
    assert calls[0] == ("prefetch", {"s3://bucket/ckpt"}, cfg.cluster.model_download_timeout_s)
    assert calls[1] == ("trainer", cfg.cluster.placement_timeout_s)
    calls.clear()
    asyncio.run(open_(trainer=TrainerSpec("rl", 10, 0, "constant", None), sandbox=False,
                      model_factory=object).aclose())
    assert calls[0][0] == "trainer"                    # a model built in the actor: nothing to download
