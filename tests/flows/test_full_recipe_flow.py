"""full_recipe through Prefect's test harness with stage doubles: the DAG, skip-if-done across a
flow-run retry, resume of a faulted RL stage into the same MLflow run, the frozen config a retry runs,
promotion and registration, fail-fast input."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import stage_doubles

from rstar2_core.config import ConfigError, config_dir, load_config
from rstar2_core.eval.metrics import EvalReport
from tasks import tracking
from tasks.run_store import RunStore


def _run(state, overrides, run_id):
    from flows.full_recipe import full_recipe

    return full_recipe(profile="tiny", overrides=state.overrides + overrides, run_id=run_id)


@pytest.mark.slow
def test_recipe_runs_every_stage_and_registers_the_best(state):
    out = _run(state, [], "run-a")
    assert [c["kind"] for c in stage_doubles.calls()].count("rl") == 3
    assert len(stage_doubles.calls("eval")) == 4  # sft + 3 RL stages
    reg = out["registration"]
    cfg = load_config("tiny", state.overrides)
    assert reg["stage"] == "rl-stage-3" and reg["line"].startswith(f"{cfg.tracking.registered_model} version ")
    assert reg["aliases"] == ["candidate", "champion"]
    # 10 of 20 problems solved vs the SFT checkpoint's 4, paired: the decision and its numbers
    line = out["promotion"]["line"]
    assert re.fullmatch(r"rl-stage-3 0\.50 vs sft 0\.20, \+0\.30 \[0\.\d\d, 0\.\d\d\] -> candidate, champion "
                        r"\(no champion yet\)", line), line
    c = tracking.client(cfg)
    mv = c.get_model_version_by_alias(cfg.tracking.registered_model, "candidate")
    assert mv.tags["checkpoint_url"] == reg["checkpoint_url"] and mv.tags["promotion"] == line
    store = RunStore.for_run(cfg.resolved_storage_root(), "run-a")
    assert EvalReport.load(mv.tags["eval_report_url"]) == store.load("eval-rl-stage-3")  # the champion's report
    parent = store.tracking_id("parent")
    exp = tracking.experiment_id(cfg)
    children = c.search_runs([exp], f"tags.mlflow.parentRunId = '{parent}'")
    names = {r.info.run_name for r in children}
    # MLflow's UI opens it as model training (runs table, nested runs, charts), not as a GenAI app
    assert c.get_experiment(exp).tags["mlflow.experimentKind"] == "custom_model_development"
    assert {"curate", "sft", "rl-stage-1", "rl-stage-2", "rl-stage-3", "rl-stage-3-hard-subset",
            "eval-sft", "eval-rl-stage-3"} <= names
    # the parent run's params and digest are the run's config snapshot
    snap = store.read_config_snapshot()
    run = c.get_run(parent)
    assert run.data.params == {tracking.metric_key(k): v[:6000] for k, v in tracking.flatten(snap["config"]).items()}
    assert run.data.params["rl.stages.0.steps"] == "3" and run.data.tags["config_digest"] == snap["digest"]
    md = store.load("summary")["markdown"]
    assert f"promotion (synthetic, paired bootstrap, 95% interval): {line}" in md
    assert f"{reg['line']}\ncheckpoint: " in md and "| rl-stage-3 | 0.500 |" in md
    rl1 = store.tracking_id("rl-stage-1")
    assert tracking.metric_steps(cfg, rl1, "rollout/reward_mean")[:3] == [1, 2, 3]
    assert any(a.path.startswith("plots") for a in c.list_artifacts(rl1))
    # the hard subset was selected with the end-of-stage-2 policy and fed to stage 3
    rl3_inputs = c.get_run(store.tracking_id("rl-stage-3")).inputs.dataset_inputs
    assert any(d.dataset.name == "rl-stage-3-data" for d in rl3_inputs)


@pytest.mark.slow
def test_retry_reuses_finished_stages_and_resumes_the_failed_one(state, monkeypatch):
    monkeypatch.setenv("RSTAR2_FAULT_INJECT", "rl-stage-1:step=2")
    with pytest.raises(Exception, match="injected fault"):
        _run(state, ["pipeline.task_retries=0"], "run-b")
    before = {k: len(stage_doubles.calls(k)) for k in ("curate", "sft_data", "base_model", "sft")}
    assert before == {"curate": 1, "sft_data": 1, "base_model": 1, "sft": 1}
    out = _run(state, ["pipeline.task_retries=0"], "run-b")  # what the UI's Retry does: same run id again
    after = {k: len(stage_doubles.calls(k)) for k in before}
    assert after == before, "finished stages were recomputed"
    rl1 = [c for c in stage_doubles.calls("rl") if c["stage"] == "rl-stage-1"]
    assert [c["start"] for c in rl1] == [0, 1]  # resumed after the one finished step
    assert rl1[0]["tracking_run_id"] == rl1[1]["tracking_run_id"]
    cfg = load_config("tiny", state.overrides)
    assert tracking.metric_steps(cfg, rl1[0]["tracking_run_id"], "rollout/reward_mean")[:3] == [1, 2, 3]
    assert out["registration"]["version"] >= 1
    c = tracking.client(cfg)
    versions = c.search_model_versions(f"name='{cfg.tracking.registered_model}' and tag.`rstar2.recipe_run_id`='run-b'")
    assert len(versions) == 1


@pytest.mark.slow
def test_retry_runs_the_frozen_config_not_the_edited_profile(state, monkeypatch, capsys):
    from rstar2_cli.main import main

    profiles = state.path / "configs"
    shutil.copytree(config_dir(), profiles)
    monkeypatch.setenv("RSTAR2_CONFIG_DIR", str(profiles))
    tiny = profiles / "tiny.toml"
    monkeypatch.setenv("RSTAR2_FAULT_INJECT", "rl-stage-1:step=2")
    with pytest.raises(Exception, match="injected fault"):
        _run(state, ["pipeline.task_retries=0"], "run-e")
    text = tiny.read_text()
    assert "\nlr = 3e-4\n" in text and "\nmax_turns = 4\ndataset" in text
    tiny.write_text(text.replace("\nlr = 3e-4\n", "\nlr = 1e-3\n").replace("\nmax_turns = 4\ndataset",
                                                                       "\nmax_turns = 9\ndataset"))
    edited = load_config("tiny", state.overrides)
    assert edited.rl.lr == 1e-3 and edited.rl.stages[2].max_turns == 9
    _run(state, ["pipeline.task_retries=0"], "run-e")  # the UI's Retry: same run id, the edited profile on disk
    rl = stage_doubles.calls("rl")
    assert [c["stage"] for c in rl] == ["rl-stage-1", "rl-stage-1", "rl-stage-2", "rl-stage-3"]
    assert {c["lr"] for c in rl} == {3e-4}  # what reached the RL core, before and after the edit
    assert rl[-1]["max_turns"] == 4
    store = RunStore.for_run(edited.resolved_storage_root(), "run-e")
    snap = store.read_config_snapshot()
    parent = tracking.client(edited).get_run(store.tracking_id("parent"))
    assert parent.data.params == {tracking.metric_key(k): v[:6000] for k, v in tracking.flatten(snap["config"]).items()}
    assert parent.data.params["rl.lr"] == "0.0003" and parent.data.tags["config_digest"] == snap["digest"]
    drift = [v for k, v in parent.data.tags.items() if k.startswith("rstar2.drift.")]
    assert len(drift) == 1, parent.data.tags
    assert "rl.lr: 0.0003 (run) vs 0.001 (now)" in drift[0] and "rl.stages.2.max_turns: 4 (run) vs 9 (now)" in drift[0]
    capsys.readouterr()
    assert main(["config", "show", "--run", "run-e"]) == 0
    assert json.loads(capsys.readouterr().out) == snap
    # a snapshot this code no longer validates (written by code that had a field since removed) is refused
    old = json.loads(json.dumps(snap["config"]))
    old["eval"]["gate_pass1"] = 0.1
    from rstar2_core import storage
    from rstar2_core.config import config_digest

    storage.write_json_atomic(store.config_url(), {**snap, "config": old, "digest": config_digest(old)})
    with pytest.raises(ConfigError, match=r"eval\.gate_pass1: not a field of this version of the code"):
        _run(state, ["pipeline.task_retries=0"], "run-e")
    assert main(["config", "show", "--run", "run-e"]) == 2


@pytest.mark.slow
def test_promotion_needs_a_gain_beyond_noise(state, monkeypatch):
    cfg = load_config("tiny", state.overrides)
    name = cfg.tracking.registered_model
    c = tracking.client(cfg)
    first = _run(state, ["pipeline.eval_stages=last"], "run-p1")
    assert first["registration"]["aliases"] == ["candidate", "champion"]
    # the same gain again: beats its SFT checkpoint, ties the champion -> candidate only
    second = _run(state, ["pipeline.eval_stages=last"], "run-p2")
    assert second["registration"]["aliases"] == ["candidate"]
    assert second["promotion"]["line"].endswith("-> candidate (ties the champion)")
    assert "vs champion (version 1) 0.50, +0.00 [0.00, 0.00]" in second["promotion"]["line"]
    assert int(c.get_model_version_by_alias(name, "champion").version) == 1
    assert int(c.get_model_version_by_alias(name, "candidate").version) == 2
    # RL no better than SFT: registered, no alias, and the summary says so
    monkeypatch.setitem(stage_doubles.QUALITY, "sft", 0.5)
    third = _run(state, ["pipeline.eval_stages=last"], "run-p3")
    assert third["registration"]["aliases"] == [] and third["registration"]["version"] == 3
    assert third["promotion"]["line"] == ("rl-stage-3 0.50 vs sft 0.50, +0.00 [0.00, 0.00] -> no alias "
                                          "(RL did not beat SFT beyond noise)")
    md = RunStore.for_run(cfg.resolved_storage_root(), "run-p3").load("summary")["markdown"]
    assert f"{name} version 3 (no alias): registered without aliases" in md
    assert int(c.get_model_version_by_alias(name, "candidate").version) == 2


@pytest.mark.slow
def test_infrastructure_fault_is_retried_inside_the_same_flow_run(state, monkeypatch):
    monkeypatch.setenv("RSTAR2_FAULT_INJECT", "rl-stage-2:step=1")
    _run(state, ["pipeline.task_retries=1", "pipeline.eval_stages=last"], "run-c")
    rl2 = [c for c in stage_doubles.calls("rl") if c["stage"] == "rl-stage-2"]
    assert len(rl2) == 2 and rl2[1]["start"] == 0


def test_bad_input_fails_before_any_compute(state):
    from flows.full_recipe import full_recipe

    with pytest.raises(ConfigError, match="unknown profile"):
        full_recipe(profile="no-such-profile", run_id="x")
    with pytest.raises(ConfigError, match="rl.stages.0.steps"):
        full_recipe(profile="tiny", overrides=["rl.stages.0.steps=0"], run_id="x")
    with pytest.raises(ConfigError, match="must look like section.field=value"):
        full_recipe(profile="tiny", overrides=["rl.lr"], run_id="x")
    with pytest.raises(ConfigError, match=r"data.sources.0.url .* does not exist"):
        full_recipe(profile="tiny", overrides=state.overrides + ['data.sources=[{url="file:///nope/x.parquet"}]'], run_id="x")
    assert stage_doubles.calls() == []


@pytest.mark.slow
def test_evaluate_and_nightly_regression(state):
    from prefect.artifacts import Artifact

    from flows.evaluate import RegressionError, evaluate, nightly_eval

    _run(state, ["pipeline.eval_stages=last"], "run-d")  # registers rl-stage-3 (pass@1 0.5) as champion
    first = nightly_eval(profile="tiny", overrides=state.overrides)
    assert first["pass1"] == {"synthetic": 0.5} and first["version"] == "1"
    assert "first night" in Artifact.get("nightly-eval").data
    cfg = load_config("tiny", state.overrides)
    sft_ckpt = RunStore.for_run(cfg.resolved_storage_root(), "run-d").load("sft").checkpoint_url  # pass@1 0.2
    with pytest.raises(RegressionError, match="synthetic"):
        nightly_eval(model=sft_ckpt, profile="tiny", overrides=state.overrides)
    table = Artifact.get("nightly-eval").data
    assert re.search(r"\| synthetic \| 0\.500 \| 0\.200 \| -0\.30 \[-0\.\d\d, -0\.\d\d\] \| 20 \| REGRESSION \|", table), table
    out = evaluate(model=f"models:/{cfg.tracking.registered_model}@candidate", profile="tiny",
                   overrides=state.overrides)
    assert out["pass1"] == {"synthetic": 0.5} and out["checkpoint_url"].endswith("rl-stage-3/final")
    with pytest.raises(ConfigError, match="unknown benchmarks"):
        evaluate(benchmarks=["nope"], profile="tiny", overrides=state.overrides)
    with pytest.raises(ValueError, match="has no alias 'nope'"):
        evaluate(model="nope", profile="tiny", overrides=state.overrides)
