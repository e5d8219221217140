"""Prefect tasks over the recipe's stage entry points (docs/CONTRACTS.md, "stage entry points"), imported
here by name (tests replace them with `monkeypatch.setattr(tasks.stages, "run_rl_stage", double)`).

Each task is a thin wrapper that adds what the core does not know about: skip-if-done from the run's store
(tasks/run_store.py), retries on infrastructure errors only (tasks/retry.py, `cfg.pipeline.task_retries`
times; a retried stage resumes from its last step checkpoint because it gets the same `out_url`), torch
threads = the CPUs the task reserves (tasks/runners.py), and MLflow lineage (tasks/tracking.py: a nested
run per stage, kept across retries). Invariant: Prefect's own result persistence stays off
(`cache_policy=NO_CACHE`): the run store, beside the artifacts, is what a retry on another machine sees.
See docs/pipeline.md, "Retries, resume and the UI's Retry".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rstar2_core.config import Config
from rstar2_core.data.curate import curate
from rstar2_core.eval.metrics import EvalReport
from rstar2_core.eval.run import evaluate
from rstar2_core.eval.sampler import label_check_sampler
from rstar2_core.models import prepare_base_model
from rstar2_core.results import DatasetRef, StageResult
from rstar2_core.rl.hard_subset import select_hard_subset
from rstar2_core.rl.stage import run_rl_stage
from rstar2_core.sft.data import build_sft_dataset
from rstar2_core.sft.train import run_sft
from tasks import tracking
from tasks.context import RecipeContext
from tasks.retry import retry_on_infrastructure_error
from tasks.runners import use_task_threads


def _stage_task(**kw):
    """@task with the pipeline's retry rule; the retry count is set per flow run from the config."""
    return task(retries=2, retry_delay_seconds=2, retry_condition_fn=retry_on_infrastructure_error,
                cache_policy=NO_CACHE, persist_result=False, task_run_name="{label}", **kw)


def _run_tracked(ctx: RecipeContext, cfg: Config, kind: str, key: str, params: dict[str, Any],
                 compute: Callable[[Config, Callable, str], Any],
                 inputs: tuple[tuple[str, DatasetRef], ...] = ()) -> Any:
    """Return stage `key`'s stored result, or compute it inside its (re)opened nested MLflow run with the
    torch threads of its task `kind` (tasks/runners.py). Metrics reach the run live; a retry does not log
    again the steps an earlier attempt wrote (tasks/tracking.py, `MetricsLogger`): a resumed stage re-runs
    the steps after its last checkpoint. `cfg` is the task's config, parsed from the run's snapshot once
    per task (`ctx.config()`); `compute` gets the same object."""
    log = get_run_logger()
    use_task_threads(cfg, kind)
    store = ctx.store(cfg)
    done = store.load(key)
    if done is not None:
        log.info(f"{key}: finished in attempt {store.record(key)['attempt']}, reusing its result")
        return done
    run_id = store.tracking_id(key)
    written = None
    unsent = store.url("state", "unsent-metrics", f"{key}.json")   # an earlier attempt's unwritten points
    if run_id is None:
        run_id = tracking.start_stage_run(cfg, parent_run_id=ctx.parent_run_id, stage=key, params=params)
        store.set_tracking_id(key, run_id)
    else:
        if n := tracking.replay_points(cfg, run_id, unsent):
            log.info(f"{key}: wrote the {n} metric points an earlier attempt kept while MLflow was down")
        written = tracking.written_steps(cfg, run_id)
        top = max(written.values(), default=None)
        log.info(f"{key}: continuing MLflow run {run_id}" + ("" if top is None else
                 f"; an earlier attempt logged its metrics up to step {top}: those points are kept, not logged again"))
        tracking.reopen(cfg, run_id)
    for name, ref in inputs:
        tracking.log_dataset(cfg, run_id, ref, name=name)
    log_metrics = tracking.metrics_logger(cfg, run_id, written=written)
    result = store.load(key, untracked=True) if written is not None else None
    try:
        if result is not None:
            log.info(f"{key}: computed in attempt {store.record(key, untracked=True)['attempt']} while MLflow was "
                     "away; logging that result instead of computing it again")
        else:
            result = compute(cfg, log_metrics, run_id)
            store.save(key, result, attempt=ctx.attempt, untracked=True)  # until MLflow has it: a retry logs it
    except BaseException:
        try:
            if not log_metrics.flush():      # the curves up to the failure; the retry writes what MLflow did not take
                tracking.save_points(unsent, log_metrics.pending_points())
            tracking.finish(cfg, run_id, "FAILED")
        except Exception as err:             # noqa: BLE001 - the stage's own error is the one to raise
            log.warning(f"{key}: could not write its last metrics to MLflow: {err}")
        raise
    if not log_metrics.flush():
        tracking.save_points(unsent, log_metrics.pending_points())
        raise tracking.TrackingUnavailable(
            f"{key}: the MLflow server ({cfg.resolved_tracking_uri()}) did not take the stage's last "
            f"{len(log_metrics.pending_points())} metric points; they are kept at {unsent}, the result at "
            f"{store.untracked_url(key)}: the retry writes them and logs it without "
            "computing it again")
    if isinstance(result, StageResult):
        tracking.log_checkpoint(cfg, run_id, result.checkpoint_url)  # per-step metrics came through log_metrics
    elif isinstance(result, DatasetRef):
        tracking.log_dataset(cfg, run_id, result, name=key, context="output")
    tracking.log_metric_plot(cfg, run_id, key)
    tracking.finish(cfg, run_id)
    store.save(key, result, attempt=ctx.attempt)
    store.drop_untracked(key)
    return result


@_stage_task(name="curate")
def curate_data(ctx: RecipeContext, label: str = "curate") -> DatasetRef:
    cfg = ctx.config()

    def compute(cfg, log_metrics, _):
        with label_check_sampler(cfg) as sampler:
            return curate(cfg, ctx.store(cfg).url("data", "curated"), log_metrics=log_metrics, sampler=sampler)

    return _run_tracked(ctx, cfg, "curate", "curate", {"sources": len(cfg.data.sources)}, compute)


@_stage_task(name="build-sft-data")
def build_sft_data(ctx: RecipeContext, label: str = "sft-data") -> DatasetRef:
    cfg = ctx.config()

    def compute(cfg, _log, _run):
        return build_sft_dataset(cfg, ctx.store(cfg).url("data", "sft"))

    return _run_tracked(ctx, cfg, "sft_data", "sft-data", {}, compute)


@_stage_task(name="base-model")
def base_model(ctx: RecipeContext, label: str = "base-model") -> dict:
    cfg = ctx.config()

    def compute(cfg, _log, _run):
        return {"checkpoint_url": prepare_base_model(cfg, ctx.store(cfg).url("checkpoints", "base"))}

    return _run_tracked(ctx, cfg, "base_model", "base-model", {"model.kind": cfg.model.kind}, compute)


@_stage_task(name="sft")
def sft(ctx: RecipeContext, base_model: dict, sft_data: DatasetRef, label: str = "sft") -> StageResult:
    def compute(cfg, log_metrics, _):
        return run_sft(cfg, base_model_url=base_model["checkpoint_url"], sft_data_url=sft_data.url,
                       out_url=ctx.store(cfg).url("checkpoints", "sft"), log_metrics=log_metrics, resume=True)

    cfg = ctx.config()
    params = {**tracking.flatten(cfg.sft.model_dump(mode="json"), "sft."), "base_model_url": base_model["checkpoint_url"]}
    return _run_tracked(ctx, cfg, "sft", "sft", params, compute, inputs=(("sft-data", sft_data),))


@_stage_task(name="rl-stage")
def rl_stage(ctx: RecipeContext, stage_index: int, init: StageResult, data: DatasetRef, label: str = "") -> StageResult:
    cfg = ctx.config()
    st = cfg.rl.stages[stage_index]

    def compute(cfg, log_metrics, run_id):
        return run_rl_stage(cfg, stage_index, init_checkpoint_url=init.checkpoint_url, data_url=data.url,
                            out_url=ctx.store(cfg).url("checkpoints", st.name), log_metrics=log_metrics,
                            resume=True, tracking_run_id=run_id)

    params = {**tracking.flatten(st.model_dump(mode="json"), "stage."), "init_checkpoint_url": init.checkpoint_url}
    return _run_tracked(ctx, cfg, "rl", st.name, params, compute, inputs=((f"{st.name}-data", data),))


@_stage_task(name="hard-subset")
def hard_subset(ctx: RecipeContext, stage_index: int, policy: StageResult, data: DatasetRef,
                label: str = "") -> DatasetRef:
    cfg = ctx.config()
    st = cfg.rl.stages[stage_index]
    key = f"{st.name}-hard-subset"

    def compute(cfg, _log, _run):
        return select_hard_subset(cfg, stage_index, checkpoint_url=policy.checkpoint_url, data_url=data.url,
                                  out_url=ctx.store(cfg).url("data", key))

    return _run_tracked(ctx, cfg, "hard_subset", key, {"k": st.hard_subset_k, "policy": policy.checkpoint_url}, compute,
                        inputs=(("pool", data),))


@_stage_task(name="evaluate")
def evaluate_checkpoint(ctx: RecipeContext, stage: str, checkpoint: StageResult | dict,
                        benchmarks: list[str] | None = None, k: int | None = None, label: str = "") -> EvalReport:
    """The core's `EvalReport` of `checkpoint` (a stage's result or {"checkpoint_url": ...}); its summary
    PNGs, report URL and benchmark digests also go on the stage's MLflow run."""
    cfg = ctx.config()
    url = checkpoint.checkpoint_url if isinstance(checkpoint, StageResult) else checkpoint["checkpoint_url"]
    key = f"eval-{stage}"

    def compute(cfg, log_metrics, run_id):
        report = evaluate(cfg, checkpoint_url=url, out_url=ctx.store(cfg).url("eval", stage),
                          benchmarks=benchmarks, k=k, log_metrics=log_metrics)
        for plot in report.plot_urls:  # the core's summary PNGs, copied into the stage run
            tracking.log_file_artifact(cfg, run_id, plot, "plots")
        c = tracking.client(cfg)
        if report.report_url:
            c.set_tag(run_id, "report_url", report.report_url)
        for bench, digest in report.benchmark_digests.items():
            c.set_tag(run_id, f"benchmark.{bench}.digest", str(digest))
        return report

    return _run_tracked(ctx, cfg, "eval", key, {"checkpoint_url": url, "benchmarks": benchmarks, "k": k}, compute)
