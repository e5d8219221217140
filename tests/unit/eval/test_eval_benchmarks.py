import json
from collections import Counter
from pathlib import Path

import pytest

from rstar2_core.config import BenchmarkConfig, load_config
from rstar2_core.data.benchmarks import benchmark_from_url, gpqa_choices, load_benchmark, resolve_benchmarks
from rstar2_core.data.sources import SourceLayoutError
from rstar2_core.eval.grading import choice_letter, grade_all, grade_choice

FIX = Path(__file__).resolve().parents[2] / "fixtures"


def bench(name, layout, **kw):
    return load_benchmark(BenchmarkConfig(name=name, url=str(FIX / f"{name}.jsonl"), layout=layout, **kw))


def test_aime_layouts():
    b24 = bench("aime24", "aime")
    assert [p.id for p in b24.problems] == ["60", "61"] and b24.problems[0].answer == "320"
    assert len(b24.digest) == 64 and b24.problems[0].kind == "math"
    b25 = bench("aime25", "aime")   # question/answer export without ids: ids are row numbers
    assert [(p.id, p.answer) for p in b25.problems] == [("0", "40"), ("1", "103")]
    assert b25.problems[1].problem == "Compute the largest prime factor of 9991."


def test_hmmt_math500_and_limit():
    h = bench("hmmt_feb_2025", "hmmt")
    assert [p.id for p in h.problems] == ["1", "2"] and h.problems[1].answer == "2\\sqrt{2}"
    m = bench("math500", "math500", limit=2)
    assert [p.id for p in m.problems] == ["test/prealgebra/1.json", "test/algebra/2.json"]
    assert m.problems[0].answer == "\\frac{5}{6}" and m.problems[0].meta == {"subject": "Prealgebra", "level": 1}


def test_gpqa_choices_are_shuffled_deterministically_and_gold_is_the_letter():
    g = bench("gpqa_diamond", "gpqa")
    again = bench("gpqa_diamond", "gpqa")
    assert g.problems == again.problems
    rows = [json.loads(x) for x in (FIX / "gpqa_diamond.jsonl").read_text().splitlines()]
    for p, row in zip(g.problems, rows):
        assert p.kind == "choice" and p.answer in "ABCD" and p.id == row["Record ID"]
        assert f"{p.answer}) {row['Correct Answer']}" in p.problem
        for j in (1, 2, 3):
            assert row[f"Incorrect Answer {j}"] in p.problem
    # the permutation depends on the key: over many keys every letter is gold sometimes
    golds = Counter(gpqa_choices("q", "right", ["w1", "w2", "w3"], f"k{i}")[1] for i in range(200))
    assert set(golds) == set("ABCD") and min(golds.values()) > 20


def test_layout_detection_and_resolution():
    assert benchmark_from_url(str(FIX / "gpqa_diamond.jsonl")).layout == "gpqa"
    assert benchmark_from_url(str(FIX / "math500.jsonl")).layout == "math500"
    assert benchmark_from_url(str(FIX / "hmmt_feb_2025.jsonl")).layout == "hmmt"
    assert benchmark_from_url(str(FIX / "aime25.jsonl")).name == "aime25"
    cfg = load_config("tiny")
    assert [b.name for b in resolve_benchmarks(cfg, None)] == ["synthetic"]
    got = resolve_benchmarks(cfg, ["synthetic", str(FIX / "aime24.jsonl")])
    assert [(b.name, b.layout) for b in got] == [("synthetic", "synthetic"), ("aime24", "generic")]
    with pytest.raises(ValueError, match=r"unknown benchmark 'aime99'.*\['synthetic'\]"):
        resolve_benchmarks(cfg, ["aime99"])


def test_wrong_layout_and_missing_file_fail_clearly(tmp_path):
    with pytest.raises(SourceLayoutError, match="Correct Answer"):
        load_benchmark(BenchmarkConfig(name="x", url=str(FIX / "aime24.jsonl"), layout="gpqa"))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_benchmark(BenchmarkConfig(name="x", url=str(tmp_path / "nope.jsonl"), layout="aime"))
    with pytest.raises(ValueError, match="needs a url"):
        load_benchmark(BenchmarkConfig(name="x", layout="aime"))


def test_malformed_benchmark_rows_are_skipped_and_counted(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_text('{"id": 1, "problem": "2+2?", "answer": "4"}\n{"id": 1, "problem": "dup id", "answer": "4"}\n'
                 '{"id": 2, "problem": "", "answer": "4"}\nnot json\n')
    b = load_benchmark(BenchmarkConfig(name="b", url=str(p), layout="generic"))
    assert [x.id for x in b.problems] == ["1"]
    assert b.rejected == {"duplicate_id": 1, "empty_problem": 1, "invalid_json": 1}


def test_synthetic_benchmark_is_the_held_out_split():
    from rstar2_core.data.synthetic import generate_problems

    cfg = load_config("tiny", ["data.synthetic.n_eval=12"])
    b = load_benchmark(BenchmarkConfig(name="synthetic", layout="synthetic", limit=5), cfg)
    want = generate_problems(cfg.data.synthetic.seed, 5, "eval")
    assert [(p.id, p.problem, p.answer) for p in b.problems] == [(w.id, w.problem, w.answer) for w in want]


@pytest.mark.parametrize("ans, letter", [("C", "C"), ("(C)", "C"), ("C)", "C"), ("c.", "C"), ("\\text{C}", "C"),
                                         ("\\textbf{(B)}", "B"), ("A) The photon", "A"), ("$D$", "D"),
                                         ("E", None), ("CD", None), ("photon", None), (None, None)])
def test_choice_letters(ans, letter):
    assert choice_letter(ans) == letter


def test_grade_choice_and_mixed_batches():
    assert grade_choice("<answer>\\boxed{B}</answer>", "B").reward == 1.0
    assert grade_choice("<answer>\\boxed{(a)}</answer>", "B").reason == "wrong"
    assert grade_choice("I think B", "B").reason == "no_answer"
    seen = []

    def math_grader(items):
        seen.extend(items)
        return [type("G", (), {"reward": 1.0, "extracted": "x", "reason": "correct"})() for _ in items]

    out = grade_all(["choice", "math", "choice"], [("\\boxed{A}", "A"), ("\\boxed{5}", "5"), ("\\boxed{A}", "B")],
                    math_grader)
    assert [o.reward for o in out] == [1.0, 1.0, 0.0] and seen == [("\\boxed{5}", "5")]
    with pytest.raises(ValueError):
        grade_all(["essay"], [("x", "y")], math_grader)
