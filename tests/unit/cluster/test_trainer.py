"""Two DeepSpeed ZeRO-2 trainer shards as Ray actors (gloo, CPU), started by StageRuntime with engines and
the sandbox, take one RL step that equals a single TorchBackend step on the whole batch, even with uneven
tokens per rank; the new weights reach an engine actor through the object store; a killed trainer fails
the next step with a retryable ActorFailure and leaves no process behind."""

from __future__ import annotations

import random
import time

import psutil
import pytest
import torch

pytest.importorskip("deepspeed")

from rstar2_core.cluster.layout import ClusterLayout, TrainerShard
from rstar2_core.cluster.trainer import split_by_tokens
from rstar2_core.rollout.types import Trajectory


def tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(11)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64)).float()


def _trajectories(n: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(3, 6), rng.randint(2, 3) if i % 3 else rng.randint(9, 12)  # uneven lengths
        mask = tuple(1 if rng.random() < 0.8 else 0 for _ in range(r))
        mask = (1,) + mask[1:]
        out.append(Trajectory(tuple(rng.randrange(64) for _ in range(p)), tuple(rng.randrange(64) for _ in range(r)),
                              mask, tuple(-1.0 * m for m in mask), "", (), 1, 0, "eos", False))
    return out


class SumEngine:
    def __init__(self):
        self.total = None

    def kv_capacity_tokens(self):
        return 1

    def update_weights(self, weights):
        self.total = float(sum(float(v.double().sum()) for v in weights.values()))

    async def generate(self, prompt_ids, params):
        from rstar2_core.rollout.types import GenerationOutput

        return GenerationOutput((int(self.total * 1000) % 10_000,), (0.0,), "length")

    async def close(self):
        pass


def test_split_by_tokens_balances_and_refuses_too_few():
    trajs = _trajectories(7)
    parts = split_by_tokens(trajs, 2)
    assert sorted(i for p in parts for i in p) == list(range(7)) and all(parts)
    loads = [sum(sum(trajs[i].loss_mask) for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(sum(t.loss_mask) for t in trajs)
    with pytest.raises(ValueError, match="cannot feed 8 trainer ranks"):
        split_by_tokens(trajs, 8)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class FakeSandbox:
    def __init__(self, cfg, placements):
        self.placements, self.closed = placements, False

    def close(self):
        self.closed = True


@pytest.mark.slow
def test_two_zero2_shards_match_one_torch_step_and_sync_to_engines(ray_here, kill_and_wait):
    """Through StageRuntime: trainers, engines and the sandbox placed per a layout; one RL step on two
    ZeRO-2 ranks equals one TorchBackend step; weights reach the engine; a killed trainer fails the
    next step with ActorFailure and takes every actor and placement group down with it."""
    import asyncio

    import ray

    from rstar2_core.cluster.errors import ActorFailure
    from rstar2_core.cluster.layout import Bundle, EngineSlot, PlacementGroupSpec, SandboxSlot
    from rstar2_core.cluster.runtime import StageRuntime
    from rstar2_core.config import load_config
    from rstar2_core.models.backend import TorchBackend
    from rstar2_core.rl.trainer import rl_update
    from rstar2_core.rollout.types import SamplingParams

    cfg = load_config("tiny", ["rl.lr=1e-2", "rl.grad_clip=0.05", "rl.weight_decay=0.0", "rl.warmup_steps=0",
                               "rl.backend=\"deepspeed\"", "rl.zero_stage=2"])
    trajs, adv = _trajectories(6), [1.0, -1.0, 0.5, -0.5, 1.5, -1.5]
    ref = TorchBackend(tiny_model(), lr=1e-2, total_steps=10, warmup_steps=0, schedule="constant", grad_clip=0.05)
    ref_m = rl_update(ref, trajs, adv, pad_id=0, micro_batch_size=2)

    layout = ClusterLayout("colocated", 1, 0, 2, (PlacementGroupSpec("t-rt-node0", 0, (Bundle(0, 1, "sandbox"),)),),
                           (EngineSlot(0, 0, (), 1, 0.0),),
                           (TrainerShard(0, 0, -1, 0.0), TrainerShard(1, 0, -1, 0.0)), (SandboxSlot(0, 0, 1),))
    rt = StageRuntime(cfg, policy_url="unused", max_model_len=64, total_steps=10, layout=layout,
                      model_factory=tiny_model, engine_factory=lambda i: SumEngine, sandbox_factory=FakeSandbox)
    sandbox = rt.sandbox
    try:
        assert [(pg.id, i, c) for pg, i, c in sandbox.placements] == [(rt.group.pgs[0].id, 0, 1)]
        assert len(set(rt.trainers.pids)) == 2
        m = rt.trainers.rl_update(trajs, adv, pad_id=0, micro_batch_size=2)
        assert m["actor/grad_norm"] == pytest.approx(ref_m["actor/grad_norm"], rel=1e-4)
        assert m["actor/grad_norm"] > 0.05  # clipping was active
        assert m["actor/pg_loss"] == pytest.approx(ref_m["actor/pg_loss"], rel=1e-4, abs=1e-6)
        assert m["actor/tokens"] == ref_m["actor/tokens"]
        weights_ref, size = rt.trainers.weights_ref()
        got, want = ray.get(weights_ref), ref.model.state_dict()
        assert size > 0 and set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
        rep = rt.sync_weights()  # cfg.rollout.weight_sync = state_dict: rank 0's ref goes to the engines
        assert rep.bytes == size and rep.mode == "state_dict"
        total = float(sum(float(v.double().sum()) for v in want.values()))
        out = asyncio.run(rt.engines[0].generate([1], SamplingParams(max_new_tokens=1)))
        assert out.token_ids[0] == pytest.approx(int(total * 1000) % 10_000, abs=1)
        pids = rt.trainers.pids
        kill_and_wait(ray, rt.group.actors["trainer-1"])
        with pytest.raises(ActorFailure, match="trainer-1"):
            rt.trainers.rl_update(trajs, adv, pad_id=0, micro_batch_size=2)
        assert rt.group.actors == {} and rt.group.pgs == []
        deadline = time.time() + 15
        while any(_alive(p) for p in pids):
            assert time.time() < deadline, "a trainer process outlived the failure"
            time.sleep(0.2)
    finally:
        rt.close()
    assert sandbox.closed and rt.sandbox is None


def test_production_backend_kwargs_come_from_the_rl_config():
    from rstar2_core.cluster.runtime import backend_kwargs
    from rstar2_core.config import load_config

    kw = backend_kwargs(load_config("qwen3-14b-mi300x"), total_steps=510)
    assert kw == {"zero_stage": 3, "lr": 1e-6, "total_steps": 510, "warmup_steps": 20, "schedule": "constant",
                  "weight_decay": 0.0, "betas": (0.9, 0.999), "grad_clip": 1.0, "micro_batch_size": 2,
                  "gradient_checkpointing": True}
