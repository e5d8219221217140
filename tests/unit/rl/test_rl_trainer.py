"""The RL update: log-probs against a naive forward, micro-batch accumulation, direction of the step."""

import pytest
import torch
from numerics import same_up_to_summation_order
from transformers import Qwen2Config, Qwen2ForCausalLM

from rstar2_core.models.backend import TorchBackend
from rstar2_core.rl.trainer import collate, rl_update, sequence_logprobs
from rstar2_core.rollout.types import Trajectory

PAD = 0


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def traj(prompt, response, mask=None, logprobs=None):
    mask = mask or [1] * len(response)
    return Trajectory(prompt_ids=tuple(prompt), response_ids=tuple(response), loss_mask=tuple(mask),
                      logprobs=tuple(logprobs or [0.0] * len(response)), response_text="", tool_calls=(),
                      n_turns=1, n_answer_blocks=1, finish="answer", truncated=False)


def naive_logprobs(model, t, temperature):
    ids = torch.tensor([list(t.prompt_ids + t.response_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0] / temperature
    lp = torch.log_softmax(logits, -1)
    P = len(t.prompt_ids)
    return torch.stack([lp[P - 1 + j, tok] for j, tok in enumerate(t.response_ids)])


TRAJS = [traj([5, 6, 7], [8, 9, 10, 11]), traj([5], [12, 13], [1, 0]), traj([3, 4, 5, 6, 7, 8], [9]),
         traj([9, 9], [20, 21, 22, 23, 24, 25], [1, 1, 0, 0, 1, 1])]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sequence_logprobs_match_unpadded_forward(temperature):
    model = tiny_model()
    got = sequence_logprobs(model, TRAJS, PAD, temperature=temperature, micro_batch_size=3)
    for t, g in zip(TRAJS, got):
        assert torch.allclose(g, naive_logprobs(model, t, temperature), atol=1e-5)


def test_collate_rejects_inconsistent_trajectory():
    bad = Trajectory(prompt_ids=(1,), response_ids=(2, 3), loss_mask=(1,), logprobs=(0.0, 0.0), response_text="",
                     tool_calls=(), n_turns=1, n_answer_blocks=0, finish="eos", truncated=False)
    with pytest.raises(ValueError, match="different lengths"):
        collate([bad], PAD)


class GradCapture:
    """A TrainBackend that records the accumulated gradient instead of stepping."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        return 0.0


def test_micro_batches_accumulate_the_full_batch_token_mean():
    adv = [1.0, -0.5, 2.0, -1.5]
    full = GradCapture(tiny_model())
    m_full = rl_update(full, TRAJS, adv, pad_id=PAD, micro_batch_size=4)
    micro = GradCapture(tiny_model())
    m_micro = rl_update(micro, TRAJS, adv, pad_id=PAD, micro_batch_size=1)
    for n, g in full.grads.items():
        assert same_up_to_summation_order(micro.grads[n], g), n     # the micro-batches sum in another order
    assert m_full["actor/tokens"] == 4 + 1 + 1 + 4
    assert m_micro["actor/pg_loss"] == pytest.approx(m_full["actor/pg_loss"], abs=1e-6)
    # ratio is exactly 1 with recomputed old log-probs: on-policy, nothing clipped
    assert m_full["actor/pg_clipfrac"] == 0 and m_full["actor/ratio_mean"] == pytest.approx(1.0)


def test_engine_logprob_gap_reports_mismatch():
    model = tiny_model()
    true_lp = naive_logprobs(model, TRAJS[0], 1.0).tolist()
    exact = GradCapture(model)
    m = rl_update(exact, [traj([5, 6, 7], [8, 9, 10, 11], logprobs=true_lp)], [1.0], pad_id=PAD)
    assert m["actor/engine_logprob_gap"] < 1e-5
    off = [x - 0.3 for x in true_lp]
    m = rl_update(GradCapture(model), [traj([5, 6, 7], [8, 9, 10, 11], logprobs=off)], [1.0], pad_id=PAD)
    assert m["actor/engine_logprob_gap"] == pytest.approx(0.3, abs=1e-4)
    assert m["actor/ratio_mean"] == pytest.approx(1.0)
    # with the engine's log-probs as old_logprobs the ratio carries the mismatch
    m = rl_update(GradCapture(model), [traj([5, 6, 7], [8, 9, 10, 11], logprobs=off)], [1.0], pad_id=PAD,
                  old_logprobs="engine")
    assert m["actor/engine_logprob_gap"] == pytest.approx(0.3, abs=1e-4)        # from the gradient forward
    assert m["actor/engine_logprob_gap_max"] == pytest.approx(0.3, abs=1e-4)
    assert m["actor/ratio_mean"] == pytest.approx(torch.exp(torch.tensor(0.3)).item(), rel=1e-4)
    # one token far off: the max shows it where the mean dilutes it
    spiky = list(true_lp)
    spiky[2] -= 2.0
    m = rl_update(GradCapture(model), [traj([5, 6, 7], [8, 9, 10, 11], logprobs=spiky)], [1.0], pad_id=PAD)
    assert m["actor/engine_logprob_gap_max"] == pytest.approx(2.0, abs=1e-4)
    assert m["actor/engine_logprob_gap"] == pytest.approx(2.0 / 4, abs=1e-4)
    with pytest.raises(ValueError, match="recompute"):
        rl_update(GradCapture(model), TRAJS[:1], [1.0], pad_id=PAD, old_logprobs="vllm")


def test_rl_step_moves_policy_toward_positive_advantage():
    model = tiny_model()
    good, bad = traj([1, 2, 3], [10, 11, 12]), traj([1, 2, 3], [20, 21, 22])
    before = [naive_logprobs(model, t, 1.0).sum().item() for t in (good, bad)]
    backend = TorchBackend(model, lr=1e-2, total_steps=10, schedule="constant")
    for _ in range(3):
        m = rl_update(backend, [good, bad], [1.0, -1.0], pad_id=PAD)
    after = [naive_logprobs(model, t, 1.0).sum().item() for t in (good, bad)]
    assert after[0] > before[0] + 0.5 and after[1] < before[1] - 0.5
    assert m["actor/grad_norm"] > 0 and m["actor/lr"] == pytest.approx(1e-2)


def test_masked_tool_tokens_get_no_gradient_signal():
    # the only sampled token is the first one; changing the masked tokens must not change the gradient
    a = GradCapture(tiny_model())
    rl_update(a, [traj([1, 2], [5, 6, 7], [1, 0, 0])], [1.0], pad_id=PAD)
    b = GradCapture(tiny_model())
    rl_update(b, [traj([1, 2], [5, 30, 31], [1, 0, 0])], [1.0], pad_id=PAD)
    for n, g in a.grads.items():
        assert torch.allclose(b.grads[n], g, atol=1e-6), n


def test_no_sampled_tokens_skips_the_step():
    cap = GradCapture(tiny_model())
    m = rl_update(cap, [traj([1], [2, 3], [0, 0])], [1.0], pad_id=PAD)
    assert m["actor/skipped"] == 1.0 and cap.grads is None


def test_tis_in_engine_mode_ratios_against_the_trainer_and_weights_by_the_engine():
    """`old_logprobs="engine"` with `tis_cap`: the PPO ratio is 1 (the trainer's own log-probs, one step
    per RL step) and each token weighs min(exp(trainer - engine), cap): with an engine 0.3 below the
    trainer on every token the gradient is exp(0.3) times the on-policy one."""
    model = tiny_model()
    true_lp = naive_logprobs(model, traj([5, 6, 7], [8, 9, 10, 11]), 1.0).tolist()
    off = [x - 0.3 for x in true_lp]
    on_policy, tis = GradCapture(model), GradCapture(model)
    m0 = rl_update(on_policy, [traj([5, 6, 7], [8, 9, 10, 11], logprobs=true_lp)], [1.0], pad_id=PAD,
                   old_logprobs="engine")
    m = rl_update(tis, [traj([5, 6, 7], [8, 9, 10, 11], logprobs=off)], [1.0], pad_id=PAD, old_logprobs="engine",
                  tis_cap=2.0)
    assert m["actor/ratio_mean"] == pytest.approx(1.0) and m0["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["actor/tis_weight_mean"] == pytest.approx(float(torch.exp(torch.tensor(0.3))), rel=1e-4)
    for name, g in on_policy.grads.items():
        assert torch.allclose(tis.grads[name], g * float(torch.exp(torch.tensor(0.3))), rtol=1e-3, atol=1e-7), name
