"""Two DeepSpeed trainer shards as Ray actors (gloo, CPU, ZeRO-2 and ZeRO-3), started by RayRuntime with
engines and the sandbox, take one RL step that equals a single TorchBackend step on the whole batch, also
when the split over the ranks is forced uneven (one rank 5 trajectories, the other 1: the short rank pads
with zero-weight micro-batches, or it would hang in the next collective); the new weights reach an engine
actor through the object store; a killed trainer fails the next step with a retryable ActorFailure and
leaves no process behind."""

from __future__ import annotations

import random
import time

import deepspeed  # noqa: F401  (the code under test imports it: a missing install fails, never skips)
import psutil
import pytest
import torch

from rstar2_core.rollout.types import Trajectory
from rstar2_core.runtime.ray.sharding import micro_batches_per_rank, split_by_weight


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


def test_split_by_weight_balances_and_lets_a_rank_go_empty():
    trajs = _trajectories(7)
    w = lambda t: float(sum(t.loss_mask))
    parts = split_by_weight(trajs, 2, w)
    assert sorted(i for p in parts for i in p) == list(range(7)) and all(parts)
    loads = [sum(w(trajs[i]) for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(w(t) for t in trajs)
    eight = split_by_weight(trajs, 8, w)             # more ranks than work: some ranks get nothing
    assert sum(1 for p in eight if not p) == 1 and sorted(i for p in eight for i in p) == list(range(7))
    by_two = lambda p: -(-len(p) // 2)
    assert micro_batches_per_rank(eight, by_two) == 1 and micro_batches_per_rank([[0, 1, 2], [3]], by_two) == 2
    assert micro_batches_per_rank([[], []], by_two) == 1  # an empty step still runs one (padding) pass per rank


def test_padding_micro_batches_change_nothing_and_an_empty_rank_still_steps():
    """Zero-weight padding passes add nothing to the gradient; a rank with no trajectory runs them and
    takes the optimizer step with the others (here: one process standing in for each rank)."""
    from rstar2_core.models.backend import TorchBackend
    from rstar2_core.rl.trainer import rl_update

    trajs, adv = _trajectories(5), [1.0, -1.0, 0.5, -0.5, 1.5]
    a = TorchBackend(tiny_model(), lr=1e-2, total_steps=10, warmup_steps=0, schedule="constant")
    b = TorchBackend(tiny_model(), lr=1e-2, total_steps=10, warmup_steps=0, schedule="constant")
    ma = rl_update(a, trajs, adv, pad_id=0, micro_batch_size=2)
    mb = rl_update(b, trajs, adv, pad_id=0, micro_batch_size=2, num_micro_batches=6)
    assert mb["actor/micro_batches"] == 6 and ma["actor/micro_batches"] == 3
    assert mb["actor/grad_norm"] == pytest.approx(ma["actor/grad_norm"], rel=1e-6)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="num_micro_batches=2"):
        rl_update(b, trajs, adv, pad_id=0, micro_batch_size=2, num_micro_batches=2)
    c = TorchBackend(tiny_model(), lr=1e-2, total_steps=10, warmup_steps=0, schedule="constant")
    before = [p.detach().clone() for p in c.model.parameters()]
    mc = rl_update(c, [], [], pad_id=0, micro_batch_size=2, total_tokens=40.0, num_micro_batches=3)
    assert mc["actor/skipped"] == 0.0 and mc["actor/tokens"] == 0.0 and c.global_step == 1
    assert all(torch.equal(x, y) for x, y in zip(before, c.model.parameters()))


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


class _Tok:
    pad_token_id = eos_token_id = 0


def _ray_cfg(zero: int):
    from rstar2_core.config import load_config

    return load_config("tiny", ["rl.lr=1e-2", "rl.grad_clip=0.05", "rl.weight_decay=0.0", "rl.warmup_steps=0",
                                'cluster.runtime="ray"', 'rl.backend="deepspeed"', 'sft.backend="deepspeed"',
                                'sandbox.backend="ray"', "cluster.trainer_ranks=2", f"rl.zero_stage={zero}"])


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_two_shards_match_one_torch_step_even_or_not_and_sync_to_engines(ray_here, zero):
    """Through RayRuntime: trainers, engines and the sandbox placed per the layout; one RL step on two
    ZeRO ranks equals one TorchBackend step, for the balanced split and for a forced 5/1 split; weights
    reach the engine; a killed trainer fails the next step with ActorFailure and takes every actor and
    placement group down with it."""
    import asyncio

    from rstar2_core.models.backend import TorchBackend
    from rstar2_core.rl.trainer import RL_STEP, rl_update
    from rstar2_core.rollout.types import SamplingParams
    from rstar2_core.runtime import RuntimeSpec, TrainerSpec
    from rstar2_core.runtime.ray.errors import ActorFailure
    from rstar2_core.runtime.ray.placement import kill_and_wait
    from rstar2_core.runtime.ray.ray_runtime import RayRuntime

    cfg = _ray_cfg(zero)
    trajs, adv = _trajectories(6), [1.0, -1.0, 0.5, -0.5, 1.5, -1.5]
    ref = TorchBackend(tiny_model(), lr=1e-2, total_steps=10, warmup_steps=0, schedule="constant", grad_clip=0.05)
    ref_m = rl_update(ref, trajs, adv, pad_id=0, micro_batch_size=2)
    want = {k: v.clone() for k, v in ref.model.state_dict().items()}
    ref2_m = rl_update(ref, trajs, adv, pad_id=0, micro_batch_size=2)   # the reference's second step

    async def run():
        spec = RuntimeSpec.from_config(cfg, policy_url="unused", trainer=TrainerSpec("rl", 10, 0, "constant", RL_STEP),
                                       grader=False)
        async with RayRuntime(spec, model_factory=tiny_model, engine_factory=lambda i: SumEngine,
                              sandbox_factory=FakeSandbox, tokenizer=_Tok()) as rt:
            sandbox = rt.sandbox
            assert [(pg.id, i, c) for pg, i, c in sandbox.placements] == [(rt.group.pgs[0].id, 0, 1)]
            assert len(set(rt.trainer.pids)) == 2 and rt.trainer.world_size == 2
            m = rt.trainer.step(list(zip(trajs, adv)), pad_id=0, micro_batch_size=2)
            assert m["actor/grad_norm"] == pytest.approx(ref_m["actor/grad_norm"], rel=1e-4)
            assert m["actor/grad_norm"] > 0.05  # clipping was active
            assert m["actor/pg_loss"] == pytest.approx(ref_m["actor/pg_loss"], rel=1e-4, abs=1e-6)
            assert m["actor/tokens"] == ref_m["actor/tokens"]
            weights_ref, size = rt.trainer.weights_ref()
            import ray

            got = ray.get(weights_ref)
            assert size > 0 and set(got) == set(want)
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5)
            rep = rt.sync_weights()  # object_store: rank 0's ref goes to the engines
            assert rep.bytes == size and rep.mode == "object_store"
            total = float(sum(float(v.double().sum()) for v in want.values()))
            out = await rt.engines[0].generate([1], SamplingParams(max_new_tokens=1))
            assert out.token_ids[0] == pytest.approx(int(total * 1000) % 10_000, abs=1)
            # second step, forced uneven: rank 0 gets 5 trajectories (3 micro-batches), rank 1 gets 1 (pads 2)
            m2 = rt.trainer.step(list(zip(trajs, adv)), pad_id=0, micro_batch_size=2, split=[[0, 1, 2, 3, 4], [5]])
            assert m2["actor/micro_batches"] == 3
            assert m2["actor/grad_norm"] == pytest.approx(ref2_m["actor/grad_norm"], rel=1e-4)
            assert m2["actor/pg_loss"] == pytest.approx(ref2_m["actor/pg_loss"], rel=1e-4, abs=1e-6)
            got = ray.get(rt.trainer.weights_ref()[0])
            for k, v in ref.model.state_dict().items():
                torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5)
            # third step cut by a token budget (rows of <= 20 tokens): the ranks balance computed tokens,
            # each cuts its own share, both run the larger count; equal to one process's budgeted step
            ref3_m = rl_update(ref, trajs, adv, pad_id=0, micro_batch_size=2, max_tokens_per_micro_batch=20)
            m3 = rt.trainer.step(list(zip(trajs, adv)), pad_id=0, micro_batch_size=2, max_tokens_per_micro_batch=20)
            assert m3["actor/grad_norm"] == pytest.approx(ref3_m["actor/grad_norm"], rel=1e-4)
            assert m3["actor/pg_loss"] == pytest.approx(ref3_m["actor/pg_loss"], rel=1e-4, abs=1e-6)
            assert 1.0 <= m3["trainer/rank_balance"] < 1.5 and m3["actor/over_budget"] == 0
            got = ray.get(rt.trainer.weights_ref()[0])
            for k, v in ref.model.state_dict().items():
                torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5)
            pids = rt.trainer.pids
            assert len(pids) == 2 and all(_alive(p) for p in pids), pids   # what must end after the failure
            kill_and_wait(rt.trainer.actor(1))
            with pytest.raises(ActorFailure, match="trainer-1"):
                rt.trainer.step(list(zip(trajs, adv)), pad_id=0, micro_batch_size=2)
            assert rt.group.actors == {} and rt.group.pgs == []
            return pids, sandbox

    pids, sandbox = asyncio.run(run())
    deadline = time.time() + 15
    while any(_alive(p) for p in pids):
        assert time.time() < deadline, "a trainer process outlived the failure"
        time.sleep(0.2)
    assert sandbox.closed


def _packed_rows(n: int, seed: int = 0):
    from rstar2_core.sft.packing import IGNORE, PackedRow

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        T = 12 if i % 2 else 20
        ids = tuple(rng.randrange(1, 64) for _ in range(T))
        labels = tuple(x if rng.random() < 0.6 else IGNORE for x in ids)
        rows.append(PackedRow(ids, labels, tuple(range(T)), (0,) * T, 1, T))
    return rows


@pytest.mark.slow
def test_sft_on_two_shards_equals_one_process(ray_here):
    """SFT trains on the same shards: rows split by label tokens, a 3/1 row split pads the short rank, and
    the step equals one process's step on the whole batch (loss, grad norm, weights)."""
    import asyncio

    import ray

    from rstar2_core.models.backend import TorchBackend, backend_options
    from rstar2_core.runtime import RuntimeSpec, TrainerSpec
    from rstar2_core.runtime.ray.ray_runtime import RayRuntime
    from rstar2_core.sft.step import SFT_STEP, sft_update

    cfg = _ray_cfg(2)
    _SFT_TORCH = cfg.sft.model_copy(update={"backend": "torch"})   # the same optimizer settings, one process
    rows = _packed_rows(4)
    ref = TorchBackend(tiny_model(), **backend_options(_SFT_TORCH, cfg.model, total_steps=10, warmup_steps=0,
                                                       schedule="constant"))
    ref_m = sft_update(ref, rows, micro_batch_size=1, pad_id=0)

    async def run():
        spec = RuntimeSpec.from_config(cfg, policy_url="unused", trainer=TrainerSpec("sft", 10, 0, "constant", SFT_STEP),
                                       engines=False, sandbox=False, grader=False)
        async with RayRuntime(spec, model_factory=tiny_model, tokenizer=_Tok()) as rt:
            m = rt.trainer.step(rows, micro_batch_size=1, pad_id=0)
            return m, ray.get(rt.trainer.weights_ref()[0])

    m, got = asyncio.run(run())
    assert m["sft/loss"] == pytest.approx(ref_m["sft/loss_sum"] / ref_m["sft/label_tokens"], rel=1e-5)
    assert m["sft/grad_norm"] == pytest.approx(ref_m["sft/grad_norm"], rel=1e-4)
    assert m["sft/label_tokens"] == ref_m["sft/label_tokens"]
    for k, v in ref.model.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_the_kernel_check_runs_on_every_zero3_rank_and_leaves_the_step_exact(ray_here, monkeypatch):
    """The start-up kernel comparison (models/kernel_check.py) on two ZeRO-3 shards: both ranks run it (its
    forwards gather the partitioned layers collectively, the verdict is all-reduced), it passes, and the SFT
    step after it equals one process's step without it. The CPU has no flex backward: the candidate is
    `segments` itself, forced due, what the wiring needs."""
    import asyncio

    import ray

    from rstar2_core.config import load_config
    from rstar2_core.models import backend as backend_module
    from rstar2_core.models.backend import TorchBackend, backend_options
    from rstar2_core.runtime import RuntimeSpec, TrainerSpec
    from rstar2_core.runtime.ray.ray_runtime import RayRuntime
    from rstar2_core.sft.step import SFT_STEP, sft_update

    cfg = load_config("tiny", ['cluster.runtime="ray"', 'rl.backend="deepspeed"', 'sft.backend="deepspeed"',
                               'sandbox.backend="ray"', "cluster.trainer_ranks=2", "sft.zero_stage=3"])
    rows = _packed_rows(4)
    torch_sft = cfg.sft.model_copy(update={"backend": "torch", "zero_stage": 2})
    ref = TorchBackend(tiny_model(), **backend_options(torch_sft, cfg.model, total_steps=10, warmup_steps=0,
                                                       schedule="constant"))
    ref_m = sft_update(ref, rows, micro_batch_size=1, pad_id=0)
    monkeypatch.setattr(backend_module, "backend_options",
                        lambda *a, **kw: {**backend_options(*a, **kw), "kernel_check": True})

    async def run():
        spec = RuntimeSpec.from_config(cfg, policy_url="unused", trainer=TrainerSpec("sft", 10, 0, "constant", SFT_STEP),
                                       engines=False, sandbox=False, grader=False)
        async with RayRuntime(spec, model_factory=tiny_model, tokenizer=_Tok()) as rt:
            m = rt.trainer.step(rows, micro_batch_size=1, pad_id=0)
            again = rt.trainer.step(rows, micro_batch_size=1, pad_id=0)
            return m, again, ray.get(rt.trainer.weights_ref()[0])

    m, again, got = asyncio.run(run())
    assert m["sft/kernel_check_passed"] == 1.0 and m["sft/kernel_check_grad_norm"] > 0
    assert m["sft/kernel_check_loss_rel_diff"] == 0.0 and m["sft/kernel_check_grad_norm_rel_diff"] < 1e-6
    assert not any(k.startswith("sft/kernel_check") for k in again)
    assert m["sft/grad_norm"] == pytest.approx(ref_m["sft/grad_norm"], rel=1e-4)
    sft_update(ref, rows, micro_batch_size=1, pad_id=0)
    for k, v in ref.model.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5)


def test_production_backend_options_come_from_the_rl_config():
    from rstar2_core.config import load_config
    from rstar2_core.models.backend import backend_options

    cfg = load_config("qwen3-14b-mi300x")
    kw = backend_options(cfg.rl, cfg.model, total_steps=510, warmup_steps=cfg.rl.warmup_steps, schedule="constant")
    assert kw == {"zero_stage": 3, "lr": 1e-6, "total_steps": 510, "warmup_steps": 20, "schedule": "constant",
                  "weight_decay": 0.0, "betas": (0.9, 0.999), "grad_clip": 1.0, "min_lr_ratio": 0.0,
                  "micro_batch_size": 1, "gradient_checkpointing": True, "head_kernel": "auto",  # by tokens: a counter only
                  "attention_kernel": "auto", "hpz_partition_size": 8}
