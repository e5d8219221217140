"""Evaluation reports: markdown tables, PNG plots (matplotlib, Agg backend) and comparisons.

- `write_report(report, out_url)`: `report.md`, `report.json`, `summary.png` under `out_url`; returns
  the report with those URLs filled in.
- `metrics_table(metrics)`, `problems_table(rows)`: markdown tables (also what `rstar2 eval` prints).
- `plot_history(points, out_url)`: pass@1, response length and tool-error ratio over checkpoints.
- `diff_markdown(a, b)`: metric deltas per benchmark and a per-problem diff.

Invariant: `diff_markdown` refuses (`ReportsNotComparable`, a ValueError) two reports not measured the
same way unless `allow_mismatch=True`, which heads the diff with what differs. See
docs/data-and-eval.md, "Evaluating a checkpoint".
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import replace

from rstar2_core import storage
from rstar2_core.eval.compare import measurement_differences
from rstar2_core.eval.metrics import BenchmarkMetrics, EvalReport, ProblemRow

COLUMNS = (("pass1", "pass@1 (avg@k)", "{:.3f}"), ("pass_k", "pass@k", "{:.3f}"),
           ("mean_response_tokens", "resp. tokens", "{:.0f}"), ("tool_calls_per_traj", "tool calls/traj", "{:.2f}"),
           ("tool_error_ratio", "tool-error ratio", "{:.3f}"), ("truncation_rate", "truncated", "{:.3f}"),
           ("infra_failed_share", "infra-failed", "{:.3f}"))
PLOTTED = (("pass1", "pass@1 (avg@k)"), ("mean_response_tokens", "mean response tokens"),
           ("tool_error_ratio", "tool-error ratio"))


def metrics_table(metrics: dict[str, BenchmarkMetrics]) -> str:
    head = "| benchmark | problems | k | " + " | ".join(c[1] for c in COLUMNS) + " |"
    sep = "|" + "---|" * (3 + len(COLUMNS))
    lines = [head, sep]
    for name, m in metrics.items():
        vals = " | ".join(fmt.format(getattr(m, key)) for key, _, fmt in COLUMNS)
        lines.append(f"| {name} | {m.n_problems} | {m.k} | {vals} |")
    return "\n".join(lines)


def problems_table(rows: Sequence[ProblemRow]) -> str:
    lines = ["| id | gold | correct | pass@1 | top answer | resp. tokens | tool calls | tool errors | truncated |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        top = (r.top_answer or "").replace("|", "\\|")[:40]
        gold = r.answer.replace("|", "\\|")[:40]
        lines.append(f"| {r.id} | {gold} | {r.n_correct}/{r.n} | {r.pass1:.3f} | {top} | "
                     f"{r.mean_response_tokens:.0f} | {r.tool_calls} | {r.tool_errors} | {r.truncated} |")
    return "\n".join(lines)


def render_markdown(report: EvalReport) -> str:
    p = report.protocol
    out = [f"# Evaluation of `{report.checkpoint_url}`", "",
           (f"Protocol: k={p['k']}, temperature {p['temperature']}, top_p {p['top_p']}, max turns "
           f"{p['max_turns']}, max tokens {p['max_tokens']}, seed {p['seed']}."), "",
           metrics_table(report.metrics), ""]
    for name, rows in report.rows.items():
        out += [f"## {name}: per problem", "", problems_table(rows), ""]
    return "\n".join(out)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def summary_png(metrics: dict[str, BenchmarkMetrics]) -> bytes:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(4 * len(PLOTTED), 3.2))
    names = list(metrics)
    for ax, (key, title) in zip(axes, PLOTTED):
        ax.bar(names, [getattr(metrics[n], key) for n in names], color="#4c72b0")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
        if key in ("pass1", "tool_error_ratio"):
            ax.set_ylim(0, 1)
    fig.tight_layout()
    return _png(fig)


def write_report(report: EvalReport, out_url: str) -> EvalReport:
    """Write report.md, summary.png and report.json (last) under out_url; return the updated report."""
    md_url, json_url, png_url = (storage.join(out_url, n) for n in ("report.md", "report.json", "summary.png"))
    report = replace(report, out_url=out_url, report_url=md_url, json_url=json_url, plot_urls=(png_url,))
    storage.write_text_atomic(md_url, render_markdown(report))
    storage.write_bytes_atomic(png_url, summary_png(report.metrics))
    storage.write_text_atomic(json_url, json.dumps(report.to_json(), indent=1, sort_keys=True))
    return report


def plot_history(points: Sequence[tuple[str, dict[str, BenchmarkMetrics]]], out_url: str) -> list[str]:
    """One PNG per plotted metric over the labelled checkpoints in `points` (label, metrics by benchmark)."""
    if not points:
        raise ValueError("plot_history needs at least one (label, metrics) point")
    plt = _pyplot()
    labels = [lab for lab, _ in points]
    benches = sorted({b for _, ms in points for b in ms})
    urls = []
    for key, title in PLOTTED:
        fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(labels)), 3.2))
        for b in benches:
            ys = [getattr(ms[b], key) if b in ms else float("nan") for _, ms in points]
            ax.plot(range(len(labels)), ys, marker="o", label=b)
        ax.set_xticks(range(len(labels)), labels, rotation=30)
        ax.set_title(title)
        ax.legend(fontsize=8)
        url = storage.join(out_url, f"history_{key}.png")
        storage.write_bytes_atomic(url, _png(fig))
        urls.append(url)
    return urls


class ReportsNotComparable(ValueError):
    """Two reports measured differently (`compare.measurement_differences`) given to `diff_markdown`."""


def diff_markdown(a: EvalReport, b: EvalReport, labels: tuple[str, str] = ("A", "B"), *, allow_mismatch: bool = False) -> str:
    """Markdown comparison of two EvalReports on their common benchmarks, with a per-problem diff.
    ValueError when they share no benchmark; `ReportsNotComparable` when a common benchmark was measured
    differently (another k, temperature, turn or token limit, or benchmark content) and `allow_mismatch` is False:
    such pass@1s differ by the protocol as much as by the model."""
    la, lb = labels
    out = [f"# Comparison: {la} = `{a.checkpoint_url}` vs {lb} = `{b.checkpoint_url}`", ""]
    common = [n for n in a.metrics if n in b.metrics]
    if not common:
        raise ValueError(f"no benchmark in common: {sorted(a.metrics)} vs {sorted(b.metrics)}")
    differs = {n: d for n in common if (d := measurement_differences(a, b, n))}
    if differs:
        what = "; ".join(f"{n}: {', '.join(d)}" for n, d in differs.items())
        if not allow_mismatch:
            raise ReportsNotComparable(f"the reports were not measured the same way ({what}; {la}'s value first), so their "
                             "pass@1s do not compare: evaluate both with the same protocol and benchmark files, or "
                             "allow the mismatch to see the diff anyway")
        out += [(f"**Not measured the same way** ({la}'s value first): {what}. The deltas below mix the "
                 "models' difference with the protocol's."), ""]
    out += [f"| benchmark | metric | {la} | {lb} | delta |", "|---|---|---|---|---|"]
    for n in common:
        for key, title, fmt in COLUMNS:
            va, vb = getattr(a.metrics[n], key), getattr(b.metrics[n], key)
            out.append(f"| {n} | {title} | {fmt.format(va)} | {fmt.format(vb)} | {vb - va:+.3f} |")
    for n in common:
        ra = {r.id: r for r in a.rows[n]}
        rb = {r.id: r for r in b.rows[n]}
        changed = [(rb[i].pass1 - ra[i].pass1, i) for i in ra if i in rb and ra[i].pass1 != rb[i].pass1]
        changed.sort(key=lambda x: (-abs(x[0]), x[1]))
        up = sum(d > 0 for d, _ in changed)
        only = sorted(set(ra) ^ set(rb))
        out += ["", f"## {n}: per-problem diff", "",
                f"{len(changed)} of {len(set(ra) & set(rb))} problems changed: {up} improved, "
                f"{len(changed) - up} regressed" + (f"; {len(only)} in only one report" if only else "") + ".", ""]
        if changed:
            out += [f"| id | {la} correct | {lb} correct | delta pass@1 |", "|---|---|---|---|"]
            out += [f"| {i} | {ra[i].n_correct}/{ra[i].n} | {rb[i].n_correct}/{rb[i].n} | {d:+.3f} |"
                    for d, i in changed]
    return "\n".join(out) + "\n"
