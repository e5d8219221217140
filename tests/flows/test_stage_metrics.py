"""A stage's metrics across a failure and its retry (tasks/stages.py `_run_tracked`, tasks/tracking.py
`MetricsLogger`): the curves are live while a stage runs, and each step reaches the stage's MLflow run exactly
once, also when the stage checkpoints only every few steps and the retry resumes from an earlier step than
the failure; register-best's eval table reaches the parent run once, also when a failed registration is
retried. The task bodies run directly (`.fn`, no Prefect server) over the stage doubles."""

from __future__ import annotations

import functools
import logging

import pytest
import stage_doubles

from rstar2_core import storage
from rstar2_core.faults import InjectedFault
from rstar2_core.results import DatasetRef, StageResult
from tasks import recipe, stages, tracking


@pytest.fixture
def run(tmp_path, monkeypatch, shared_mlflow, request):
    """open(overrides) -> the RecipeContext of a fresh recipe run, with the doubles in place."""
    logger = logging.getLogger("test-stage-metrics")
    monkeypatch.setattr(recipe, "get_run_logger", lambda: logger)
    monkeypatch.setattr(stages, "get_run_logger", lambda: logger)
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path))
    monkeypatch.delenv("RSTAR2_FAULT_INJECT", raising=False)
    stage_doubles.install(monkeypatch)

    def open_(overrides):
        base = [f"tracking.tracking_uri={shared_mlflow}", "cluster.use_ray=false", "cluster.resources={}"]
        return recipe.open_recipe("tiny", [*base, *overrides], request.node.name[-40:], "flow-1", attempt=1)

    return open_


@pytest.mark.parametrize("flush_s", [0.0, 5.0], ids=["flush-every-step", "flush-at-the-end"])
def test_a_resumed_rl_stage_logs_each_step_once_with_checkpoints_every_3_steps(run, monkeypatch, tmp_path, flush_s):
    real = tracking.metrics_logger
    monkeypatch.setattr(tracking, "metrics_logger", functools.partial(real, flush_s=flush_s))
    ctx = run(["rl.checkpoint_every=3", "rl.stages.0.steps=7"])
    cfg = ctx.config()
    data = DatasetRef(url=storage.join(tmp_path.as_uri(), "rl.jsonl"), digest="d", n_rows=1)
    storage.write_text_atomic(data.url, '{"id": 1}\n')
    init = StageResult(name="sft", checkpoint_url=tmp_path.as_uri(), steps=1)
    monkeypatch.setenv("RSTAR2_FAULT_INJECT", "rl-stage-1:step=6")  # fails at step 6: steps 1-5 logged, checkpoint 3
    with pytest.raises(InjectedFault):
        stages.rl_stage.fn(ctx, 0, init, data, label="rl-stage-1")
    run_id = ctx.store(cfg).tracking_id("rl-stage-1")
    assert tracking.metric_steps(cfg, run_id, "rollout/reward_mean") == [1, 2, 3, 4, 5]  # live: up to the failure
    stages.rl_stage.fn(ctx, 0, init, data, label="rl-stage-1")  # the retry resumes after step 3, re-runs 4 and 5
    assert [c["start"] for c in stage_doubles.calls("rl")] == [0, 3]
    assert tracking.metric_steps(cfg, run_id, "rollout/reward_mean") == [1, 2, 3, 4, 5, 6, 7]


def test_a_stage_that_starts_over_on_a_retry_logs_each_point_once_and_what_it_had_not_reached(run, monkeypatch):
    ctx = run([])
    cfg = ctx.config()

    def curate_then_fail(cfg, out_url, log_metrics=None, *, sampler=None):
        log_metrics({"data/kept": 1.0}, 0)      # like an evaluation: one benchmark's metrics, then a failure
        raise ConnectionError("storage went away after the metrics")

    monkeypatch.setattr(stages, "curate", curate_then_fail)
    with pytest.raises(ConnectionError):
        stages.curate_data.fn(ctx, label="curate")
    run_id = ctx.store(cfg).tracking_id("curate")
    assert tracking.metric_steps(cfg, run_id, "data/kept") == [0]

    def curate_again(cfg, out_url, log_metrics=None, *, sampler=None):
        log_metrics({"data/kept": 1.0, "data/rejected": 2.0}, 0)   # the same step: one metric new
        return stage_doubles.curate(cfg, out_url, None, sampler=sampler)

    monkeypatch.setattr(stages, "curate", curate_again)
    stages.curate_data.fn(ctx, label="curate")
    assert tracking.metric_steps(cfg, run_id, "data/kept") == [0]          # not twice
    assert tracking.metric_steps(cfg, run_id, "data/rejected") == [0]      # not lost


def test_register_best_retried_after_a_failed_registration_logs_the_eval_table_once(run, monkeypatch):
    from rstar2_core.eval.compare import primary_benchmark
    from tasks import registry

    ctx = run(["tracking.registered_model=rstar2-agent-register-retry"])
    cfg = ctx.config()
    names = [b.name for b in cfg.eval.benchmarks]
    reports = {"sft": stage_doubles.fixed_report("file:///ckpt/sft", 0.2, names),
               "rl-stage-3": stage_doubles.fixed_report("file:///ckpt/rl-3", 0.5, names)}
    monkeypatch.setattr(registry, "champion", lambda cfg: None)
    attempts: list[str] = []

    def register(cfg, *, stage, primary_pass1, aliases, **kwargs):
        attempts.append(stage)
        if len(attempts) == 1:
            raise ConnectionError("MLflow registry: 503")       # retryable: Prefect runs the task again
        return registry.Registration(cfg.tracking.registered_model, 1, stage, "file:///ckpt/rl-3", primary_pass1,
                                     tuple(aliases))

    monkeypatch.setattr(registry, "register", register)
    with pytest.raises(ConnectionError):
        recipe.register_best.fn(ctx, reports)
    out = recipe.register_best.fn(ctx, reports)
    assert attempts == ["rl-stage-3", "rl-stage-3"] and out["registration"]["version"] == 1
    bench = primary_benchmark(cfg.eval)
    for st in reports:
        for b in names:
            assert tracking.metric_steps(cfg, ctx.parent_run_id, f"eval/{st}/{b}/pass@1") == [0], (st, b)
    assert tracking.client(cfg).get_run(ctx.parent_run_id).data.metrics[
        tracking.metric_key(f"eval/rl-stage-3/{bench}/pass@1")] == 0.5
