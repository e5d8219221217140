"""grade_response: extraction + (normaliser OR math-verify), in-process."""

from __future__ import annotations

import pytest

from rstar2_core.reward import GradeResult, answers_match, grade_response


@pytest.mark.parametrize("response, gold, reward, extracted, reason", [
    (r"<reason>...</reason><answer>The answer is \boxed{1,024}.</answer>", "1024", 1.0, "1,024", "correct"),
    (r"<answer>\boxed{\dfrac{1}{2}}</answer>", "0.5", 1.0, r"\dfrac{1}{2}", "correct"),
    (r"<answer>\boxed{1023}</answer>", "1024", 0.0, "1023", "wrong"),
    ("I think it is 1024", "1024", 0.0, None, "no_answer"),
    (r"\boxed{1024} <answer>it is 1024</answer>", "1024", 0.0, None, "no_answer"),
    (r"<answer>\boxed{5}</answer> later \boxed{7}", "5", 1.0, "5", "correct"),
    (r"<answer>\boxed{}</answer>", "0", 0.0, "", "wrong"),
])
def test_grade_response(response, gold, reward, extracted, reason):
    assert grade_response(response, gold) == GradeResult(reward, extracted, reason)


@pytest.mark.parametrize("pred, gold", [
    ("x^2+1", "1+x^2"),                  # symbolic: only math-verify knows
    (r"\sqrt{2}/2", r"\frac{1}{\sqrt{2}}"),
    (r"2^{10}", "1024"),
    (r"\{1,2\}", r"\{2,1\}"),
])
def test_math_verify_is_ored_in(pred, gold):
    assert answers_match(pred, gold)


@pytest.mark.parametrize("pred, gold", [("x^2+2", "1+x^2"), (r"2^{10}", "1000"), ("", "0"), ("1", "")])
def test_mismatches(pred, gold):
    assert not answers_match(pred, gold)


def test_grade_result_reason_is_checked():
    with pytest.raises(ValueError, match="reason"):
        GradeResult(0.0, None, "timeout")
    assert GradeResult(1.0, "5", "correct").to_json() == {"reward": 1, "extracted": "5", "reason": "correct"}
