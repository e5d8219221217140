"""Evaluate a checkpoint on the configured benchmarks with the paper's protocol.

    report = evaluate(cfg, checkpoint_url="file:///.../rl-stage-3/final", out_url="file:///tmp/eval")
    report.metrics["aime24"].pass1   # mean pass@1 = avg@k

Writes `report.md`, `report.json`, `summary.png` and `samples/<benchmark>.jsonl` under `out_url`.
Invariant: seeded, so the same checkpoint, config and seed give the same table; every benchmark is
loaded (a missing file reported) before the model is; past `eval.max_infra_failure_share` of a
benchmark's samples failed by the infrastructure it stops (`InfraFailureShareExceeded`).
See docs/data-and-eval.md, "Evaluating a checkpoint".
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from rstar2_core import storage
from rstar2_core.config import Config
from rstar2_core.data.benchmarks import Benchmark, load_benchmark, resolve_benchmarks
from rstar2_core.errors import InfraFailureShareExceeded
from rstar2_core.eval.grading import grade_all
from rstar2_core.eval.metrics import BenchmarkMetrics, EvalReport, ProblemRow, aggregate, problem_row
from rstar2_core.progress import progress_bar

CHUNK = 32  # problems per rollout call (progress granularity; fixed so that seeds are reproducible)
LogMetrics = Callable[[dict[str, float], int], None]


def protocol_of(cfg: Config, k: int | None = None) -> dict:
    e = cfg.eval
    return {"k": k or e.k, "temperature": e.temperature, "top_p": e.top_p, "max_turns": e.max_turns,
            "max_tokens": e.max_tokens, "seed": e.seed}


def clip_text(text: str, max_chars: int) -> str:
    """First and last max_chars/2 characters of `text` with a marker between (text itself if short)."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + f"\n...[{len(text) - 2 * half} chars omitted]...\n" + text[len(text) - half:] if half else ""


def evaluate_benchmark(bench: Benchmark, sampler: Any, grade_math: Callable, *, k: int, limits: Any, seed: int,
                       progress: bool = True, text_chars: int = 4000, max_infra_failure_share: float
                       ) -> tuple[BenchmarkMetrics, tuple[ProblemRow, ...], list[dict]]:
    """Sample k trajectories per problem, grade, aggregate. Returns metrics, rows and sample records.

    Raises `InfraFailureShareExceeded` (retryable) as soon as more than `max_infra_failure_share` of the
    samples so far failed for infrastructure reasons (`metrics.py`): they score 0, so past that share
    pass@1 would measure the outage, and a promotion or nightly comparison would decide on it."""
    rows: list[ProblemRow] = []
    all_trajs: list[list[Any]] = []
    samples: list[dict] = []
    probs = bench.problems
    infra_failed = 0
    bar = progress_bar(total=len(probs), desc=f"eval {bench.name}", unit="problem", disable=not progress)
    for ci, start in enumerate(range(0, len(probs), CHUNK)):
        chunk = probs[start:start + CHUNK]
        groups = sampler.sample([p.problem for p in chunk], k, limits, seed + ci * CHUNK)
        if len(groups) != len(chunk) or any(len(g) != k for g in groups):
            raise RuntimeError(f"sampler returned {[len(g) for g in groups]} trajectories for {len(chunk)} "
                               f"problems x k={k}")
        kinds = [p.kind for p, g in zip(chunk, groups) for _ in g]
        items = [(t.response_text, p.answer) for p, g in zip(chunk, groups) for t in g]
        grades = grade_all(kinds, items, grade_math)
        pos = 0
        for p, g in zip(chunk, groups):
            gs = grades[pos:pos + len(g)]
            pos += len(g)
            rows.append(problem_row(p.id, p.answer, g, gs, k))
            all_trajs.append(list(g))
            infra_failed += rows[-1].infra_failed
            samples.extend({"id": p.id, "sample": j, "reward": r.reward, "extracted": r.extracted,
                            "reason": r.reason, "finish": t.finish, "truncated": t.truncated,
                            "response_tokens": len(t.response_ids), "tool_calls": t.n_tool_calls,
                            "response_text": clip_text(t.response_text, text_chars)} for j, (t, r) in enumerate(zip(g, gs)))
        sampled = len(rows) * k
        if infra_failed > max_infra_failure_share * sampled:
            bar.close()
            raise InfraFailureShareExceeded(
                f"eval {bench.name}: {infra_failed} of the {sampled} samples so far failed for infrastructure "
                f"reasons (engine errors, sandbox internal errors, grader timeouts or errors), above "
                f"eval.max_infra_failure_share = {max_infra_failure_share}: they score 0, so pass@1 would "
                "measure the outage. A retry samples again; if it repeats, check the engines, the sandbox "
                "pool and eval.grader_timeout_s")
        bar.update(len(chunk))
        if progress and rows:
            bar.set_postfix(pass1=f"{sum(r.pass1 for r in rows) / len(rows):.3f}")
    bar.close()
    return aggregate(bench.name, rows, all_trajs, k), tuple(rows), samples


def evaluate(cfg: Config, *, checkpoint_url: str, out_url: str, benchmarks: Sequence[Any] | None = None,
             k: int | None = None, log_metrics: LogMetrics | None = None, sampler: Any | None = None,
             grade_math: Callable | None = None, progress: bool = True, step: int = 0) -> EvalReport:
    """Evaluate `checkpoint_url` on `benchmarks` (names, BenchmarkConfigs or file URLs; default: all
    configured) with k samples (default `eval.k`). `sampler`/`grade_math` replace the model-backed
    sampler and the grader pool (tests, or a caller that already holds an engine)."""
    from rstar2_core.eval.report import write_report
    from rstar2_core.rollout.types import RolloutLimits

    k = k or cfg.eval.k
    if k < 1:
        raise ValueError(f"k={k}: need at least one sample per problem")
    benches = [load_benchmark(bc, cfg) for bc in resolve_benchmarks(cfg, list(benchmarks or []))]
    for b in benches:
        if not b.problems:
            raise ValueError(f"benchmark {b.name!r} has no usable problems (rejected: {dict(b.rejected)})")
    limits = RolloutLimits.from_config(cfg.rollout, cfg.eval.max_turns, cfg.eval.max_tokens,
                                       cfg.eval.temperature, cfg.eval.top_p)
    own_sampler = sampler is None
    if own_sampler:
        from rstar2_core.eval.sampler import PolicySampler

        sampler = PolicySampler.open(cfg, checkpoint_url)
    pool = None
    if grade_math is None:
        from rstar2_core.reward import GraderPool

        pool = GraderPool(timeout_s=cfg.eval.grader_timeout_s).__enter__()
        grade_math = pool.grade_many
    metrics, rows, samples = {}, {}, {}
    t0 = time.time()
    try:
        for b in benches:
            m, r, s = evaluate_benchmark(b, sampler, grade_math, k=k, limits=limits, seed=cfg.eval.seed,
                                         progress=progress, text_chars=cfg.eval.sample_text_chars,
                                         max_infra_failure_share=cfg.eval.max_infra_failure_share)
            metrics[b.name], rows[b.name], samples[b.name] = m, r, s
            if log_metrics is not None:
                log_metrics(m.as_metrics(), step)
    finally:
        if pool is not None:
            pool.__exit__(None, None, None)
        if own_sampler:
            sampler.close()
    proto = protocol_of(cfg, k) | {"seconds": round(time.time() - t0, 2)}
    report = EvalReport(checkpoint_url, metrics, rows, proto,
                        benchmark_digests={b.name: b.digest for b in benches})
    for name, recs in samples.items():
        storage.write_text_atomic(storage.join(out_url, "samples", f"{name}.jsonl"),
                                  "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in recs))
    return write_report(report, out_url)
