"""What a finished recipe run shows its user: the stage table (pass@1 and wall time per stage), the promotion
decision with its numbers, the registration, where the time went, and one PNG of the run's curves.

    timings = stage_timings(cfg, parent_run_id)              # StageTiming per nested MLflow stage run
    png_url = write_plot(cfg, store, summary, order, parent)  # <run store>/summary/recipe.png, also on MLflow
    md = summary_markdown(summary, order, timings, png_url)
    md = render_summary(cfg, store, summary, order, parent)  # all three

Invariant: everything is read back from MLflow and the run store, never from the processes that ran the
stages, so the same code renders any finished run's summary. See docs/pipeline.md, "MLflow lineage".
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from rstar2_core import storage
from rstar2_core.config import Config
from tasks import tracking
from tasks.run_store import RunStore

PLOT_NAME = "recipe.png"


@dataclass(frozen=True)
class StageTiming:
    """One stage's nested MLflow run: seconds from the parent run's start to its start and end."""

    stage: str
    start_s: float
    end_s: float
    status: str

    @property
    def wall_s(self) -> float:
        return self.end_s - self.start_s


def stage_timings(cfg: Config, parent_run_id: str) -> list[StageTiming]:
    """Timing of every finished nested stage run of `parent_run_id`, ordered by start (a stage still running
    or never ended is left out)."""
    c = tracking.client(cfg)
    parent = c.get_run(parent_run_id)
    t0 = parent.info.start_time
    runs = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}'",
                         max_results=1000)
    out = [StageTiming(r.data.tags.get("rstar2.stage", r.info.run_name), (r.info.start_time - t0) / 1000,
                       (r.info.end_time - t0) / 1000, r.info.status)
           for r in runs if r.info.end_time]
    return sorted(out, key=lambda t: (t.start_s, t.stage))


def critical_path(timings: list[StageTiming], slack_s: float = 30.0) -> list[StageTiming]:
    """The chain of stages that decided the run's length, read back from the timings: from the stage that
    ended last, repeatedly the stage that ended last before this one started (within `slack_s` of
    dispatch time). A stage that ran beside the chain (an evaluation overlapping the next stage's
    training) is not on it."""
    if not timings:
        return []
    chain = [max(timings, key=lambda t: t.end_s)]
    while True:
        start = chain[-1].start_s
        before = [t for t in timings if t.end_s <= start + 1e-6 and t.end_s >= start - slack_s and t not in chain]
        if not before:
            return chain[::-1]
        chain.append(max(before, key=lambda t: t.end_s))


CURVES = ("rollout/pass_rate", "rollout/pos_tool_error_ratio", "rollout/kept_pos_tool_error_ratio")
"""Per-step RL metrics the plot draws for every RL stage (steps count across stages)."""


def recipe_curves(cfg: Config, store: RunStore, order: list[str]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{metric: {stage: [(step, value)]}} of the run's stage runs in MLflow: `sft/loss` of the SFT stage and
    `CURVES` of every RL stage in `order` (a stage that logged none is left out)."""
    c = tracking.client(cfg)

    def history(stage: str, key: str) -> list[tuple[int, float]]:
        run_id = store.tracking_id(stage)
        if run_id is None:
            return []
        return sorted((m.step, m.value) for m in c.get_metric_history(run_id, tracking.metric_key(key)))

    out = {"sft/loss": {"sft": history("sft", "sft/loss")}}
    for key in CURVES:
        out[key] = {st: history(st, key) for st in order if st != "sft"}
    return {k: {st: pts for st, pts in v.items() if pts} for k, v in out.items()}


def recipe_plot(curves: dict[str, dict[str, list[tuple[int, float]]]], summary: dict[str, Any],
                order: list[str]) -> bytes:
    """PNG of the run's curves (`recipe_curves`) and eval pass@1 per stage on the primary benchmark (the
    registered stage marked). Panels: SFT loss per step; RL training pass rate per step, one colour per RL
    stage; the failed-call ratio among the sampled positives (solid) and among the positives trained on
    (dashed); eval pass@1 bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 7.5))
    sft = curves.get("sft/loss", {}).get("sft", [])
    ax[0, 0].plot([s for s, _ in sft], [v for _, v in sft], lw=0.8, color="gray")
    ax[0, 0].set(title="SFT loss", xlabel="optimizer step")
    if sft and min(v for _, v in sft) > 0:
        ax[0, 0].set_yscale("log")
    colours = {st: f"C{i}" for i, st in enumerate(s for s in order if s != "sft")}
    for st, pts in curves.get("rollout/pass_rate", {}).items():
        ax[0, 1].plot([s for s, _ in pts], [v for _, v in pts], marker="o", ms=3, color=colours.get(st), label=st)
    for key, ls, what in (("rollout/pos_tool_error_ratio", "-", "sampled positives"),
                          ("rollout/kept_pos_tool_error_ratio", "--", "positives trained on")):
        for st, pts in curves.get(key, {}).items():
            ax[1, 0].plot([s for s, _ in pts], [v for _, v in pts], ls=ls, marker="o" if ls == "-" else "x", ms=3,
                          color=colours.get(st), label=f"{st}: {what}")
    ax[0, 1].set(title="RL training rollouts: pass rate", xlabel="RL step (across stages)", ylim=(0, 1))
    ax[1, 0].set(title="failed-call ratio among positives", xlabel="RL step (across stages)")
    bench = summary["primary_benchmark"]
    rows = {s["stage"]: s for s in summary["stages"]}
    names = [s for s in order if s in rows]
    best = summary["registration"]["stage"]
    bars = ax[1, 1].bar(names, [rows[s]["pass1"].get(bench, float("nan")) for s in names],
                        color=["tab:blue" if s == best else "lightgray" for s in names])
    ax[1, 1].bar_label(bars, fmt="%.3f")
    ax[1, 1].set(title=f"eval pass@1 ({bench}); registered: {best}", ylim=(0, 1))
    for a in (ax[0, 1], ax[1, 0]):
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    fig.suptitle(f"recipe run {summary['run_id']}: {summary['promotion']['line']}", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def write_plot(cfg: Config, store: RunStore, summary: dict[str, Any], order: list[str],
               parent_run_id: str | None = None) -> str:
    """Render `recipe_plot` to `<run store>/summary/recipe.png` and log it as `plots/recipe.png` on the
    parent MLflow run when given; returns the PNG's URL."""
    url = store.url("summary", PLOT_NAME)
    storage.write_bytes_atomic(url, recipe_plot(recipe_curves(cfg, store, order), summary, order))
    if parent_run_id is not None:
        tracking.log_file_artifact(cfg, parent_run_id, url, "plots")
    return url


def summary_markdown(summary: dict[str, Any], order: list[str], timings: list[StageTiming] | None = None,
                     plot_url: str | None = None) -> str:
    """The recipe's stage table (pass@1 per benchmark, stages in recipe order, with the seconds each stage
    trained and was evaluated when `timings` are given, and each RL stage's largest engine/trainer log-prob
    gap of a sampled token when the summary has them), the promotion decision with its numbers, the
    registration line, where the time went and the plot's location."""
    rows = {s["stage"]: s for s in summary["stages"]}
    benches = sorted({b for s in summary["stages"] for b in s["pass1"]})
    wall = {t.stage: t.wall_s for t in timings or []}
    gaps = any(s.get("engine_logprob_gap_max") is not None for s in summary["stages"])
    cols = [f"{b} pass@1" for b in benches] + (["train s", "eval s"] if timings else []) + (
        ["engine-trainer log-prob gap, max"] if gaps else [])
    lines = [f"| stage | {' | '.join(cols)} |", "|---|" + "---|" * len(cols)]
    for st in [s for s in order if s in rows]:
        cells = [f"{rows[st]['pass1'].get(b, float('nan')):.3f}" for b in benches]
        if timings:
            cells += [_secs(wall.get(st)), _secs(wall.get(f"eval-{st}"))]
        if gaps:
            g = rows[st].get("engine_logprob_gap_max")
            cells.append("-" if g is None else f"{g:.1e}")
        lines.append(f"| {st} | " + " | ".join(cells) + " |")
    reg, promo = summary["registration"], summary["promotion"]
    conf = (promo.get("vs_sft") or {}).get("confidence")
    how = f"paired bootstrap, {conf:.0%} interval" if conf else "paired bootstrap"
    lines += ["", f"best: {reg['stage']} ({summary['primary_benchmark']} pass@1 {reg['primary_pass1']:.3f})",
              f"promotion ({summary['primary_benchmark']}, {how}): {promo['line']}",
              reg["line"] + ("" if reg["aliases"] else ": registered without aliases"),
              f"checkpoint: {reg['checkpoint_url']}"]
    sft = (rows.get("sft") or {}).get("sft")
    if sft and sft["steps"] and wall.get("sft") is not None:
        conv = "" if sft["converged_step"] is None else f"; converged at step {sft['converged_step']}"
        lines.append(f"sft: {sft['steps']} optimizer steps in {wall['sft']:.0f} s "
                     f"({sft['steps'] / max(wall['sft'], 1e-3):.1f} steps/s, the figure to compare machines by{conv})")
    if timings:
        path = critical_path(timings)
        end = max(t.end_s for t in timings)
        lines.append(f"time: {end:.0f} s from the run's start to its last stage; critical path "
                     + " -> ".join(f"{t.stage} {t.wall_s:.0f} s" for t in path)
                     + "; beside it: " + ", ".join(f"{t.stage} {t.wall_s:.0f} s" for t in timings if t not in path))
    if plot_url:
        local = storage.to_local_path(plot_url)
        lines.append(f"plot: {local or plot_url}")
    return "\n".join(lines)


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def render_summary(cfg: Config, store: RunStore, summary: dict[str, Any], order: list[str],
                   parent_run_id: str | None) -> str:
    """The summary markdown of a finished run, with its timings and its plot (rendered and logged here)."""
    timings = stage_timings(cfg, parent_run_id) if parent_run_id else None
    plot = write_plot(cfg, store, summary, order, parent_run_id)
    return summary_markdown(summary, order, timings, plot)
