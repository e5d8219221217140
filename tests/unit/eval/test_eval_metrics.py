from math import comb

import pytest
from eval_fakes import Grade, traj

from rstar2_core.eval.metrics import aggregate, pass_at_k, problem_row
from rstar2_core.rollout.types import ToolCallRecord


@pytest.mark.parametrize("n, c, k, want", [
    (5, 2, 1, 0.4), (5, 2, 2, 0.7), (4, 0, 2, 0.0), (4, 3, 2, 1.0), (16, 1, 16, 1.0), (10, 3, 5, 1 - 21 / 252),
    (16, 0, 1, 0.0), (16, 16, 1, 1.0),
])
def test_pass_at_k_hand_values(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_matches_the_binomial_formula():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)
    assert 0.0 < pass_at_k(1000, 1, 10) < 1.0


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, 1, 0), (4, 1, 5), (0, 0, 1), (4, -1, 1)])
def test_pass_at_k_rejects_bad_input(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_problem_rows_and_aggregate():
    ok = ToolCallRecord("python", "ok", False)
    bad = ToolCallRecord("python", "timeout", True)
    infra = ToolCallRecord("python", "internal", False, infra=True)
    g1 = [traj("a", 10, (ok, bad), gen=6), traj("b", 20, (ok,), truncated=True, gen=20),
          traj("c", 30, (infra,), gen=10), traj("d", 40, (), gen=40)]
    grades1 = [Grade(1.0, "7", "correct"), Grade(0.0, "8", "wrong"), Grade(1.0, "7", "correct"),
               Grade(0.0, None, "no_answer")]
    r1 = problem_row("p1", "7", g1, grades1, k=2)
    assert (r1.n, r1.n_correct, r1.pass1) == (4, 2, 0.5)
    assert r1.pass_k == pytest.approx(1 - comb(2, 2) / comb(4, 2))
    assert (r1.tool_calls, r1.tool_errors, r1.truncated, r1.top_answer) == (3, 1, 1, "7")
    assert r1.mean_response_tokens == 25 and r1.mean_tool_calls == 0.75
    assert r1.reasons == {"correct": 2, "wrong": 1, "no_answer": 1}
    g2 = [traj("e", 10, (bad, bad)), traj("f", 10, ())]
    r2 = problem_row("p2", "1", g2, [Grade(0.0, "2", "grader_timeout"), Grade(1.0, "1", "correct")], k=2)
    m = aggregate("bench", [r1, r2], [g1, g2], k=2)
    assert m.n_problems == 2 and m.pass1 == pytest.approx((0.5 + 0.5) / 2)
    assert m.pass_k == pytest.approx((r1.pass_k + 1.0) / 2)
    assert m.mean_response_tokens == pytest.approx((10 + 20 + 30 + 40 + 10 + 10) / 6)
    assert m.mean_generated_tokens == pytest.approx((6 + 20 + 10 + 40 + 10 + 10) / 6)
    assert m.tool_calls_per_traj == pytest.approx(5 / 6)     # the infra call is not the model's
    assert m.tool_error_ratio == pytest.approx(3 / 5)
    assert m.truncation_rate == pytest.approx(1 / 6)
    assert m.no_answer_rate == pytest.approx(1 / 6) and m.grader_timeouts == 1
    assert m.as_metrics()["eval/bench/pass1"] == m.pass1


def test_problem_row_needs_matching_grades():
    with pytest.raises(ValueError):
        problem_row("p", "1", [traj("a")], [], k=1)


def test_sample_text_is_clipped_head_and_tail():
    from rstar2_core.eval.run import clip_text

    assert clip_text("abcdef", 6) == "abcdef"
    out = clip_text("a" * 50 + "b" * 50, 10)
    assert out.startswith("aaaaa\n") and out.endswith("\nbbbbb") and "[90 chars omitted]" in out
    assert clip_text("abc", 0) == ""
