"""The summary a finished recipe run shows (tasks/summary.py), rendered from what the run left in MLflow and the
run store: the stage table with seconds per stage, the promotion line, where the time went, the PNG of the
run's curves (in the run store and on the parent MLflow run); and the critical path read from timings."""

from __future__ import annotations

import re
import time

import pytest
import stage_doubles

from rstar2_core import storage
from rstar2_core.config import load_config
from tasks import tracking
from tasks.run_store import RunStore
from tasks.summary import StageTiming, critical_path, recipe_curves, render_summary, stage_timings

ORDER = ["sft", "rl-stage-1", "rl-stage-2", "rl-stage-3"]


@pytest.mark.slow
def test_summary_of_a_finished_run(state):
    from flows.full_recipe import full_recipe

    t0 = time.monotonic()
    out = full_recipe(profile="tiny", overrides=state.overrides, run_id="run-s")
    elapsed = time.monotonic() - t0
    cfg = load_config("tiny", state.overrides)
    store = RunStore.for_run(cfg.resolved_storage_root(), "run-s")
    md = store.load("summary")["markdown"]
    # the table has pass@1, the seconds each stage trained and was evaluated, and each RL stage's largest
    # engine/trainer log-prob gap (SFT samples nothing)
    assert md.splitlines()[0] == "| stage | synthetic pass@1 | train s | eval s | engine-trainer log-prob gap, max |"
    assert re.search(r"^\| rl-stage-3 \| 0\.500 \| \d+ \| \d+ \| 2\.0e-06 \|$", md, re.MULTILINE), md
    assert re.search(r"^\| sft \| .* \| - \|$", md, re.MULTILINE), md
    assert f"promotion (synthetic, paired bootstrap, 95% interval): {out['promotion']['line']}" in md
    # SFT's speed, the figure that compares one machine with another, and where it converged
    assert re.search(r"^sft: 2 optimizer steps in \d+ s \([0-9.]+ steps/s, .*; converged at step 2\)$", md,
                     re.MULTILINE), md
    # where the time went: every stage that ran, the critical path ending in the last evaluation
    timings = stage_timings(cfg, store.tracking_id("parent"))
    assert {t.stage for t in timings} >= {"curate", "sft-data", "base-model", "sft", "rl-stage-1", "rl-stage-2",
                                          "rl-stage-3-hard-subset", "rl-stage-3", "eval-sft", "eval-rl-stage-3"}
    # each stage ran inside the flow call (timed here, apart from MLflow; its times are in ms), and after
    # the stages it needs had ended
    assert all(0 <= t.start_s <= t.end_s <= elapsed + 0.01 for t in timings), (elapsed, timings)
    at = {t.stage: t for t in timings}
    for stage, needs in {"sft": ("sft-data", "base-model"), "rl-stage-1": ("sft",), "rl-stage-2": ("rl-stage-1",),
                         "rl-stage-3": ("rl-stage-3-hard-subset",), "eval-rl-stage-3": ("rl-stage-3",)}.items():
        assert all(at[n].end_s <= at[stage].start_s for n in needs), (stage, needs, timings)
    line = next(x for x in md.splitlines() if x.startswith("time: "))
    path = [t.stage for t in critical_path(timings)]
    assert path[-1] == "eval-rl-stage-3" and "rl-stage-3" in path and "sft" in path
    assert " -> ".join(path) in re.sub(r" \d+ s", "", line)
    # the plot: a PNG in the run store, printed by its local path, and on the parent MLflow run
    plot = storage.to_local_path(store.url("summary", "recipe.png"))
    assert f"plot: {plot}" in md and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    arts = tracking.client(cfg).list_artifacts(store.tracking_id("parent"), "plots")
    assert [a.path for a in arts] == ["plots/recipe.png"]
    # its curves are the stages' logged metrics, RL steps counted across stages
    curves = recipe_curves(cfg, store, ORDER)
    assert [s for s, _ in curves["rollout/pass_rate"]["rl-stage-2"]] == [4, 5]  # stage 1 has 3 steps
    assert curves["rollout/pos_tool_error_ratio"]["rl-stage-1"] == [(1, 0.5), (2, 0.25), (3, 0.5 / 3)]
    assert curves["sft/loss"]["sft"] == [(1, 1.0), (2, 0.5)]


@pytest.mark.slow
def test_summary_says_when_a_run_registers_without_aliases(state, monkeypatch):
    monkeypatch.setitem(stage_doubles.QUALITY, "sft", 0.5)  # RL no better than SFT
    cfg = load_config("tiny", state.overrides)
    out = render_summary_of(state, cfg, "run-n")
    assert "-> no alias (RL did not beat SFT beyond noise)" in out
    assert re.search(r"version \d+ \(no alias\): registered without aliases", out)


def render_summary_of(state, cfg, run_id: str) -> str:
    from flows.full_recipe import full_recipe

    summary = full_recipe(profile="tiny", overrides=state.overrides + ["pipeline.eval_stages=last"], run_id=run_id)
    store = RunStore.for_run(cfg.resolved_storage_root(), run_id)
    # rendering again from the records gives the same text as the flow stored
    again = render_summary(cfg, store, summary, ORDER, store.tracking_id("parent"))
    assert again == store.load("summary")["markdown"]
    return again


def test_critical_path_follows_the_chain_that_decided_the_run():
    t = [StageTiming("curate", 0, 20, "FINISHED"), StageTiming("sft-data", 0, 40, "FINISHED"),
         StageTiming("base-model", 0, 10, "FINISHED"), StageTiming("sft", 42, 300, "FINISHED"),
         StageTiming("eval-sft", 301, 340, "FINISHED"), StageTiming("rl-stage-1", 301, 450, "FINISHED"),
         StageTiming("eval-rl-stage-1", 451, 490, "FINISHED"), StageTiming("rl-stage-2", 451, 480, "FINISHED"),
         StageTiming("eval-rl-stage-2", 481, 520, "FINISHED")]
    assert [s.stage for s in critical_path(t)] == ["sft-data", "sft", "rl-stage-1", "rl-stage-2", "eval-rl-stage-2"]
    assert critical_path([]) == []
