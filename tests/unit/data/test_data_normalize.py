import pytest

from rstar2_core.data.normalize import (
    REASON_EMPTY,
    REASON_NOT_INTEGER,
    REASON_TOO_MANY_DIGITS,
    integer_answer,
    ngrams,
    problem_key,
    words,
)


@pytest.mark.parametrize("raw, want", [
    ("1,000", "1000"), ("\\frac{4}{2}", "2"), ("\\boxed{12}", "12"), ("$-7$", "-7"), ("12.0", "12"),
    ("\\dfrac{-9}{3}", "-3"), ("-\\frac{10}{5}", "-2"), ("6/3", "2"), (" 0042 ", "42"), (1000, "1000"),
    (3.0, "3"), ("\\text{17}", "17"), ("$\\boxed{1{,}234}$", "1234"), ("12\\,345", "12345"), ("{5}", "5"),
])
def test_integer_answers_normalise(raw, want):
    assert integer_answer(raw, 30) == (want, None)


@pytest.mark.parametrize("raw", ["1.5", "\\sqrt{2}", "x+1", "\\frac{1}{3}", "1,00", "2^{10}", "\\frac{4}{0}",
                                 "12.5", 2.5, "1e3", "[1, 2]", True])
def test_non_integers_rejected(raw):
    assert integer_answer(raw, 30) == (None, REASON_NOT_INTEGER)


def test_digit_cap_counts_digits_not_sign_or_leading_zeros():
    assert integer_answer("-" + "9" * 5, 5) == ("-99999", None)
    assert integer_answer("000" + "9" * 5, 5) == ("99999", None)
    assert integer_answer("9" * 6, 5) == (None, REASON_TOO_MANY_DIGITS)
    # a huge label is rejected before int() (which refuses > 4300 digits)
    assert integer_answer("7" * 10000, 30) == (None, REASON_TOO_MANY_DIGITS)
    assert integer_answer("\\frac{" + "8" * 10000 + "}{2}", 30) == (None, REASON_TOO_MANY_DIGITS)


def test_empty_answer():
    assert integer_answer("$ $", 30) == (None, REASON_EMPTY)
    assert integer_answer("\\boxed{}", 30) == (None, REASON_EMPTY)


def test_problem_key_ignores_case_punctuation_and_spacing():
    assert problem_key("Find  X, please!") == problem_key("find x please")
    assert problem_key("find x") != problem_key("find y")


def test_ngrams_of_short_text_is_the_text():
    assert ngrams(words("a b c"), 8) == {("a", "b", "c")}
    assert len(ngrams(words("1 2 3 4 5 6 7 8 9"), 8)) == 2
    assert ngrams([], 8) == set()
