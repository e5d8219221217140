from collections import Counter

from rstar2_core.data import filters
from rstar2_core.data.sources import Candidate

LONG = ("A train travels along a straight track at a constant speed of sixty kilometres per hour for "
        "exactly three hours without stopping. How many kilometres does it travel in total?")


def c(i, problem, answer="1"):
    return Candidate(f"s/{i}", problem, answer, "s")


def test_integer_answer_filter_normalises_and_counts():
    kept, dropped = filters.integer_answers([c(1, "p", "1,000"), c(2, "q", "\\frac{4}{2}"), c(3, "r", "0.5"),
                                             c(4, "s", "1" * 31), c(5, "t", "\\boxed{12}")], max_digits=30)
    assert [k.answer for k in kept] == ["1000", "2", "12"]
    assert dropped == Counter({"answer_not_integer": 1, "answer_too_many_digits": 1})


def test_exact_duplicates_keep_the_first():
    kept, dropped = filters.exact_duplicates([c(1, "Find x!"), c(2, "find   X"), c(3, "find y")])
    assert [k.id for k in kept] == ["s/1", "s/3"] and dropped == {"duplicate_exact": 1}


def test_near_duplicates_planted():
    one_word = LONG.replace("stopping", "pausing")  # 20 of 30 distinct 5-shingles shared: J = 0.67
    other = ("A cyclist rides at twelve kilometres per hour for four hours along a river. "
             "How far does she ride before she stops for lunch?")
    kept, dropped = filters.near_duplicates([c(1, LONG), c(2, other), c(3, one_word)], threshold=0.5, num_perm=128)
    assert [k.id for k in kept] == ["s/1", "s/2"] and dropped == {"duplicate_near": 1}


def test_near_duplicate_threshold_is_respected():
    # same template, different numbers: Jaccard of 5-shingles well below 0.85 -> both kept
    a = "What is the remainder when 123456 is divided by 97? Give the remainder as an integer."
    b = "What is the remainder when 654321 is divided by 89? Give the remainder as an integer."
    kept, dropped = filters.near_duplicates([c(1, a), c(2, b)], threshold=0.85, num_perm=128)
    assert len(kept) == 2 and not dropped
    kept, dropped = filters.near_duplicates([c(1, LONG), c(2, LONG + " Explain.")], threshold=0.85, num_perm=128)
    assert len(kept) == 1 and dropped == {"duplicate_near": 1}


def test_decontamination_planted_8gram():
    bench = {"aime24": ["Let S be the sum of all positive divisors of 2024. Find S mod 1000."],
             "math500": ["How many sides does a hexagon have?"]}
    cands = [
        c(1, "Consider the sum of all positive divisors of 2024 that are odd."),   # shares an 8-gram
        c(2, "Consider the sum of all positive divisors of 2025 that are odd."),   # only 7 words in common
        c(3, "how many SIDES does a hexagon have"),                                 # short: whole text matches
        c(4, "How many sides does a regular hexagon have?"),
    ]
    kept, dropped = filters.decontaminate(cands, bench, n=8)
    assert [k.id for k in kept] == ["s/2", "s/4"]
    assert dropped == {"contaminated:aime24": 1, "contaminated:math500": 1}
    kept, dropped = filters.decontaminate(cands, bench, n=7)
    assert "s/2" not in [k.id for k in kept]


def test_decontamination_exact_only_for_templated_benchmarks():
    tmpl = "Use Python to compute the number of primes below {} and report it."
    bench = {"synthetic": [tmpl.format(1000)]}
    cands = [c(1, tmpl.format(1000)), c(2, tmpl.format(2000))]
    kept, dropped = filters.decontaminate(cands, bench, n=8, exact_only=["synthetic"])
    assert [k.id for k in kept] == ["s/2"] and dropped == {"contaminated:synthetic": 1}
    kept, _ = filters.decontaminate(cands, bench, n=8)   # n-gram mode would drop the whole template
    assert kept == []


def test_unique_ids():
    kept, dropped = filters.unique_ids([c(1, "a"), c(1, "b"), c(2, "c")])
    assert [k.problem for k in kept] == ["a", "c"] and dropped == {"duplicate_id": 1}
