"""History of nightly evaluations: each night's result (pass@1 table and the URL of its report.json) under
`<storage root>/nightly/`, so the next night compares against the previous one (whatever model was
champion then) with the core's paired comparison (rstar2_core/eval/compare.py), the one promotion uses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rstar2_core import storage
from rstar2_core.config import Config
from rstar2_core.eval.compare import Comparison, compare_reports, comparisons_markdown
from rstar2_core.eval.metrics import EvalReport


@dataclass(frozen=True)
class NightlyComparison:
    """Tonight against the previous night: per-benchmark rows, their markdown, the regressed benchmarks."""

    rows: list[dict]
    markdown: str
    regressions: list[str]
    incomparable: list[str] = field(default_factory=list)
    """Benchmarks the previous night measured another way (protocol or benchmark content): no verdict."""


def _dir(cfg: Config) -> str:
    return storage.join(cfg.resolved_storage_root(), "nightly")


def _records(cfg: Config) -> list[str]:
    """The recorded nightly results' file names, oldest first (names sort by time)."""
    fs, path = storage.fs_for(_dir(cfg))
    if not fs.exists(path):
        return []
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False) if p.endswith(".json"))


def previous(cfg: Config, flow_run_id: str | None = None) -> dict | None:
    """The most recent nightly result recorded by another flow run than `flow_run_id`, or None on the first
    night. Skipping the current flow run's own record is what keeps a retried night (the UI's Retry reruns
    the same flow run after its first attempt recorded and then failed on a regression) comparing against
    the night before, not against itself."""
    for name in reversed(_records(cfg)):
        rec = storage.read_json(storage.join(_dir(cfg), name))
        if flow_run_id is None or rec.get("flow_run_id") != flow_run_id:
            return rec
    return None


def record(cfg: Config, result: dict, flow_run_id: str | None) -> str:
    """Store tonight's result; returns its URL. One record per flow run: a retried run replaces its own
    earlier record (keeping its first time stamp, hence its place in the history) instead of adding one."""
    if flow_run_id is not None:
        for name in _records(cfg):
            if name.endswith(f"-{flow_run_id[:8]}.json"):
                url = storage.join(_dir(cfg), name)
                rec = storage.read_json(url)
                if rec.get("flow_run_id") == flow_run_id:
                    storage.write_json_atomic(url, {**result, "recorded_at": rec["recorded_at"],
                                                    "flow_run_id": flow_run_id})
                    return url
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    url = storage.join(_dir(cfg), f"{stamp}-{(flow_run_id or 'local')[:8]}.json")
    storage.write_json_atomic(url, {**result, "recorded_at": stamp, "flow_run_id": flow_run_id})
    return url


def compare_with_previous(cfg: Config, model: str, version: str | None, report: EvalReport,
                          flow_run_id: str | None = None) -> NightlyComparison:
    """Compare tonight's `report` with the previous night's (its report.json, per problem; a record of
    `flow_run_id` itself, tonight's own from an earlier attempt, is skipped); a benchmark whose paired
    interval lies below 0 is a regression. Without a previous report every row is `new`."""
    prev = previous(cfg, flow_run_id)
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
    apart = [r for r in rows if r.verdict == "incomparable"]
    if apart:  # neither a regression nor "ok": say that these benchmarks were not compared, and why
        title += (": " + ", ".join(r.benchmark for r in apart) + " not compared, the previous night measured "
                  "them another way (" + "; ".join(sorted({d for r in apart for d in r.differs})) + ")")
    return NightlyComparison(rows=[_row(r) for r in rows], markdown=comparisons_markdown(rows, title),
                             regressions=[r.benchmark for r in rows if r.verdict == "worse"],
                             incomparable=[r.benchmark for r in apart])


def _row(c: Comparison) -> dict:
    return {"benchmark": c.benchmark, "previous": c.baseline, "current": c.candidate, "delta": c.delta,
            "low": c.low, "high": c.high, "n_paired": c.n_paired, "verdict": c.verdict,
            "regression": c.verdict == "worse", "differs": list(c.differs)}
