"""GRPO advantages and the clipped policy loss: vectors, padding invariance, gradient vs a per-token loop."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar2_core.rl import (
    get_advantage_estimator,
    get_policy_loss,
    grpo_advantages,
    grpo_advantages_batched,
    policy_loss,
)


def test_grpo_advantages_population_std_vector():
    a = grpo_advantages(torch.tensor([1.0, 0.0]))
    assert torch.allclose(a, torch.tensor([1.0, -1.0]), atol=1e-5)
    # rewards 1,0,0,0: mean .25, pop std sqrt(.1875) = .4330
    a = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.allclose(a, torch.tensor([0.75, -0.25, -0.25, -0.25]) / 0.4330127, atol=1e-4)


def test_grpo_advantages_all_equal_is_zero_and_batched_matches_rows():
    assert torch.equal(grpo_advantages(torch.ones(5)), torch.zeros(5))
    r = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    b = grpo_advantages_batched(r)
    for i in range(3):
        assert torch.allclose(b[i], grpo_advantages(r[i]))
    with pytest.raises(ValueError, match="batched"):
        grpo_advantages(r)


def test_registries_reject_unknown_keys_listing_valid_ones():
    assert get_advantage_estimator("grpo") is grpo_advantages
    assert get_policy_loss("ppo_clip") is policy_loss
    with pytest.raises(ValueError, match=r"\['grpo'\]"):
        get_advantage_estimator("gae")
    with pytest.raises(ValueError, match=r"\['ppo_clip'\]"):
        get_policy_loss("dpo")


def test_policy_loss_hand_computed_vector():
    # one trajectory, three tokens; ratios e^0 = 1, e^0.5 = 1.65 (clipped to 1.28 for A > 0), e^-0.5 = .61
    lp = torch.tensor([[0.0, 0.5, -0.5]])
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    loss, m = policy_loss(lp, old, torch.tensor([2.0]), mask)
    r = torch.exp(torch.tensor([0.0, 0.5, -0.5]))
    expected = -(2 * 1.0 + 2 * 1.28 + 2 * r[2]) / 3  # min(r*A, clip*A): token 2 clipped, token 3 not (r<1-.2 and A>0 -> unclipped smaller)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert m["actor/pg_clipfrac"] == pytest.approx(1 / 3)
    assert m["actor/tokens"] == 3
    assert m["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # mean(old - new) = -(0 + .5 - .5)/3
    assert m["actor/ratio_mean"] == pytest.approx(r.mean().item(), rel=1e-5)
    # negative advantage: the lower clip (1 - 0.2) binds on token 3, the upper one does not on token 2
    loss_neg, m_neg = policy_loss(lp, old, torch.tensor([-1.0]), mask)
    assert loss_neg.item() == pytest.approx((1.0 + r[1].item() + 0.8) / 3, rel=1e-5)
    assert m_neg["actor/pg_clipfrac"] == pytest.approx(1 / 3)


def test_policy_loss_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\(B,\)"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))


def _reference_loss(lp, old, adv, mask, lo=0.2, hi=0.28):
    """A straightforward per-token loop: sum over masked tokens of -min(r A, clip(r) A), divided by count."""
    total, count = 0.0, 0
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[b, t] == 0:
                continue
            ratio = torch.exp(lp[b, t] - old[b, t])
            clipped = torch.clamp(ratio, 1 - lo, 1 + hi)
            total = total - torch.minimum(ratio * adv[b], clipped * adv[b])
            count += 1
    return total / count


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 10_000))
def test_gradient_matches_per_token_reference(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, T, generator=g) * 0.4
    old = base + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[0, 0] = 1.0
    lp1 = base.clone().requires_grad_(True)
    lp2 = base.clone().requires_grad_(True)
    loss, _ = policy_loss(lp1, old, adv, mask)
    ref = _reference_loss(lp2, old, adv, mask)
    loss.backward()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(lp1.grad, lp2.grad, atol=1e-6)
    assert torch.all(lp1.grad[mask == 0] == 0)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 5), st.integers(0, 10_000))
def test_loss_invariant_to_padding(B, T, pad, seed):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(B, T, generator=g) * 0.3).requires_grad_(True)
    old = torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, T)
    loss, m = policy_loss(lp, old, adv, mask)
    loss.backward()
    # right-pad with garbage (large values that would overflow exp if they were not masked out)
    lp_pad = torch.cat([lp.detach(), torch.full((B, pad), 80.0)], 1).requires_grad_(True)
    old_pad = torch.cat([old, torch.full((B, pad), -80.0)], 1)
    mask_pad = torch.cat([mask, torch.zeros(B, pad)], 1)
    loss_p, m_p = policy_loss(lp_pad, old_pad, adv, mask_pad)
    loss_p.backward()
    assert torch.isfinite(loss_p)
    assert loss_p.item() == pytest.approx(loss.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(lp_pad.grad[:, :T], lp.grad) and torch.all(lp_pad.grad[:, T:] == 0)
    assert m_p == pytest.approx(m, rel=1e-5, abs=1e-7)


def test_micro_batches_with_global_token_count_equal_full_batch():
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(6, 5, generator=g) * 0.3).requires_grad_(True)
    old = torch.randn(6, 5, generator=g) * 0.3
    adv = torch.randn(6, generator=g)
    mask = torch.ones(6, 5)
    mask[0, 2:] = 0
    mask[4, 1:] = 0  # unequal lengths: per-micro-batch means would differ from the global mean
    full, _ = policy_loss(lp, old, adv, mask)
    full.backward()
    g_full = lp.grad.clone()
    lp.grad = None
    total = float(mask.sum())
    acc = 0.0
    for sl in (slice(0, 2), slice(2, 5), slice(5, 6)):
        part, _ = policy_loss(lp[sl], old[sl], adv[sl], mask[sl], total_tokens=total)
        part.backward()
        acc += part.item()
    assert acc == pytest.approx(full.item(), rel=1e-6)
    assert torch.allclose(lp.grad, g_full, atol=1e-7)


# --------------------------------------------------------------------- truncated importance sampling
def _tis_reference(lp, old, behaviour, adv, mask, cap, clip_low=0.2, clip_high=0.28):
    """Token-level TIS written from its definition, one token at a time: the clipped PPO term of each
    sampled token, times min(pi_old(token) / pi_engine(token), cap) (a constant), summed over the masked
    tokens and divided by their count."""
    total, n = 0.0, 0
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            ratio = torch.exp(lp[b, t] - old[b, t])
            term = torch.maximum(-adv[b] * ratio, -adv[b] * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
            weight = min(float(torch.exp(old[b, t] - behaviour[b, t])), cap)
            total = total + term * weight
            n += 1
    return total / n


def test_tis_matches_its_definition_value_and_gradient():
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, -1.7, -2.2, -0.9]])
    behaviour = torch.tensor([[-1.1, -0.5, -0.5, -9.0], [-0.1, -1.7, -4.0, -0.9]])   # one ratio e^1.8 > cap
    lp0 = torch.tensor([[-0.9, -2.1, -0.4, 0.0], [-0.35, -1.6, -2.0, -0.7]])
    adv = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)
    lp_a = lp0.clone().requires_grad_(True)
    loss, m = policy_loss(lp_a, old, adv, mask, behaviour_logprobs=behaviour, tis_cap=2.0)
    loss.backward()
    lp_b = lp0.clone().requires_grad_(True)
    ref = _tis_reference(lp_b, old, behaviour, adv, mask, cap=2.0)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(lp_a.grad, lp_b.grad, atol=1e-6)
    weights = torch.clamp(torch.exp(old - behaviour), max=2.0)[mask.bool()]
    assert m["actor/tis_weight_mean"] == pytest.approx(weights.mean().item(), abs=1e-6)
    assert m["actor/tis_capped_frac"] == pytest.approx(1 / 7, abs=1e-6)      # 0.2 - (-4.0) = 1.8 -> e^1.8 capped
    # the engine's log-prob on a masked position (-9.0) changes nothing
    behaviour2 = behaviour.clone()
    behaviour2[0, 3] = 5.0
    assert policy_loss(lp0, old, adv, mask, behaviour_logprobs=behaviour2, tis_cap=2.0)[0].item() == pytest.approx(
        loss.item(), abs=1e-7)


def test_tis_off_is_the_papers_loss_bit_for_bit_and_needs_behaviour_logprobs():
    g = torch.Generator().manual_seed(0)
    lp, old = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    adv, mask = torch.randn(3, generator=g), (torch.rand(3, 5, generator=g) > 0.3).float()
    plain, _ = policy_loss(lp, old, adv, mask)
    assert torch.equal(policy_loss(lp, old, adv, mask, behaviour_logprobs=old + 1.0)[0], plain)
    # behaviour == old: every weight is 1, the loss is the paper's
    assert torch.equal(policy_loss(lp, old, adv, mask, behaviour_logprobs=old, tis_cap=2.0)[0], plain)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        policy_loss(lp, old, adv, mask, tis_cap=2.0)

