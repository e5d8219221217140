"""Comparing evaluation reports: paired bootstrap intervals per benchmark, and ranking checkpoints.

    c = compare_benchmark(candidate, baseline, "synthetic", confidence=0.95, seed=1234)
    c.verdict                        # "better" | "worse" | "tie" | "new" | "unpaired" | "incomparable"
    rows = compare_reports(candidate, baseline, confidence=0.95, seed=1234)   # every benchmark
    ranked = rank_checkpoints({"sft": r0, "rl-stage-1": r1}, "synthetic")   # best first

Invariant: only reports measured the same way are compared (the same protocol but for the seed and
the wall time, the same benchmark content); otherwise the verdict is `incomparable`, with no interval,
and decides nothing. The same reports and seed give the same interval. See docs/data-and-eval.md,
"Comparing two reports".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from rstar2_core.config import EvalConfig
from rstar2_core.eval.metrics import EvalReport

RESAMPLES = 10_000
"""Bootstrap draws per interval: the Monte-Carlo error of its endpoints is then ~1% of their width."""

Verdict = Literal["better", "worse", "tie", "new", "unpaired", "incomparable"]

PROTOCOL_FREE = frozenset({"seed", "seconds"})
"""Protocol entries two reports may differ in and still be compared: the sampling seed (another draw of the
same protocol) and the wall time the evaluation took."""


@dataclass(frozen=True)
class Comparison:
    """Candidate vs baseline on one benchmark. `candidate`/`baseline`: each report's mean pass@1 over all
    its problems (baseline None when it lacks the benchmark); `delta`, `low`, `high`: mean paired
    difference and its interval over the `n_paired` problems both evaluated."""

    benchmark: str
    candidate: float
    baseline: float | None
    delta: float | None
    low: float | None
    high: float | None
    n_paired: int
    confidence: float
    verdict: Verdict
    differs: tuple[str, ...] = ()
    """For `incomparable`: what differs, candidate's value first (`k: 8 vs 4`)."""

    def interval_text(self) -> str:
        """`+0.21 [0.14, 0.28]`, or `-` when nothing was paired."""
        if self.delta is None:
            return "-"
        return f"{self.delta:+.2f} [{self.low:.2f}, {self.high:.2f}]"


def primary_benchmark(eval_cfg: EvalConfig) -> str:
    """The benchmark that ranks checkpoints and decides promotion (`eval.primary_benchmark`, else the
    first one)."""
    return eval_cfg.primary_benchmark or eval_cfg.benchmarks[0].name


def paired_bootstrap(deltas: Sequence[float], confidence: float, seed: int) -> tuple[float, float, float]:
    """(mean, low, high) of the percentile bootstrap interval of mean(deltas) at `confidence`."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    d = np.asarray(deltas, dtype=np.float64)
    if d.size == 0:
        raise ValueError("paired_bootstrap needs at least one paired problem")
    rng = np.random.default_rng(seed)
    chunk = max(1, 4_000_000 // d.size)  # bounded memory for large benchmarks
    means = np.concatenate([d[rng.integers(0, d.size, size=(min(chunk, RESAMPLES - i), d.size))].mean(axis=1)
                            for i in range(0, RESAMPLES, chunk)])
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(d.mean()), float(low), float(high)


def compare_benchmark(candidate: EvalReport, baseline: EvalReport, benchmark: str, *, confidence: float,
                      seed: int) -> Comparison:
    """Paired comparison of two reports on `benchmark` (which the candidate must have)."""
    if benchmark not in candidate.metrics:
        raise ValueError(f"report of {candidate.checkpoint_url} has no benchmark {benchmark!r} "
                         f"(has {sorted(candidate.metrics)})")
    cand = candidate.metrics[benchmark].pass1
    if benchmark not in baseline.metrics:
        return Comparison(benchmark, cand, None, None, None, None, 0, confidence, "new")
    base = baseline.metrics[benchmark].pass1
    differs = measurement_differences(candidate, baseline, benchmark)
    if differs:
        return Comparison(benchmark, cand, base, None, None, None, 0, confidence, "incomparable", differs)
    base_rows = {r.id: r for r in baseline.rows.get(benchmark, ())}
    pairs = [(r.pass1, base_rows[r.id].pass1) for r in candidate.rows.get(benchmark, ()) if r.id in base_rows]
    if not pairs:
        return Comparison(benchmark, cand, base, None, None, None, 0, confidence, "unpaired")
    delta, low, high = paired_bootstrap([a - b for a, b in pairs], confidence, seed)
    verdict: Verdict = "better" if low > 0 else "worse" if high < 0 else "tie"
    return Comparison(benchmark, cand, base, delta, low, high, len(pairs), confidence, verdict)


def measurement_differences(candidate: EvalReport, baseline: EvalReport, benchmark: str) -> tuple[str, ...]:
    """What makes the two reports' pass@1 on `benchmark` not comparable, candidate's value first: protocol
    entries (other than `PROTOCOL_FREE`) that differ or that only one report has, and the benchmark's
    content digest when both have one and they differ. Empty when they were measured the same way."""
    out = []
    cp, bp = candidate.protocol or {}, baseline.protocol or {}
    for key in sorted((set(cp) | set(bp)) - PROTOCOL_FREE):
        a, b = cp.get(key, "absent"), bp.get(key, "absent")
        if a != b:
            out.append(f"{key}: {a} vs {b}")
    da, db = candidate.benchmark_digests.get(benchmark), baseline.benchmark_digests.get(benchmark)
    if da and db and da != db:
        out.append(f"{benchmark} content: digest {str(da)[:12]} vs {str(db)[:12]}")
    return tuple(out)


def compare_reports(candidate: EvalReport, baseline: EvalReport | None, *, confidence: float,
                    seed: int) -> list[Comparison]:
    """`compare_benchmark` for every benchmark of the candidate, sorted by name (all `new` without a
    baseline)."""
    out = []
    for name in sorted(candidate.metrics):
        if baseline is None:
            out.append(Comparison(name, candidate.metrics[name].pass1, None, None, None, None, 0, confidence,
                                  "new"))
        else:
            out.append(compare_benchmark(candidate, baseline, name, confidence=confidence, seed=seed))
    return out


def rank_checkpoints(reports: Mapping[str, EvalReport], benchmark: str) -> list[tuple[str, EvalReport]]:
    """(stage, report) best first by pass@1 on `benchmark`; on a tie the stage listed later wins (it
    trained longer). A report without the benchmark raises, naming the stage."""
    if not reports:
        raise ValueError("rank_checkpoints needs at least one evaluated checkpoint")
    scored = []
    for order, (stage, rep) in enumerate(reports.items()):
        if benchmark not in rep.metrics:
            raise ValueError(f"evaluation of {stage} has no pass@1 for benchmark {benchmark!r} "
                             f"(has {sorted(rep.metrics)})")
        scored.append((rep.metrics[benchmark].pass1, order, stage, rep))
    scored.sort(key=lambda x: (x[0], x[1]), reverse=True)
    return [(stage, rep) for _, _, stage, rep in scored]


def comparisons_markdown(rows: Sequence[Comparison], title: str) -> str:
    """Markdown table of `compare_reports` rows: pass@1 of both, paired delta with its interval, status."""
    status = {"better": "better", "worse": "REGRESSION", "tie": "ok", "new": "new", "unpaired": "not paired",
              "incomparable": "not comparable"}
    conf = f"{rows[0].confidence:.0%}" if rows else "-"
    lines = [f"## {title}", "",
             (f"Paired bootstrap over the eval problems, {conf} interval of the pass@1 difference; a "
              "regression is an interval entirely below 0."), "",
             "| benchmark | previous pass@1 | current pass@1 | delta [interval] | problems paired | status |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        prev = "-" if r.baseline is None else f"{r.baseline:.3f}"
        why = f" ({'; '.join(r.differs)})" if r.differs else ""
        lines.append(f"| {r.benchmark} | {prev} | {r.candidate:.3f} | {r.interval_text()} | {r.n_paired} | "
                     f"{status[r.verdict]}{why} |")
    return "\n".join(lines)
