"""The comparison the exactness tests rely on (tests/rollout_trace.py): a near-tie in sampling is told
apart from a difference the design does not allow (prompts, seeds, a tool response, many rollouts at once,
a tool call that timed out)."""

import pytest
from rollout_trace import first_divergence


def _traj(ids, mask, tools=("ok",)):
    return {"ids": list(ids), "mask": list(mask), "tools": list(tools)}


def _step(step, groups, problems=("p0",), seed=None):
    return {"step": step, "seed": seed or 100 + step, "problems": list(problems), "groups": groups}


BASE = [_traj([1, 2, 3, 9, 9, 4], [1, 1, 1, 0, 0, 1]) for _ in range(4)]


def test_identical_runs_have_no_divergence():
    a = [_step(1, [BASE]), _step(2, [BASE])]
    assert first_divergence(a, [_step(2, [BASE])]) is None


def test_a_sampled_token_after_an_identical_prefix_is_a_near_tie():
    flipped = [BASE[0], _traj([1, 2, 7, 5], [1, 1, 1, 1]), BASE[2], BASE[3]]
    div = first_divergence([_step(1, [BASE]), _step(2, [BASE])], [_step(1, [BASE]), _step(2, [flipped])])
    assert div is not None and div.step == 2 and "rollout 1: sampled token 2 (3 vs 7) after 2 identical" in div.description


@pytest.mark.parametrize(("b", "match"), [
    ([_traj([1, 2, 3, 8, 9, 4], [1, 1, 1, 0, 0, 1])] + BASE[1:], "tool response token 3"),    # a tool answered otherwise
    ([_traj([1, 2, 7], [1, 1, 1])] * 3 + BASE[3:], "3 rollouts differ, not a near-tie"),
    ([_traj([1, 2, 3], [1, 1, 1])] + BASE[1:], "length token 3"),                               # cut short
])
def test_differences_the_design_does_not_allow_fail(b, match):
    with pytest.raises(AssertionError, match=match):
        first_divergence([_step(1, [BASE])], [_step(1, [b])])


def test_prompts_seeds_and_timeouts_are_exact():
    with pytest.raises(AssertionError, match="seed or prompts differ"):
        first_divergence([_step(1, [BASE])], [_step(1, [BASE], problems=("p9",))])
    with pytest.raises(AssertionError, match="was not rolled out"):
        first_divergence([_step(1, [BASE])], [_step(2, [BASE])])
    slow = [_traj([1, 2, 3, 9, 9, 4], [1, 1, 1, 0, 0, 1], tools=("timeout",))] + BASE[1:]
    with pytest.raises(AssertionError, match="hit the sandbox timeout"):
        first_divergence([_step(1, [BASE])], [_step(1, [slow])])
