"""Recipe-level steps around the stage tasks: validate inputs before any compute, open/close the MLflow
parent run, rank the evaluated checkpoints and register the best, render the summary table.

    preflight(cfg)            bad data/benchmark URLs, unknown resource keys, unreachable storage -> ConfigError
    open_recipe(...)          -> RecipeContext (parent MLflow run created once per recipe run)
    register_best(ctx, evals) -> Registration (idempotent per recipe run)
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rstar2_core import storage
from rstar2_core.config import Config, ConfigError, load_config
from tasks import registry, tracking
from tasks.context import RecipeContext, apply_storage_settings
from tasks.evals import pass1_by_benchmark, primary_benchmark
from tasks.retry import retry_on_infrastructure_error
from tasks.run_store import RunStore
from tasks.runners import TASK_KINDS


def preflight(cfg: Config) -> None:
    """Fail fast, before any compute, on inputs that cannot work; the message names the fix."""
    apply_storage_settings(cfg)
    problems = []
    for i, src in enumerate(cfg.data.sources):
        if not storage.exists(src.url):
            problems.append(f"data.sources.{i}.url = {src.url!r} does not exist; fix the URL or remove the source")
    for i, b in enumerate(cfg.eval.benchmarks):
        if b.url and not storage.exists(b.url):
            problems.append(f"eval.benchmarks.{i}.url = {b.url!r} ({b.name}) does not exist; fix the URL "
                            "or drop the benchmark")
    unknown = sorted(set(cfg.cluster.resources) - set(TASK_KINDS))
    if unknown:
        problems.append(f"cluster.resources has unknown task kinds {unknown}; use {list(TASK_KINDS)}")
    if cfg.model.kind == "hf" and "://" not in (cfg.model.name_or_path or "") and not storage.exists(
            cfg.model.name_or_path or ""):
        problems.append(f"model.name_or_path = {cfg.model.name_or_path!r} does not exist locally")
    if not cfg.data.sources and not cfg.data.synthetic.enabled:
        problems.append("no training data: add data.sources or set data.synthetic.enabled = true")
    root = cfg.resolved_storage_root()
    try:
        probe = storage.join(root, ".preflight")
        storage.write_text_atomic(probe, "ok")
        storage.remove(probe)
    except Exception as e:  # noqa: BLE001 - whatever the cause, the run could not save anything: say so
        problems.append(f"storage root {root!r} is not writable ({type(e).__name__}: {e}); fix storage.root "
                        "or storage.s3_endpoint_url")
    if problems:
        raise ConfigError("the recipe cannot start:\n  " + "\n  ".join(problems))


def open_recipe(profile: str, overrides: list[str], run_id: str | None, flow_run_id: str | None,
                attempt: int, kind: str = "recipe") -> RecipeContext:
    """Validate, then get or create the run's MLflow parent run (named `<kind> <profile> <id>`);
    returns the tasks' context."""
    cfg = load_config(profile, overrides)
    preflight(cfg)
    rid = run_id or flow_run_id
    if not rid:
        raise ConfigError(f"{kind} needs a run_id when it runs outside a Prefect flow run")
    store = RunStore.for_run(cfg.resolved_storage_root(), rid)
    parent = store.tracking_id("parent")
    if parent is None:
        parent = tracking.start_parent_run(cfg, run_name=f"{kind} {cfg.profile} {rid[:8]}",
                                           recipe_run_id=rid, flow_run_id=flow_run_id)
        store.set_tracking_id("parent", parent)
    else:
        tracking.reopen(cfg, parent)
        tracking.client(cfg).set_tag(parent, f"prefect.attempt.{attempt}", flow_run_id or "")
    return RecipeContext(profile=profile, overrides=tuple(overrides), run_id=rid, attempt=attempt,
                         parent_run_id=parent, flow_run_id=flow_run_id)


def close_recipe(profile: str, overrides: list[str], run_id: str, status: str) -> None:
    """Mark the parent MLflow run FINISHED/FAILED (called from flow state hooks)."""
    try:
        cfg = load_config(profile, overrides)
    except ConfigError:  # the run failed on its config: it never opened an MLflow run
        return
    apply_storage_settings(cfg)
    parent = RunStore.for_run(cfg.resolved_storage_root(), run_id).tracking_id("parent")
    if parent is not None:
        tracking.finish(cfg, parent, status)


def rank(cfg: Config, evals: list[dict]) -> list[tuple[str, float, dict]]:
    """[(stage, primary pass@1, eval record)] best first; ties go to the later stage."""
    bench = primary_benchmark(cfg)
    scored = []
    for order, ev in enumerate(evals):
        table = pass1_by_benchmark(ev["report"])
        if bench not in table:
            raise ValueError(f"evaluation of {ev['stage']} has no pass@1 for primary benchmark {bench!r} "
                             f"(has {sorted(table)})")
        scored.append((table[bench], order, ev))
    scored.sort(key=lambda x: (x[0], x[1]), reverse=True)
    return [(ev["stage"], score, ev) for score, _, ev in scored]


@task(name="register-best", task_run_name="register best checkpoint", retries=2, retry_delay_seconds=2,
      retry_condition_fn=retry_on_infrastructure_error, cache_policy=NO_CACHE, persist_result=False)
def register_best(ctx: RecipeContext, evals: list[dict]) -> dict:
    """Register the best-ranked stage checkpoint as this recipe run's version of the model."""
    log = get_run_logger()
    cfg = ctx.config()
    store = ctx.store(cfg)
    done = store.load("register")
    if done is not None:
        return done
    ranked = rank(cfg, evals)
    stage, score, best = ranked[0]
    c = tracking.client(cfg)
    for st, _, ev in ranked:  # the eval table on the parent run, one metric per stage x benchmark
        for bench, p in pass1_by_benchmark(ev["report"]).items():
            c.log_metric(ctx.parent_run_id, tracking.metric_key(f"eval/{st}/{bench}/pass@1"), p)
    metrics = {f"eval/{b}/pass@1": p for b, p in pass1_by_benchmark(best["report"]).items()}
    reg = registry.register(cfg, parent_run_id=ctx.parent_run_id, recipe_run_id=ctx.run_id, stage=stage,
                            checkpoint_url=best["checkpoint_url"], primary_pass1=score, metrics=metrics,
                            lineage={"prefect.flow_run_id": ctx.flow_run_id or "",
                                     "mlflow.parent_run_id": ctx.parent_run_id or ""})
    log.info(f"best checkpoint: {stage} (pass@1 {score:.3f}); {reg.summary_line()}")
    out = {"registration": {"name": reg.name, "version": reg.version, "aliases": list(reg.aliases),
                            "stage": reg.stage, "checkpoint_url": reg.checkpoint_url,
                            "primary_pass1": reg.primary_pass1, "line": reg.summary_line()},
           "stages": [{"stage": st, "primary_pass1": p, "pass1": pass1_by_benchmark(ev["report"]),
                       "checkpoint_url": ev["checkpoint_url"]} for st, p, ev in ranked],
           "primary_benchmark": primary_benchmark(cfg), "run_id": ctx.run_id,
           "mlflow_parent_run_id": ctx.parent_run_id}
    store.save("register", out, attempt=ctx.attempt)
    return out


def summary_markdown(summary: dict[str, Any], order: list[str]) -> str:
    """The recipe's stage table (pass@1 per benchmark, stages in recipe order) and its registration line."""
    rows = {s["stage"]: s for s in summary["stages"]}
    benches = sorted({b for s in summary["stages"] for b in s["pass1"]})
    lines = [f"| stage | {' | '.join(f'{b} pass@1' for b in benches)} |", "|---|" + "---|" * len(benches)]
    for st in [s for s in order if s in rows]:
        lines.append(f"| {st} | " + " | ".join(f"{rows[st]['pass1'].get(b, float('nan')):.3f}" for b in benches) + " |")
    reg = summary["registration"]
    lines += ["", f"best: {reg['stage']} ({summary['primary_benchmark']} pass@1 {reg['primary_pass1']:.3f})",
              reg["line"], f"checkpoint: {reg['checkpoint_url']}"]
    return "\n".join(lines)
