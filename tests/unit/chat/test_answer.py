"""extract_answer, answer-block and turn counts, and the RoC format penalty."""

from __future__ import annotations

import pytest

from rstar2_core.chat import count_answer_blocks, count_assistant_turns, extract_answer, format_penalty


@pytest.mark.parametrize("text, expected", [
    (r"<answer>The answer is \boxed{42}.</answer>", "42"),
    (r"<answer>\boxed{\frac{1}{2}}</answer>", r"\frac{1}{2}"),
    (r"\boxed{ \sqrt{\frac{a^{2}}{b_{1}}} }", r"\sqrt{\frac{a^{2}}{b_{1}}}"),
    (r"first \boxed{1}, then \boxed{2}", "2"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\fbox{7}", "7"),
    (r"$\boxed 7$.", "7"),
    (r"the box \boxed{12 is cut", None),
    (r"\boxed{3} then \boxed{4", "3"),
    (r"\boxedx{3}", None),
    ("no answer at all", None),
    (r"<answer>\boxed{}</answer>", ""),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_last_answer_block_wins_over_boxes_elsewhere():
    text = (r"<reason>try \boxed{1}</reason><answer>\boxed{2}</answer> more \boxed{3}"
            r"<answer>final \boxed{4} and \boxed{5}</answer> trailing \boxed{6}")
    assert extract_answer(text) == "5"


def test_answer_block_without_box_is_no_answer():
    assert extract_answer(r"\boxed{1}<answer>it is one</answer>") is None


def test_unclosed_answer_block_falls_back_to_anywhere():
    assert extract_answer(r"<answer>\boxed{9}") == "9"


@pytest.mark.parametrize("text, n", [
    ("", 0),
    ("<answer>a</answer>", 1),
    ("<answer>a</answer><answer>b</answer>", 2),
    ("<answer>a", 0),
    ("<answer>a<answer>b</answer>", 1),
    ("</answer><answer>x</answer></answer>", 1),
])
def test_count_answer_blocks(text, n):
    assert count_answer_blocks(text) == n


def test_count_assistant_turns(chat):
    gen1, gen2 = "<tool_call>{}</tool_call>", "<answer>\\boxed{1}</answer>"
    response = gen1 + chat.tool_response_text(["r"]) + gen2
    assert count_assistant_turns(gen2) == 1
    assert count_assistant_turns(response) == 2
    assert count_assistant_turns(response + chat.tool_response_text(["r", "s"]) + gen2) == 3


def test_format_penalty_single_turn_correct_answer_is_zero():
    assert format_penalty(1, 1) == 0.0
    assert format_penalty(1, 10) == 0.0
    assert format_penalty(0, 1) == 1.0
    assert format_penalty(0, 5) == 1.0
    assert format_penalty(2, 4) == 0.25
    assert format_penalty(3, 2) == 1.0
    with pytest.raises(ValueError, match="n_turns"):
        format_penalty(1, 0)


def test_package_exports_every_name_lazily():
    import rstar2_core.chat as chat_pkg

    assert sorted(chat_pkg.__all__) == sorted(chat_pkg._WHERE)
    for name in chat_pkg.__all__:
        assert getattr(chat_pkg, name) is not None
    with pytest.raises(AttributeError, match="nope"):
        chat_pkg.nope  # noqa: B018
