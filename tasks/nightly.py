"""History of nightly evaluations: each night's result (pass@1 table and the URL of its report.json) under
`<storage root>/nightly/`, so the next night compares against the previous one (whatever model was
champion then) with the core's paired comparison (rstar2_core/eval/compare.py), the one promotion uses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rstar2_core import storage
from rstar2_core.config import Config
from rstar2_core.eval.compare import Comparison, compare_reports, comparisons_markdown
from rstar2_core.eval.run import EvalReport


@dataclass(frozen=True)
class NightlyComparison:
    """Tonight against the previous night: per-benchmark rows, their markdown, the regressed benchmarks."""

    rows: list[dict]
    markdown: str
    regressions: list[str]


def _dir(cfg: Config) -> str:
    return storage.join(cfg.resolved_storage_root(), "nightly")


def previous(cfg: Config) -> dict | None:
    """The most recent recorded nightly result, or None on the first night."""
    fs, path = storage.fs_for(_dir(cfg))
    if not fs.exists(path):
        return None
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False) if p.endswith(".json"))
    return storage.read_json(storage.join(_dir(cfg), names[-1])) if names else None


def record(cfg: Config, result: dict, flow_run_id: str | None) -> str:
    """Store tonight's result (names sort by time); returns its URL."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    url = storage.join(_dir(cfg), f"{stamp}-{(flow_run_id or 'local')[:8]}.json")
    storage.write_json_atomic(url, {**result, "recorded_at": stamp, "flow_run_id": flow_run_id})
    return url


def compare_with_previous(cfg: Config, model: str, version: str | None, report: EvalReport) -> NightlyComparison:
    """Compare tonight's `report` with the previous night's (its report.json, per problem); a benchmark
    whose paired interval lies below 0 is a regression. Without a previous report every row is `new`."""
    prev = previous(cfg)
    url = (prev or {}).get("report_url")
    prev_report = EvalReport.load(url) if url and storage.exists(url) else None
    rows: list[Comparison] = compare_reports(report, prev_report, confidence=cfg.eval.comparison_confidence,
                                             seed=cfg.eval.seed)
    if prev is None:
        title = f"Nightly eval of {model}: first night"
    else:
        title = (f"Nightly eval of {model} (version {version or '-'}) vs previous nightly "
                 f"(version {prev.get('version') or '-'})")
        if prev_report is None:
            title += ": the previous night's report is gone, nothing to compare"
    return NightlyComparison(rows=[_row(r) for r in rows], markdown=comparisons_markdown(rows, title),
                             regressions=[r.benchmark for r in rows if r.verdict == "worse"])


def _row(c: Comparison) -> dict:
    return {"benchmark": c.benchmark, "previous": c.baseline, "current": c.candidate, "delta": c.delta,
            "low": c.low, "high": c.high, "n_paired": c.n_paired, "verdict": c.verdict,
            "regression": c.verdict == "worse"}
