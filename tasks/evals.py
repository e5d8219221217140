"""Reading the core's evaluation reports: pass@1 per benchmark, the primary benchmark, comparisons.

`pass1_by_benchmark(report_json)` takes the JSON form of `rstar2_core.eval.run.EvalReport`.
"""

from __future__ import annotations

from rstar2_core.config import Config


def primary_benchmark(cfg: Config) -> str:
    return cfg.eval.primary_benchmark or cfg.eval.benchmarks[0].name


def pass1_by_benchmark(report: dict) -> dict[str, float]:
    """{benchmark: mean pass@1} from an EvalReport's JSON."""
    out: dict[str, float] = {}
    for name, res in (report.get("benchmarks") or {}).items():
        out[name] = float(res["pass1"] if "pass1" in res else res["pass@1"])
    if not out:
        for key, v in (report.get("metrics") or {}).items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "eval" and parts[2] in ("pass@1", "pass1"):
                out[parts[1]] = float(v)
    if not out:
        raise ValueError(f"evaluation report has no per-benchmark pass@1 (keys {sorted(report)})")
    return out


def compare(previous: dict[str, float] | None, current: dict[str, float], threshold: float) -> list[dict]:
    """Rows {benchmark, previous, current, delta, regression} for every benchmark in `current`."""
    rows = []
    for b, cur in sorted(current.items()):
        prev = (previous or {}).get(b)
        delta = None if prev is None else cur - prev
        rows.append({"benchmark": b, "previous": prev, "current": cur, "delta": delta,
                     "regression": delta is not None and delta < -threshold})
    return rows


def comparison_markdown(rows: list[dict], threshold: float, title: str) -> str:
    def f(x):
        return "-" if x is None else f"{x:.3f}"

    lines = [f"## {title}", "", f"Regression threshold: pass@1 drop > {threshold:.3f}", "",
             "| benchmark | previous pass@1 | current pass@1 | delta | status |", "|---|---|---|---|---|"]
    for r in rows:
        status = "REGRESSION" if r["regression"] else ("new" if r["previous"] is None else "ok")
        delta = "-" if r["delta"] is None else f"{r['delta']:+.3f}"
        lines.append(f"| {r['benchmark']} | {f(r['previous'])} | {f(r['current'])} | {delta} | {status} |")
    return "\n".join(lines)
