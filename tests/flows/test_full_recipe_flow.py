"""full_recipe through Prefect's test harness with stage doubles: the DAG, skip-if-done across a
flow-run retry, resume of a faulted RL stage into the same MLflow run, registration, fail-fast input."""

from __future__ import annotations

import pytest
import stage_doubles

from rstar2_core.config import ConfigError, load_config
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
    assert "candidate" in reg["aliases"] and "champion" in reg["aliases"]
    c = tracking.client(cfg)
    mv = c.get_model_version_by_alias(cfg.tracking.registered_model, "candidate")
    assert mv.tags["checkpoint_url"] == reg["checkpoint_url"]
    store = RunStore.for_run(cfg.resolved_storage_root(), "run-a")
    parent = store.tracking_id("parent")
    children = c.search_runs([tracking.experiment_id(cfg)], f"tags.mlflow.parentRunId = '{parent}'")
    names = {r.info.run_name for r in children}
    assert {"curate", "sft", "rl-stage-1", "rl-stage-2", "rl-stage-3", "rl-stage-3-hard-subset",
            "eval-sft", "eval-rl-stage-3"} <= names
    assert c.get_run(parent).data.params["rl.stages.0.steps"] == "3"
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
    assert "| synthetic | 0.500 | 0.200 | -0.300 | REGRESSION |" in Artifact.get("nightly-eval").data
    out = evaluate(model=f"models:/{cfg.tracking.registered_model}@candidate", profile="tiny",
                   overrides=state.overrides)
    assert out["pass1"] == {"synthetic": 0.5} and out["checkpoint_url"].endswith("rl-stage-3/final")
    with pytest.raises(ConfigError, match="unknown benchmarks"):
        evaluate(benchmarks=["nope"], profile="tiny", overrides=state.overrides)
    with pytest.raises(ValueError, match="has no alias 'nope'"):
        evaluate(model="nope", profile="tiny", overrides=state.overrides)
