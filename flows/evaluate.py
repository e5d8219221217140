"""`evaluate` and `nightly_eval`: evaluate a registered model (or any checkpoint URL) on benchmarks.

    evaluate(model="champion" | "models:/rstar2-agent@candidate" | "models:/rstar2-agent/3" | <checkpoint URL>,
             benchmarks=None (all of cfg.eval.benchmarks), k=None (cfg.eval.k))
    nightly_eval(...)   evaluate the registry's champion, compare with the previous nightly, publish a
                        markdown artifact `nightly-eval` with the table, fail on a pass@1 drop larger than
                        cfg.eval.nightly_regression_threshold.

Deployments `rstar2/evaluate` and `rstar2/nightly-eval` (cron) in prefect.yaml.
"""

from __future__ import annotations

from prefect import flow, runtime
from prefect.artifacts import create_markdown_artifact

from rstar2_core.config import ConfigError, load_config
from tasks import nightly, registry
from tasks.evals import compare, comparison_markdown, pass1_by_benchmark
from tasks.recipe import close_recipe, open_recipe
from tasks.stages import evaluate_checkpoint


class RegressionError(RuntimeError):
    """The nightly evaluation dropped below the previous one by more than the threshold."""


def _close(status):
    def hook(flow, flow_run, state):
        p = flow_run.parameters
        close_recipe(p.get("profile", "tiny"), list(p.get("overrides") or []), str(flow_run.id), status)
    return hook


@flow(name="rstar2", flow_run_name="evaluate {model}", log_prints=True, on_failure=[_close("FAILED")], on_completion=[_close("FINISHED")])
def evaluate(model: str = "champion", benchmarks: list[str] | None = None, k: int | None = None,
             profile: str = "tiny", overrides: list[str] | None = None) -> dict:
    """Evaluate `model` on `benchmarks`; returns {model, version, checkpoint_url, pass1: {benchmark: p}}."""
    ctx = open_recipe(profile, list(overrides or []), None, runtime.flow_run.id,
                      attempt=int(runtime.flow_run.run_count or 1), kind="evaluate")
    cfg = ctx.config()
    known = [b.name for b in cfg.eval.benchmarks]
    unknown = sorted(set(benchmarks or []) - set(known))
    if unknown:
        raise ConfigError(f"unknown benchmarks {unknown}; the profile defines {known} (eval.benchmarks)")
    checkpoint_url, version = registry.resolve_model(cfg, model)
    rec = evaluate_checkpoint.with_options(retries=cfg.pipeline.task_retries)(
        ctx, "model", {"checkpoint_url": checkpoint_url}, benchmarks=benchmarks, k=k,
        label=f"eval {model}" + (f" (version {version})" if version else ""))
    table = pass1_by_benchmark(rec["report"])
    out = {"model": model, "version": version, "checkpoint_url": checkpoint_url, "pass1": table}
    rows = "\n".join(f"| {b} | {p:.3f} |" for b, p in sorted(table.items()))
    create_markdown_artifact(key="evaluation", markdown=f"## {model} (version {version or '-'})\n\n"
                             f"| benchmark | pass@1 |\n|---|---|\n{rows}\n\ncheckpoint: {checkpoint_url}")
    print(out)
    return out


@flow(name="rstar2", flow_run_name="nightly-eval {model}", log_prints=True)
def nightly_eval(model: str = "champion", benchmarks: list[str] | None = None, profile: str = "tiny",
                 overrides: list[str] | None = None) -> dict:
    """Evaluate the champion, compare with the previous nightly, fail on a regression."""
    result = evaluate(model=model, benchmarks=benchmarks, profile=profile, overrides=overrides)
    ctx_cfg = load_config(profile, list(overrides or []))
    prev = nightly.previous(ctx_cfg)
    threshold = ctx_cfg.eval.nightly_regression_threshold
    rows = compare(prev["pass1"] if prev else None, result["pass1"], threshold)
    title = (f"Nightly eval of {model} (version {result['version'] or '-'}) vs previous nightly "
             f"(version {prev.get('version') or '-'})" if prev else f"Nightly eval of {model}: first night")
    md = comparison_markdown(rows, threshold, title)
    create_markdown_artifact(key="nightly-eval", markdown=md, description="nightly pass@1 vs previous night")
    nightly.record(ctx_cfg, result, runtime.flow_run.id)
    print(md)
    bad = [r["benchmark"] for r in rows if r["regression"]]
    if bad:
        raise RegressionError(f"pass@1 regression beyond {threshold} on {bad}; see the nightly-eval artifact")
    return {**result, "comparison": rows}
