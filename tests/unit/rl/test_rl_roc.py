"""GRPO-RoC resampling and penalties: hand-computed vectors and hypothesis properties."""

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar2_core.rl import (
    class_counts,
    filter_zero_variance,
    get_resampler,
    keep_all,
    resample_on_correct,
    trajectory_penalty,
)


# ------------------------------------------------------------------------------------ trajectory_penalty
def test_penalty_single_turn_correct_with_clean_tool_call_is_zero():
    # one assistant turn, one answer block, one successful call: p_err 0, p_format (1-1)/1 = 0
    assert trajectory_penalty(1, 0, 1, 1) == 0.0


def test_penalty_no_tool_call_is_half():
    assert trajectory_penalty(0, 0, 1, 1) == 0.5


def test_penalty_no_answer_block_is_full_format_penalty():
    assert trajectory_penalty(2, 1, 0, 3) == pytest.approx(0.5 + 1.0)


def test_penalty_extra_answer_blocks_scaled_by_turns():
    # 3 answer blocks over 4 turns: (3-1)/4 = 0.5; 1 of 4 calls failed: 0.25
    assert trajectory_penalty(4, 1, 3, 4) == pytest.approx(0.75)
    # capped at 1: 5 blocks over 2 turns
    assert trajectory_penalty(1, 1, 5, 2) == pytest.approx(2.0)


def test_penalty_rejects_inconsistent_counts():
    with pytest.raises(ValueError, match="exceeds"):
        trajectory_penalty(1, 2, 1, 1)
    with pytest.raises(ValueError, match=">= 0"):
        trajectory_penalty(-1, 0, 1, 1)
    with pytest.raises(ValueError, match="n_turns"):
        trajectory_penalty(0, 0, 1, 0)


# ------------------------------------------------------------------------------------ class counts
def test_class_counts_fix_rounding_so_shares_sum_to_keep():
    # 5 pos / 3 neg of 8, keep 4: exact 2.5 / 1.5; Python round gives 2 + 2 = 4 here but 3 pos/... check
    assert sum(class_counts(5, 3, 4)) == 4
    # 3 pos / 1 neg, keep 2: exact 1.5 / 0.5 -> round() would give 2 + 0 = 2 but floor 1 for negatives
    assert class_counts(3, 1, 2) == (1, 1)
    # 6 pos / 10 neg, keep 8: exact 3 / 5
    assert class_counts(6, 10, 8) == (3, 5)
    # 3 pos / 13 neg, keep 8: exact 1.5 / 6.5: python round gives 2 + 6 = 8, ours 2 + 6
    assert class_counts(3, 13, 8) == (2, 6)
    # 5 pos / 11 neg, keep 8: exact 2.5 / 5.5: python round -> 2 + 6 = 8; ours 3 + 5 (half up on positives)
    assert class_counts(5, 11, 8) == (3, 5)
    # 1 pos / 5 neg, keep 3: exact .5 / 2.5: python round -> 0 + 2 = 2 != 3; ours sums to 3
    assert class_counts(1, 5, 3) == (1, 2)


def test_class_counts_floor_two_per_class_when_lopsided():
    assert class_counts(1, 31, 16) == (1, 15)   # floor min(2, 1) = 1
    assert class_counts(2, 30, 16) == (2, 14)   # exact share 1 -> raised to 2
    assert class_counts(31, 1, 16) == (15, 1)
    assert class_counts(30, 2, 16) == (14, 2)


def test_class_counts_single_class():
    assert class_counts(0, 32, 16) == (0, 16)
    assert class_counts(32, 0, 16) == (16, 0)


# ------------------------------------------------------------------------------------ resample_on_correct
def test_lowest_penalty_vector_with_ties_broken_by_index():
    rewards = [1, 0, 1, 1, 0, 1, 0, 0]
    penalties = [0.5, 9, 0.0, 0.5, 9, 0.5, 9, 9]
    # 4 pos / 4 neg, keep 4 -> 2 pos: penalty 0.0 (idx 2), then tie 0.5 at idx 0, 3, 5 -> idx 0
    kept = resample_on_correct(rewards, penalties, 4, mode="lowest_penalty", seed=0)
    assert [i for i in kept if rewards[i] == 1] == [0, 2]
    assert len([i for i in kept if rewards[i] == 0]) == 2
    assert kept == sorted(kept)


def test_group_with_one_positive_keeps_it():
    rewards = [0] * 7 + [1]
    for seed in range(5):
        kept = resample_on_correct(rewards, [2.0] * 7 + [1.5], 4, seed=seed)
        assert 7 in kept and len(kept) == 4


def test_group_without_positives_keeps_keep_negatives():
    kept = resample_on_correct([0.0] * 6, [1.0] * 6, 3, seed=1)
    assert len(kept) == 3 and len(set(kept)) == 3


def test_fewer_rollouts_than_keep_returns_all():
    assert resample_on_correct([1, 0], [0.0, 1.0], 4, seed=0) == [0, 1]


def test_unknown_mode_names_valid_modes():
    with pytest.raises(ValueError, match="lowest_penalty"):
        resample_on_correct([1, 0], [0, 0], 1, mode="best")


def test_registry_and_plain_grpo_keep_all():
    assert get_resampler("none") is keep_all
    assert keep_all([1, 0, 0, 1], [0, 0, 0, 0], 2) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"\['none', 'roc'\]"):
        get_resampler("rocc")


groups = st.integers(min_value=1, max_value=40).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n),
    st.lists(st.floats(min_value=0.0, max_value=2.0), min_size=n, max_size=n),
    st.integers(min_value=1, max_value=n),
    st.sampled_from(["weighted", "lowest_penalty"]),
    st.integers(min_value=0, max_value=2**31)))


@settings(max_examples=150, deadline=None)
@given(groups)
def test_counts_shares_and_floors(g):
    rewards, penalties, keep, mode, seed = g
    kept = resample_on_correct(rewards, penalties, keep, mode=mode, seed=seed)
    assert len(kept) == keep and kept == sorted(set(kept))
    n = len(rewards)
    n_pos = sum(r > 0 for r in rewards)
    k_pos = sum(rewards[i] > 0 for i in kept)
    k_neg = keep - k_pos
    if 0 < n_pos < n:
        assert abs(k_pos - n_pos * keep / n) <= 0.5 or k_pos == min(2, n_pos, keep // 2) \
            or k_neg == min(2, n - n_pos, keep // 2)
        assert k_pos >= min(2, n_pos, keep // 2) and k_neg >= min(2, n - n_pos, keep // 2)


@settings(max_examples=60, deadline=None)
@given(groups)
def test_same_seed_same_result(g):
    rewards, penalties, keep, mode, seed = g
    assert resample_on_correct(rewards, penalties, keep, mode, seed) == \
        resample_on_correct(rewards, penalties, keep, mode, seed)


def test_lowest_penalty_keeps_the_minimum_penalties():
    rewards = [1.0] * 10 + [0.0] * 10
    penalties = [0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6, 0.0] + [0.0] * 10
    kept = resample_on_correct(rewards, penalties, 10, mode="lowest_penalty", seed=3)
    assert sorted(penalties[i] for i in kept if i < 10) == [0.0, 0.1, 0.2, 0.3, 0.4]


def test_weighted_mode_prefers_low_penalty_over_many_seeds():
    rewards = [1.0] * 4 + [0.0] * 4
    penalties = [0.1, 0.5, 1.0, 2.0, 1, 1, 1, 1]
    counts = Counter()
    for seed in range(2000):
        counts.update(i for i in resample_on_correct(rewards, penalties, 4, seed=seed) if i < 4)
    # 2 of 4 positives kept each time; inclusion frequency is strictly ordered by penalty
    assert counts[0] > counts[1] > counts[2] > counts[3]
    # weight 1/0.1 = 10 of a total 10+2+1+0.5: the first draw alone picks it with p = 0.74
    assert counts[0] / 2000 > 0.74
    # but a high-penalty positive is still sometimes kept (sampled, not sorted)
    assert counts[3] > 0


def test_weighted_mode_matches_successive_draw_probabilities():
    # keep one positive out of 3 with weights 1/0.5, 1/1, 1/2 = 2, 1, 0.5 -> p = 4/7, 2/7, 1/7
    rewards = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    penalties = [0.5, 1.0, 2.0, 0, 0, 0]
    trials = 6000
    counts = Counter()
    for seed in range(trials):
        kept = resample_on_correct(rewards, penalties, 2, seed=seed, min_per_class=0)
        counts.update(i for i in kept if i < 3)
    for i, p in enumerate([4 / 7, 2 / 7, 1 / 7]):
        assert abs(counts[i] / trials - p) < 4 * math.sqrt(p * (1 - p) / trials)


def test_negatives_are_uniform():
    rewards = [0.0] * 8 + [1.0] * 8
    penalties = [float(i) for i in range(8)] + [0.0] * 8  # penalties must not matter for negatives
    trials = 3000
    counts = Counter()
    for seed in range(trials):
        counts.update(i for i in resample_on_correct(rewards, penalties, 8, seed=seed) if i < 8)
    # each negative is kept with p = 4/8; chi-square with 7 dof, 99.9% quantile ~24.3
    expected = trials * 4 / 8
    chi2 = sum((counts[i] - expected) ** 2 / expected for i in range(8))
    assert chi2 < 24.3, counts


# ------------------------------------------------------------------------------------ filter_zero_variance
def test_filter_zero_variance_lists_and_tensor():
    assert filter_zero_variance([[1, 1, 1], [0, 0], [0, 1, 0], [], [0.5, 0.5000001]]) == [False, False, True, False, True]
    t = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert filter_zero_variance(t) == [False, True]
    with pytest.raises(ValueError, match="num_groups"):
        filter_zero_variance(torch.zeros(3))
