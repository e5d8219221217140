"""The answer normaliser: exact numbers from common spellings, plain text otherwise."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar2_core.reward import normalize_answer, normalized_equal


@pytest.mark.parametrize("text, value", [
    ("1000", Fraction(1000)), ("1,000", Fraction(1000)), ("1 000 000", Fraction(10**6)),
    ("1{,}000", Fraction(1000)), ("+1000", Fraction(1000)), ("1000.0", Fraction(1000)), ("1000.", Fraction(1000)),
    ("-12", Fraction(-12)), ("0.25", Fraction(1, 4)), (".5", Fraction(1, 2)),
    (r"\frac{3}{4}", Fraction(3, 4)), (r"\dfrac{3}{4}", Fraction(3, 4)), (r"\tfrac{3}{4}", Fraction(3, 4)),
    (r"\frac12", Fraction(1, 2)), (r"-\frac{1}{2}", Fraction(-1, 2)), (r"\frac{-1}{2}", Fraction(-1, 2)),
    ("3/4", Fraction(3, 4)), ("-3 / 4", Fraction(-3, 4)),
    (r"$\text{12}$", Fraction(12)), (r"\(12\)", Fraction(12)), (r"\textbf{12}", Fraction(12)),
    (r"\boxed{12}", Fraction(12)), (r"30^\circ", Fraction(30)), (r"30^{\circ}", Fraction(30)), ("30°", Fraction(30)),
    (r"50\%", Fraction(50)), ("50%", Fraction(50)), (r"\left( 5 \right)", "(5)"), (r"1\,000", Fraction(1000)),
])
def test_numbers(text, value):
    assert normalize_answer(text) == value


@pytest.mark.parametrize("text, expected", [
    ("x + 1", "x+1"), ("1,2", "1,2"), ("12,34", "12,34"), (r"\frac{1}{0}", r"\frac{1}{0}"), ("1/0", "1/0"),
    ("(1, 2)", "(1,2)"), ("A", "A"),
])
def test_non_numbers_are_text(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize("pred, gold, equal", [
    ("1,024", "1024", True), (r"\frac{1}{2}", "0.5", True), ("7", "7.0", True), ("x+1", "x + 1", True),
    ("1024", "1025", False), ("12", "1,2", False), ("", "", False), ("A", "a", False),
    ("9" * 5000, "9" * 5000, True), ("9" * 5000, "9" * 4999 + "8", False),
])
def test_normalized_equal(pred, gold, equal):
    assert normalized_equal(pred, gold) is equal


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=-10**30, max_value=10**30), d=st.integers(min_value=1, max_value=10**6))
def test_spellings_of_the_same_number_agree(n, d):
    assert normalize_answer(f"{n:,}") == normalize_answer(f"+{n}" if n >= 0 else str(n)) == Fraction(n)
    assert normalize_answer(f"{n}.0") == Fraction(n)
    assert normalize_answer(f"\\dfrac{{{n}}}{{{d}}}") == normalize_answer(f"{n}/{d}") == Fraction(n, d)
    assert normalized_equal(f"$\\boxed{{{n:,}}}$", str(n))
    assert not normalized_equal(str(n), str(n + 1))
