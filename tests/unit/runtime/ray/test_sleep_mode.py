"""`rollout.release_memory_during_training`: colocated vLLM engines sleep while the trainer steps.

- through the weight sync (the real `EngineActor` and `VLLMEngine` over the stand-in engine of
  tests/vllm_fake.py, called in process as Ray would call the actor): across a step the engines get
  `sleep(1)` before the optimizer step, then `wake_up(["weights"])` -> the transfer -> `wake_up(["kv_cache"])`;
  a step without an update wakes them fully; the flag off, nothing sleeps;
- through the RL step: `rl_step` runs the optimizer step and the sync inside `rt.training()`, after the
  rollout and grading, so the step itself does not know about vLLM.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from vllm_fake import FakeAsyncLLM, InProcessEngine, fake_checkpoint, install_fake_vllm

from rstar2_core.config import load_config

SLEEP_CFG = ["rollout.release_memory_during_training=true"]


class _Trainer:
    def __init__(self, log):
        self.log = log
        self.weights = {"w": torch.ones(2, 2)}

    def step(self):
        self.log.append("trainer.step")

    def weights_ref(self):
        return self.weights, 16


@pytest.fixture
def engines(monkeypatch, tmp_path):
    install_fake_vllm(monkeypatch)
    from rstar2_core.rollout.vllm_engine import VLLMEngine
    from rstar2_core.runtime.ray.engine_actors import EngineActor

    ckpt = fake_checkpoint(tmp_path)
    actors = [EngineActor(None, factory=lambda: VLLMEngine(ckpt, sleep_mode=True)) for _ in range(2)]
    shared: list = []
    for fake in FakeAsyncLLM.instances:        # one log across both engines and the trainer
        fake.events = shared
    yield [InProcessEngine(a, f"engine-{i}") for i, a in enumerate(actors)], shared
    for a in actors:
        asyncio.run(a.close())


def _sync(cfg, engines, log):
    from rstar2_core.runtime.ray.weight_sync import make_weight_sync

    spec = SimpleNamespace(release_memory_during_training=cfg.rollout.release_memory_during_training)
    return make_weight_sync("object_store", SimpleNamespace(spec=spec, engines=engines, trainer=_Trainer(log)))


def test_engines_sleep_through_the_trainer_step_and_wake_around_the_transfer(engines):
    engines, log = engines
    sync = _sync(load_config("qwen3-14b-mi300x", SLEEP_CFG), engines, log)
    from rstar2_core.runtime.ray.ray_runtime import RayRuntime

    rt = SimpleNamespace(weight_sync=sync)
    for _ in range(2):                          # two steps: the second sleeps again
        start = len(log)
        with RayRuntime.training(rt):           # what rl_step enters (the runtime hands it to its sync)
            sync.trainer.step()
            rep = sync.push()
        step = log[start:]
        assert step == [("sleep", 1)] * 2 + ["trainer.step"] + [("wake_up", ["weights"])] * 2 + [
            ("rpc", "rstar2_stage_safetensors"), ("rpc", "rstar2_load_staged"), "reset"] * 2 + [
            ("wake_up", ["kv_cache"])] * 2
        assert rep.bytes == 16 and not sync.asleep


def test_a_step_without_an_update_wakes_the_engines_fully(engines):
    engines, log = engines
    sync = _sync(load_config("qwen3-14b-mi300x", SLEEP_CFG), engines, log)
    with sync.training():
        sync.trainer.step()                      # actor/skipped: no push
    assert log == [("sleep", 1)] * 2 + ["trainer.step"] + [("wake_up", None)] * 2 and not sync.asleep
    with pytest.raises(RuntimeError), sync.training():      # a failing step leaves them asleep (teardown follows)
        raise RuntimeError("trainer rank died")
    assert log[-2:] == [("sleep", 1)] * 2 and sync.asleep


def test_without_the_setting_nothing_sleeps(engines):
    engines, log = engines
    sync = _sync(load_config("qwen3-14b-mi300x"), engines, log)
    with sync.training():
        sync.trainer.step()
        sync.push()
    assert log == ["trainer.step"] + [("rpc", "rstar2_stage_safetensors"), ("rpc", "rstar2_load_staged"),
                                      "reset"] * 2


# ------------------------------------------------------------------------------------------- rl_step
class _StepRuntime:
    """A `StageRuntime` that records when the RL step rolls out, grades, trains, syncs and enters/leaves
    `training()`."""

    weight_sync_mode = "object_store"

    def __init__(self, log, trajectories):
        from contextlib import contextmanager

        from rstar2_core.runtime.protocol import RuntimeUsage, WeightSyncReport

        self.log, self.engines, self.sandbox = log, [object()], None
        self.grader = SimpleNamespace(grade_many=self._grade)
        self.trainer = SimpleNamespace(world_size=1, step=self._step)
        self.usage = RuntimeUsage
        self.sync_weights = lambda url=None: (log.append("sync_weights"), WeightSyncReport("object_store", 1, 0.0))[1]

        @contextmanager
        def training():
            log.append("training:enter")
            yield
            log.append("training:exit")

        self.training = training
        self._n = len(trajectories)

    def _grade(self, items):
        self.log.append("grade")
        return [SimpleNamespace(reward=float(i % 2), reason="") for i in range(len(items))]

    def _step(self, items, **kw):
        self.log.append("trainer.step")
        return {"actor/skipped": 0.0, "actor/tokens": float(len(items))}


def test_rl_step_trains_and_syncs_inside_training_after_the_rollout(monkeypatch):
    from rstar2_core import rollout
    from rstar2_core.rl.step import rl_step
    from rstar2_core.rollout.types import Trajectory

    log: list = []
    cfg = load_config("tiny", ["rl.grpo.group_size=2", "rl.grpo.oversample=1"])
    group = [Trajectory((1, 2), (3, 4), (1, 1), (-0.1, -0.2), "x", (), 1, 1, "eos", False) for _ in range(2)]

    async def fake_rollout(*a, **kw):
        log.append("rollout")
        return [list(group)]

    monkeypatch.setattr(rollout, "rollout_groups", fake_rollout)
    rt = _StepRuntime(log, group)
    out = asyncio.run(rl_step(rt, SimpleNamespace(shared_prompt_len=0), [SimpleNamespace(problem="p", answer="1")],
                              rl=cfg.rl, rollout=cfg.rollout, limits=None, seed=0, pad_id=0))
    assert out.stepped
    assert log == ["rollout", "grade", "training:enter", "trainer.step", "sync_weights", "training:exit"]
