"""Micro-batches by token budget: the cut (runtime/micro_batches.py) and the RL and SFT steps under it give
the gradient of the count-based step (fp32, tiny model, with and without a shared prefix)."""

import random

import pytest
import torch
from numerics import same_up_to_summation_order
from test_rl_trainer import GradCapture, tiny_model, traj

from rstar2_core.rl.trainer import cut_items, item_length, rl_update, trajectory_length
from rstar2_core.runtime.micro_batches import cut_micro_batches, over_budget
from rstar2_core.runtime.ray.sharding import rank_balance, split_by_weight
from rstar2_core.sft.packing import pack
from rstar2_core.sft.step import cut_rows, sft_update

PAD = 0


def test_budget_cut_places_every_item_once_under_the_budget():
    rng = random.Random(0)
    lengths = [rng.choice([rng.randint(5, 40), rng.randint(40, 120), 200]) for _ in range(60)]
    cut = cut_micro_batches(lengths, max_tokens=256, shared=16)
    assert sorted(i for mb in cut for i in mb) == list(range(60))
    assert all(mb == sorted(mb) for mb in cut)
    assert all(16 + sum(lengths[i] for i in mb) <= 256 for mb in cut)
    lower = -(-sum(lengths) // 240)                     # no cut under the budget has fewer micro-batches
    assert len(cut) <= 11 / 9 * lower + 1                  # first-fit-decreasing's bound
    assert max(sum(lengths[i] for i in mb) for mb in cut_micro_batches(lengths, size=4)) > 256  # a count doesn't bound it
    assert cut_micro_batches([300, 10, 20], max_tokens=100) == [[0], [1, 2]]   # too long alone: runs alone
    assert over_budget([300, 10, 20], 100) == 1 and over_budget([300], None) == 0
    assert cut_micro_batches([1, 2, 3], size=2) == [[0, 1], [2]] and cut_micro_batches([], max_tokens=9) == []
    with pytest.raises(ValueError, match="exactly one"):
        cut_micro_batches([1], size=2, max_tokens=8)


def _long_tailed(n=12, prefix=(1, 2, 3), seed=0):
    """Responses mostly short, a few at the 'cap' (24), as an RL stage's lengths are; prompts share `prefix`."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = 24 if i % 5 == 0 else rng.randint(1, 6)
        resp = [rng.randint(4, 63) for _ in range(r)]
        mask = [1 if rng.random() > 0.2 else 0 for _ in range(r)]
        mask[0] = 1
        out.append(traj(list(prefix) + [rng.randint(4, 63) for _ in range(rng.randint(1, 4))], resp, mask))
    return out


@pytest.mark.parametrize("prefix_len", [0, 3])
def test_rl_step_by_token_budget_equals_the_count_based_step(prefix_len):
    trajs = _long_tailed()
    adv = [float(a) for a in torch.linspace(-1.5, 2.0, len(trajs))]
    count, budget = GradCapture(tiny_model()), GradCapture(tiny_model())
    m_count = rl_update(count, trajs, adv, pad_id=PAD, micro_batch_size=4, prefix_len=prefix_len)
    m_budget = rl_update(budget, trajs, adv, pad_id=PAD, micro_batch_size=4, prefix_len=prefix_len,
                         max_tokens_per_micro_batch=40)
    assert m_budget["actor/micro_batches"] != m_count["actor/micro_batches"]      # a different cut
    assert m_budget["actor/over_budget"] == 0
    for n, g in count.grads.items():
        assert same_up_to_summation_order(budget.grads[n], g), n
        assert float((budget.grads[n] - g).abs().max()) <= 1e-5 * max(1.0, float(g.abs().max())), n
    for k in ("actor/pg_loss", "actor/ratio_mean", "actor/tokens"):
        assert m_budget[k] == pytest.approx(m_count[k], abs=1e-6), k


def test_rl_cut_counts_the_shared_prefix_once_and_pads_to_the_ranks_count():
    trajs = _long_tailed(prefix=(1, 2, 3))
    items = [(t, 1.0) for t in trajs]
    cut = cut_items(items, micro_batch_size=4, max_tokens_per_micro_batch=40, prefix_len=3)
    assert all(3 + sum(trajectory_length(trajs[i], 3) for i in mb) <= 40 for mb in cut)
    assert item_length(items[0]) == len(trajs[0].prompt_ids) + len(trajs[0].response_ids)
    backend = GradCapture(tiny_model())                        # a rank that must run as many passes as its peers
    m = rl_update(backend, trajs, [1.0] * len(trajs), pad_id=PAD, micro_batch_size=4, prefix_len=3,
                  max_tokens_per_micro_batch=40, num_micro_batches=len(cut) + 2)
    assert m["actor/micro_batches"] == len(cut) + 2
    with pytest.raises(ValueError, match="cut into"):
        rl_update(backend, trajs, [1.0] * len(trajs), pad_id=PAD, micro_batch_size=4, prefix_len=3,
                  max_tokens_per_micro_batch=40, num_micro_batches=len(cut) - 1)


def test_ranks_are_balanced_by_computed_tokens():
    trajs = _long_tailed(n=40, seed=3)
    items = [(t, 1.0) for t in trajs]
    size = [item_length(x) for x in items]
    by_length = split_by_weight(items, 4, lambda x: float(sum(x[0].loss_mask)), item_length)
    assert sorted(i for p in by_length for i in p) == list(range(40))
    assert rank_balance(by_length, size) <= 1.0 + max(size) / (sum(size) / 4)
    assert rank_balance([[0], []], size) == float("inf")


def _sft_rows():
    prefix = list(range(3, 23))                                   # a 20-token shared "system turn"
    rng = random.Random(1)
    docs = []
    for i in range(24):
        n = rng.choice([4, 6, 30])
        docs.append((prefix + [40 + (i + j) % 50 for j in range(n)], [0] * 22 + [1] * (n - 2)))
    return pack(docs, 64, pad_id=0, prefix=prefix)


def test_sft_step_by_token_budget_equals_the_count_based_step():
    import contextlib

    from transformers import Qwen2Config, Qwen2ForCausalLM

    class Capture(GradCapture):
        def autocast(self):
            return contextlib.nullcontext()

    def backend():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128))
        return Capture(model)

    rows = _sft_rows()
    cut = cut_rows(rows, micro_batch_size=2, max_tokens_per_micro_batch=96)
    assert len(rows) > 4 and cut != cut_rows(rows, micro_batch_size=2)
    count, budget = backend(), backend()
    m_count = sft_update(count, rows, micro_batch_size=2, pad_id=0)
    m_budget = sft_update(budget, rows, micro_batch_size=2, pad_id=0, max_tokens_per_micro_batch=96)
    for n, g in count.grads.items():
        assert same_up_to_summation_order(budget.grads[n], g), n
    assert m_budget["sft/loss_sum"] == pytest.approx(m_count["sft/loss_sum"], rel=1e-6)
    assert m_budget["sft/label_tokens"] == m_count["sft/label_tokens"]
