"""Two DeepSpeed ZeRO-2 trainer shards as Ray actors (gloo, CPU) take one RL step that equals a single
TorchBackend step on the whole batch, even with uneven tokens per rank; the new weights then reach an
engine actor through the object store."""

from __future__ import annotations

import random

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


@pytest.mark.slow
def test_two_zero2_shards_match_one_torch_step_and_sync_to_engines(ray_here):
    from rstar2_core.cluster.engines import start_engines, sync_weights
    from rstar2_core.cluster.layout import EngineSlot
    from rstar2_core.cluster.placement import ActorGroup
    from rstar2_core.cluster.trainer import TrainerGroup
    from rstar2_core.models.backend import TorchBackend
    from rstar2_core.rl.trainer import rl_update

    trajs, adv = _trajectories(6), [1.0, -1.0, 0.5, -0.5, 1.5, -1.5]
    kw = dict(lr=1e-2, total_steps=10, warmup_steps=0, schedule="constant", grad_clip=0.05)  # clip active
    ref = TorchBackend(tiny_model(), **kw)
    ref_m = rl_update(ref, trajs, adv, pad_id=0, micro_batch_size=2)

    layout = ClusterLayout("colocated", 1, 0, 2, (), (EngineSlot(0, 0, (), 1, 0.0),),
                           (TrainerShard(0, 0, -1, 0.0), TrainerShard(1, 0, -1, 0.0)), ())
    with ActorGroup(None) as group:
        trainers = TrainerGroup(group, layout, tiny_model, dict(zero_stage=2, **kw))
        assert len(set(trainers.pids)) == 2
        m = trainers.rl_update(trajs, adv, pad_id=0, micro_batch_size=2)
        assert m["actor/grad_norm"] == pytest.approx(ref_m["actor/grad_norm"], rel=1e-4)
        assert m["actor/grad_norm"] > kw["grad_clip"]
        assert m["actor/pg_loss"] == pytest.approx(ref_m["actor/pg_loss"], rel=1e-4, abs=1e-6)
        assert m["actor/tokens"] == ref_m["actor/tokens"]
        weights_ref, size = trainers.weights_ref()
        import ray

        got = ray.get(weights_ref)
        want = ref.model.state_dict()
        assert size > 0 and set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
        engines = start_engines(group, layout, factory=lambda i: SumEngine)
        rep = sync_weights(engines, (weights_ref, size))
        assert rep.bytes == size
        total = float(sum(float(v.double().sum()) for v in want.values()))
        import asyncio

        from rstar2_core.rollout.types import SamplingParams

        out = asyncio.run(engines[0].generate([1], SamplingParams(max_new_tokens=1)))
        assert out.token_ids[0] == pytest.approx(int(total * 1000) % 10_000, abs=1)
