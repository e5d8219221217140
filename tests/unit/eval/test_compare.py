"""Paired comparison of evaluation reports, checkpoint ranking and the promotion rule, on fixed reports."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from rstar2_core.config import load_config
from rstar2_core.eval.compare import (
    compare_benchmark,
    compare_reports,
    comparisons_markdown,
    paired_bootstrap,
    primary_benchmark,
    rank_checkpoints,
)
from rstar2_core.eval.metrics import BenchmarkMetrics, EvalReport, ProblemRow
from rstar2_core.eval.promotion import decide_promotion

K = 4


def report(correct: dict[str, list[int]], url: str = "ckpt", ids: list[str] | None = None) -> EvalReport:
    """A report whose problem i of benchmark b had correct[b][i] of K samples right."""
    metrics, rows = {}, {}
    for b, cs in correct.items():
        pids = ids or [f"q{i}" for i in range(len(cs))]
        rows[b] = tuple(ProblemRow(pid, "1", K, c, c / K, float(c > 0), 10.0, 1.0, 0, K, 0, "1", {"correct": c})
                        for pid, c in zip(pids, cs))
        p1 = sum(cs) / (K * len(cs))
        metrics[b] = BenchmarkMetrics(b, len(cs), K, p1, p1, 10.0, 10.0, 1.0, 0.0, 0.0, 0.0, 0)
    return EvalReport(url, metrics, rows, {"k": K, "seed": 0})


def test_paired_bootstrap_is_seeded_and_matches_the_normal_interval():
    rng = np.random.default_rng(0)
    d = rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], size=200, p=[0.1, 0.1, 0.3, 0.25, 0.25])
    a, b = paired_bootstrap(d, 0.95, seed=7), paired_bootstrap(d, 0.95, seed=7)
    assert a == b and paired_bootstrap(d, 0.95, seed=8) != a
    mean, low, high = a
    se = d.std() / np.sqrt(d.size)
    assert mean == pytest.approx(d.mean())
    assert low == pytest.approx(mean - 1.96 * se, abs=0.2 * se) and high == pytest.approx(mean + 1.96 * se, abs=0.2 * se)
    wide = paired_bootstrap(d, 0.99, seed=7)
    assert wide[1] < low and wide[2] > high
    assert paired_bootstrap([0.0] * 30, 0.95, seed=0) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap(d, 1.0, seed=0)
    with pytest.raises(ValueError, match="at least one"):
        paired_bootstrap([], 0.95, seed=0)


def test_no_difference_is_rarely_called_better_and_a_real_gain_usually_is():
    rng = random.Random(0)

    def draw(p):
        return [sum(rng.random() < p for _ in range(K)) for _ in range(60)]

    null = [compare_benchmark(report({"s": draw(0.4)}), report({"s": draw(0.4)}), "s", confidence=0.95,
                              seed=i).verdict for i in range(150)]
    assert null.count("better") / len(null) < 0.07  # about 2.5% expected at 0.95
    gain = [compare_benchmark(report({"s": draw(0.6)}), report({"s": draw(0.3)}), "s", confidence=0.95,
                              seed=i).verdict for i in range(30)]
    assert gain.count("better") >= 27


def test_compare_verdicts_missing_benchmarks_and_unpaired_problems():
    base = report({"s": [0] * 10 + [4] * 10, "m": [2] * 20})
    better = report({"s": [4] * 20, "m": [2] * 20, "new": [1] * 5})
    rows = compare_reports(better, base, confidence=0.95, seed=0)
    assert [(r.benchmark, r.verdict) for r in rows] == [("m", "tie"), ("new", "new"), ("s", "better")]
    s = rows[2]
    assert (s.candidate, s.baseline, s.delta, s.n_paired) == (1.0, 0.5, 0.5, 20) and 0 < s.low < 0.5 < s.high
    assert s.interval_text() == f"+0.50 [{s.low:.2f}, {s.high:.2f}]"
    assert rows[0].interval_text() == "+0.00 [0.00, 0.00]" and rows[1].interval_text() == "-"
    worse = compare_benchmark(base, better, "s", confidence=0.95, seed=0)
    assert worse.verdict == "worse" and worse.high < 0
    other_ids = report({"s": [4] * 20}, ids=[f"z{i}" for i in range(20)])
    assert compare_benchmark(other_ids, base, "s", confidence=0.95, seed=0).verdict == "unpaired"
    # pairing is by problem id: a report with half the problems is compared on those
    half = report({"s": [4] * 10}, ids=[f"q{i}" for i in range(10, 20)])
    h = compare_benchmark(half, base, "s", confidence=0.95, seed=0)
    assert h.n_paired == 10 and h.delta == 0.0 and h.verdict == "tie"
    with pytest.raises(ValueError, match="no benchmark 'm'"):
        compare_benchmark(half, base, "m", confidence=0.95, seed=0)
    assert [r.verdict for r in compare_reports(better, None, confidence=0.95, seed=0)] == ["new"] * 3
    md = comparisons_markdown(rows, "nightly")
    assert "| s | 0.500 | 1.000 | +0.50 [" in md and "| better |" in md and "| new | - | 0.250 | - | 0 | new |" in md
    assert "| REGRESSION |" in comparisons_markdown([worse], "n")


def test_rank_prefers_the_best_and_on_ties_the_later_stage():
    reps = {"sft": report({"s": [1] * 10}), "rl-stage-1": report({"s": [3] * 10}),
            "rl-stage-2": report({"s": [2] * 10}), "rl-stage-3": report({"s": [3] * 10})}
    assert [s for s, _ in rank_checkpoints(reps, "s")] == ["rl-stage-3", "rl-stage-1", "rl-stage-2", "sft"]
    with pytest.raises(ValueError, match="evaluation of rl-stage-2 has no pass@1 for benchmark 'x'"):
        rank_checkpoints({"rl-stage-2": reps["rl-stage-2"]}, "x")
    with pytest.raises(ValueError, match="at least one"):
        rank_checkpoints({}, "s")
    assert primary_benchmark(load_config("qwen3-14b-mi300x").eval) == "aime24"
    assert primary_benchmark(load_config("tiny").eval) == "synthetic"


SFT = report({"s": [0] * 12 + [4] * 8})            # pass@1 0.40
RL = report({"s": [4] * 16 + [0] * 4})             # 0.80: 8 problems gained, 4 lost


def _decide(stage, rep, champion):
    return decide_promotion(stage, rep, SFT, champion=champion, benchmark="s", confidence=0.95, seed=1234)


def test_promotion_no_alias_when_rl_is_not_better_than_sft():
    same = _decide("rl-stage-1", report({"s": [0] * 12 + [4] * 8}), None)
    assert same.aliases == () and same.reason == "RL did not beat SFT beyond noise"
    assert same.line() == "rl-stage-1 0.40 vs sft 0.40, +0.00 [0.00, 0.00] -> no alias (RL did not beat SFT beyond noise)"
    noisy = _decide("rl-stage-1", report({"s": [0] * 9 + [4] * 3 + [0] * 2 + [4] * 6}), None)  # 3 gained, 2 lost
    assert noisy.aliases == () and noisy.vs_sft.low < 0 < noisy.vs_sft.high
    worse = _decide("rl-stage-2", report({"s": [0] * 20}), None)
    assert worse.aliases == () and worse.reason == "RL made it worse than SFT"
    assert _decide("sft", SFT, None).aliases == ()
    assert "RL did not help" in _decide("sft", SFT, None).line()


def test_promotion_candidate_but_not_champion_when_it_ties_the_champion():
    p = _decide("rl-stage-1", RL, ("version 3", report({"s": [4] * 16 + [0] * 4})))
    assert p.aliases == ("candidate",) and p.reason == "ties the champion"
    assert p.vs_sft.verdict == "better" and p.vs_champion.verdict == "tie"
    assert p.line().startswith("rl-stage-1 0.80 vs sft 0.40, +0.40 [")
    assert p.line().endswith("; vs champion (version 3) 0.80, +0.00 [0.00, 0.00] -> candidate (ties the champion)")
    lost = _decide("rl-stage-1", RL, ("version 3", report({"s": [4] * 20})))
    assert lost.aliases == ("candidate",) and lost.reason == "worse than the champion"
    gone = _decide("rl-stage-1", RL, ("version 3", None))
    assert gone.aliases == ("candidate",) and "cannot be found" in gone.reason


def test_promotion_champion_when_clearly_better_or_none_yet():
    p = _decide("rl-stage-2", RL, ("version 3", SFT))
    assert p.aliases == ("candidate", "champion") and p.vs_champion.verdict == "better"
    first = _decide("rl-stage-2", RL, None)
    assert first.aliases == ("candidate", "champion") and first.line().endswith("-> candidate, champion (no champion yet)")
    again = decide_promotion("rl-stage-2", RL, SFT, champion=("version 3", SFT), benchmark="s", confidence=0.95,
                             seed=1234)
    assert again == p  # seeded: the same reports give the same decision and numbers
    d = p.to_json()
    assert d["aliases"] == ["candidate", "champion"] and d["line"] == p.line() and d["vs_sft"]["verdict"] == "better"


def test_reports_measured_another_way_are_incomparable_not_better_or_worse():
    from dataclasses import replace

    base = replace(report({"s": [0] * 20}), protocol={"k": K, "temperature": 0.6, "max_tokens": 64, "seed": 0,
                                                    "seconds": 3.0},
                   benchmark_digests={"s": "a" * 64})
    high = report({"s": [4] * 20})  # clearly better if it were measured the same way
    same = replace(high, protocol={**base.protocol, "seed": 1, "seconds": 9.0}, benchmark_digests={"s": "a" * 64})
    assert compare_benchmark(same, base, "s", confidence=0.95, seed=0).verdict == "better"  # seed, time: free
    cases = [({"k": 8}, {}, "k: 8 vs 4"), ({"max_tokens": 128}, {}, "max_tokens: 128 vs 64"),
             ({"temperature": 1.0}, {}, "temperature: 1.0 vs 0.6"), ({}, {"s": "b" * 64}, "s content: digest bbbbbbbbbbbb vs aaaaaaaaaaaa")]
    for proto, digests, needle in cases:
        other = replace(same, protocol={**same.protocol, **proto}, benchmark_digests={"s": "a" * 64, **digests})
        for a, b in ((other, base), (base, other)):
            c = compare_benchmark(a, b, "s", confidence=0.95, seed=0)
            assert c.verdict == "incomparable" and c.delta is None and c.interval_text() == "-"
        c = compare_benchmark(other, base, "s", confidence=0.95, seed=0)
        assert c.differs == (needle,) and c.baseline == 0.0 and c.candidate == 1.0
        assert f"| not comparable ({needle}) |" in comparisons_markdown([c], "n")
    # a protocol entry only one report has
    newer = replace(same, protocol={**same.protocol, "top_p": 0.95})
    assert compare_benchmark(newer, base, "s", confidence=0.95, seed=0).differs == ("top_p: 0.95 vs absent",)
    # a report without a digest for the benchmark cannot tell: compared on its protocol
    assert compare_benchmark(replace(same, benchmark_digests={}), base, "s", confidence=0.95, seed=0).verdict == "better"


def test_promotion_decides_nothing_on_an_incomparable_evaluation():
    from dataclasses import replace

    rl, sft = replace(RL, protocol={"k": K, "seed": 0}), replace(SFT, protocol={"k": K, "seed": 0})
    p = decide_promotion("rl-stage-1", rl, replace(sft, protocol={"k": 8, "seed": 0}), champion=None,
                         benchmark="s", confidence=0.95, seed=1234)
    assert p.aliases == () and p.reason == "not comparable with the SFT evaluation: k: 4 vs 8"
    champ = replace(report({"s": [0] * 20}), protocol={"k": K, "max_tokens": 32, "seed": 0})  # far worse, other limit
    q = decide_promotion("rl-stage-1", replace(rl, protocol={"k": K, "max_tokens": 64, "seed": 0}),
                         replace(sft, protocol={"k": K, "max_tokens": 64, "seed": 0}), champion=("version 3", champ),
                         benchmark="s", confidence=0.95, seed=1234)
    assert q.vs_sft.verdict == "better" and q.vs_champion.verdict == "incomparable"
    assert q.aliases == ("candidate",) and "champion (version 3) kept" in q.reason and "max_tokens: 64 vs 32" in q.reason
    d = q.to_json()
    assert d["vs_champion"]["differs"] == ["max_tokens: 64 vs 32"] and json.loads(json.dumps(d)) == d
