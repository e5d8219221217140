"""`evaluate` and `nightly_eval`: evaluate a registered model (or any checkpoint URL) on benchmarks.

    evaluate(model="champion" | "models:/rstar2-agent@candidate" | "models:/rstar2-agent/3" | <checkpoint URL>,
             benchmarks=None (all of cfg.eval.benchmarks), k=None (cfg.eval.k))
    nightly_eval(...)   evaluate the registry's champion, compare it with the previous nightly evaluation
                        (paired bootstrap per benchmark, `cfg.eval.comparison_confidence`, the same
                        comparison that gates promotion), publish a markdown artifact `nightly-eval` with
                        the table, fail on a benchmark whose interval lies below 0 (a regression).

Both open their run like the recipe does (tasks/recipe.py: config snapshot, MLflow parent run).
Deployments `rstar2/evaluate` and `rstar2/nightly-eval` (cron) in prefect.yaml.
"""

from __future__ import annotations

from prefect import flow, runtime
from prefect.artifacts import create_markdown_artifact

from flows.flow_process import final_state_accepted, on_cancel
from rstar2_core.config import ConfigError
from rstar2_core.eval.metrics import EvalReport
from tasks import nightly, registry
from tasks.context import RecipeContext
from tasks.recipe import close_recipe, open_recipe
from tasks.stages import evaluate_checkpoint


class RegressionError(RuntimeError):
    """A nightly benchmark's pass@1 fell below the previous night's beyond noise."""


def _close(status):
    def hook(flow, flow_run, state):
        if status == "FAILED":
            final_state_accepted(state)
        p = flow_run.parameters
        close_recipe(p.get("profile", "tiny"), list(p.get("overrides") or []), str(flow_run.id), status)
    return hook


def _open(kind: str, profile: str, overrides: list[str] | None) -> RecipeContext:
    ctx = open_recipe(profile, list(overrides or []), None, runtime.flow_run.id,
                      attempt=int(runtime.flow_run.run_count or 1), kind=kind)
    on_cancel(lambda: close_recipe(profile, list(overrides or []), ctx.run_id, "KILLED"))
    return ctx


def _evaluate(ctx: RecipeContext, model: str, benchmarks: list[str] | None, k: int | None
              ) -> tuple[dict, EvalReport]:
    """Resolve `model`, run the evaluation task, publish the `evaluation` artifact."""
    cfg = ctx.config()
    known = [b.name for b in cfg.eval.benchmarks]
    unknown = sorted(set(benchmarks or []) - set(known))
    if unknown:
        raise ConfigError(f"unknown benchmarks {unknown}; the profile defines {known} (eval.benchmarks)")
    checkpoint_url, version = registry.resolve_pinned(ctx, model)
    report = evaluate_checkpoint.with_options(retries=cfg.pipeline.task_retries)(
        ctx, "model", {"checkpoint_url": checkpoint_url}, benchmarks=benchmarks, k=k,
        label=f"eval {model}" + (f" (version {version})" if version else ""))
    table = report.pass1()
    out = {"model": model, "version": version, "checkpoint_url": checkpoint_url, "pass1": table,
           "report_url": report.json_url}
    rows = "\n".join(f"| {b} | {p:.3f} |" for b, p in sorted(table.items()))
    create_markdown_artifact(key="evaluation", markdown=f"## {model} (version {version or '-'})\n\n"
                             f"| benchmark | pass@1 |\n|---|---|\n{rows}\n\ncheckpoint: {checkpoint_url}")
    print(out)
    return out, report


@flow(name="rstar2", flow_run_name="evaluate {model}", log_prints=True, on_failure=[_close("FAILED")],
      on_completion=[_close("FINISHED")])
def evaluate(model: str = "champion", benchmarks: list[str] | None = None, k: int | None = None,
             profile: str = "tiny", overrides: list[str] | None = None) -> dict:
    """Evaluate `model` on `benchmarks`; returns {model, version, checkpoint_url, pass1: {benchmark: p},
    report_url}."""
    return _evaluate(_open("evaluate", profile, overrides), model, benchmarks, k)[0]


@flow(name="rstar2", flow_run_name="nightly-eval {model}", log_prints=True, on_failure=[_close("FAILED")],
      on_completion=[_close("FINISHED")])
def nightly_eval(model: str = "champion", benchmarks: list[str] | None = None, profile: str = "tiny",
                 overrides: list[str] | None = None) -> dict:
    """Evaluate the champion, compare with the previous nightly, fail on a regression."""
    ctx = _open("nightly-eval", profile, overrides)
    result, report = _evaluate(ctx, model, benchmarks, None)
    cfg = ctx.config()
    # the current flow run id: a Retry of this run must not compare tonight with its own earlier record
    night = nightly.compare_with_previous(cfg, model, result["version"], report, runtime.flow_run.id)
    create_markdown_artifact(key="nightly-eval", markdown=night.markdown,
                             description="nightly pass@1 vs previous night")
    nightly.record(cfg, result, runtime.flow_run.id)
    print(night.markdown)
    if night.regressions:
        raise RegressionError(f"pass@1 regression beyond noise on {night.regressions}; see the nightly-eval "
                              "artifact")
    return {**result, "comparison": night.rows}
