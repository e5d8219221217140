"""Evaluation metrics over k sampled trajectories per problem: `pass_at_k(n, c, k)` (the unbiased
estimator), mean pass@1 = avg@k, response length, tool calls and tool-error ratio, truncation, and
infrastructure failures: samples the infrastructure failed (an engine error, a tool call the service
failed, a grader timeout or error: `Trajectory.infra_failed`, `reward.GRADER_FAILURES`).

`ProblemRow` is one row of the per-problem table, `BenchmarkMetrics` the aggregate, `EvalReport` both
for every benchmark of one checkpoint (what `eval.run.evaluate` returns, report.json reloads, and
`eval.compare` and `eval.promotion` read). Invariant: all are frozen and JSON-able; the service's own
failures (`infra`) count in neither the tool calls nor the tool errors, and infrastructure failures
score 0, so they can only lower pass@1 (by at most their share). See docs/data-and-eval.md, "Metrics".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rstar2_core import storage
from rstar2_core.reward.grade import GRADER_FAILURES


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    p_fail = 1.0
    for i in range(n - c + 1, n + 1):
        p_fail *= 1.0 - k / i
    return 1.0 - p_fail


@dataclass(frozen=True)
class ProblemRow:
    id: str
    answer: str
    n: int
    n_correct: int
    pass1: float
    pass_k: float
    mean_response_tokens: float
    mean_tool_calls: float
    tool_errors: int
    tool_calls: int
    truncated: int
    top_answer: str | None     # the most frequent extracted answer (ties: first seen)
    reasons: dict              # grade reason -> count
    infra_failed: int = 0      # samples the infrastructure failed (module docstring); they score 0


@dataclass(frozen=True)
class BenchmarkMetrics:
    name: str
    n_problems: int
    k: int
    pass1: float               # mean pass@1 = avg@k
    pass_k: float              # mean unbiased pass@k
    mean_response_tokens: float
    mean_generated_tokens: float
    tool_calls_per_traj: float
    tool_error_ratio: float
    truncation_rate: float
    no_answer_rate: float
    grader_timeouts: int
    infra_failures: int = 0    # samples the infrastructure failed (module docstring)

    @property
    def infra_failed_share(self) -> float:
        """Share of the n_problems x k samples the infrastructure failed: pass@1 is at most this much too low."""
        n = self.n_problems * self.k
        return self.infra_failures / n if n else 0.0

    def as_metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat `eval/<bench>/<metric>` dict for `log_metrics`."""
        keys = ("pass1", "pass_k", "mean_response_tokens", "mean_generated_tokens", "tool_calls_per_traj",
                "tool_error_ratio", "truncation_rate", "no_answer_rate", "infra_failed_share")
        return {f"{prefix}/{self.name}/{k}": float(getattr(self, k)) for k in keys}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def problem_row(pid: str, answer: str, trajs: Sequence[Any], grades: Sequence[Any], k: int) -> ProblemRow:
    n = len(trajs)
    if n == 0 or len(grades) != n:
        raise ValueError(f"problem {pid}: {n} trajectories and {len(grades)} grades; need n >= 1 of each")
    c = sum(g.reward >= 1.0 for g in grades)
    calls = [[tc for tc in t.tool_calls if not tc.infra] for t in trajs]
    extracted = Counter(g.extracted for g in grades if g.extracted is not None)
    return ProblemRow(
        id=pid, answer=answer, n=n, n_correct=c, pass1=c / n, pass_k=pass_at_k(n, c, min(k, n)),
        mean_response_tokens=_mean([len(t.response_ids) for t in trajs]),
        mean_tool_calls=_mean([len(cs) for cs in calls]),
        tool_errors=sum(tc.failed for cs in calls for tc in cs), tool_calls=sum(len(cs) for cs in calls),
        truncated=sum(bool(t.truncated) for t in trajs),
        top_answer=extracted.most_common(1)[0][0] if extracted else None,
        reasons=dict(Counter(g.reason for g in grades)),
        infra_failed=sum(t.infra_failed or g.reason in GRADER_FAILURES for t, g in zip(trajs, grades)),
    )


def aggregate(name: str, rows: Sequence[ProblemRow], trajs: Sequence[Sequence[Any]], k: int) -> BenchmarkMetrics:
    flat = [t for g in trajs for t in g]
    n_traj = len(flat)
    calls = sum(r.tool_calls for r in rows)
    reasons: Counter = Counter()
    for r in rows:
        reasons.update(r.reasons)
    return BenchmarkMetrics(
        name=name, n_problems=len(rows), k=k,
        pass1=_mean([r.pass1 for r in rows]), pass_k=_mean([r.pass_k for r in rows]),
        mean_response_tokens=_mean([len(t.response_ids) for t in flat]),
        mean_generated_tokens=_mean([t.n_generated_tokens for t in flat]),
        tool_calls_per_traj=calls / n_traj if n_traj else 0.0,
        tool_error_ratio=sum(r.tool_errors for r in rows) / calls if calls else 0.0,
        truncation_rate=sum(r.truncated for r in rows) / n_traj if n_traj else 0.0,
        no_answer_rate=reasons["no_answer"] / n_traj if n_traj else 0.0,
        grader_timeouts=reasons["grader_timeout"],
        infra_failures=sum(r.infra_failed for r in rows),
    )


@dataclass(frozen=True)
class EvalReport:
    """Per-benchmark metrics and per-problem rows of one checkpoint, and where the report files are.
    JSON form (`to_json`, report.json): {"benchmarks": {name: BenchmarkMetrics fields}, "rows": {name:
    [ProblemRow fields]}, "protocol", "checkpoint_url", "benchmark_digests", report URLs}."""

    checkpoint_url: str
    metrics: dict[str, BenchmarkMetrics]
    rows: dict[str, tuple[ProblemRow, ...]]
    protocol: dict
    out_url: str | None = None
    report_url: str | None = None
    json_url: str | None = None
    plot_urls: tuple[str, ...] = ()
    benchmark_digests: dict = field(default_factory=dict)

    def pass1(self) -> dict[str, float]:
        """{benchmark: mean pass@1 (avg@k)}."""
        return {name: m.pass1 for name, m in self.metrics.items()}

    def to_json(self) -> dict:
        return {"checkpoint_url": self.checkpoint_url, "protocol": self.protocol, "out_url": self.out_url,
                "report_url": self.report_url, "json_url": self.json_url, "plot_urls": list(self.plot_urls),
                "benchmark_digests": self.benchmark_digests,
                "benchmarks": {k: asdict(v) for k, v in self.metrics.items()},
                "rows": {k: [asdict(r) for r in v] for k, v in self.rows.items()}}

    @classmethod
    def from_json(cls, d: dict) -> EvalReport:
        return cls(checkpoint_url=d["checkpoint_url"], protocol=d["protocol"], out_url=d.get("out_url"),
                   report_url=d.get("report_url"), json_url=d.get("json_url"),
                   plot_urls=tuple(d.get("plot_urls", ())), benchmark_digests=d.get("benchmark_digests", {}),
                   metrics={k: BenchmarkMetrics(**v) for k, v in d["benchmarks"].items()},
                   rows={k: tuple(ProblemRow(**r) for r in v) for k, v in d["rows"].items()})

    @classmethod
    def load(cls, url: str) -> EvalReport:
        """Load `report.json` (or the folder holding it)."""
        if not url.endswith(".json"):
            url = storage.join(url, "report.json")
        if not storage.exists(url):
            raise FileNotFoundError(f"{url}: no evaluation report here; pass the out folder of `rstar2 eval`")
        return cls.from_json(storage.read_json(url))
