"""`full_recipe`: the whole rStar2-Agent recipe as one Prefect flow (deployment `rstar2/full-recipe`).

Curate, SFT data and the base model, then SFT, the RL stages of `cfg.rl.stages` (one of them on the hard
subset), an evaluation of every stage's checkpoint, and register-best with promotion. Invariant: every
task reads the run's frozen config snapshot (tasks/run_config.py), so the UI's Retry runs what the first
attempt ran; the flow only composes tasks (validation, lineage and persistence live in tasks/), and the
stage DAG runs as a subflow so that its task runner can be chosen per run from the profile.

Run: `prefect deployment run rstar2/full-recipe -p profile=tiny` (see docs/pipeline.md, "What runs"), or
locally `python -m flows.full_recipe --profile tiny --set rl.stages.0.steps=2`.
"""

from __future__ import annotations

import argparse

from prefect import flow, runtime
from prefect.artifacts import create_markdown_artifact

from flows.flow_process import final_state_accepted, on_cancel
from rstar2_cli.common import add_profile_args
from tasks.context import RecipeContext, stage_label
from tasks.recipe import close_recipe, open_recipe, register_best
from tasks.runners import placement, task_runner
from tasks.stages import (
    base_model,
    build_sft_data,
    curate_data,
    evaluate_checkpoint,
    hard_subset,
    rl_stage,
    sft,
)
from tasks.summary import render_summary


def _sft_label(sc) -> str:
    """The SFT task's name in the run's progress: its length, or its cap and criterion."""
    cap = f"{sc.max_steps} steps" if sc.max_steps else f"{sc.epochs:g} epochs"
    return f"sft ({cap})" if sc.converged_loss is None else f"sft (to loss < {sc.converged_loss:g}, at most {cap})"


def _configured(t, cfg):
    return t.with_options(retries=cfg.pipeline.task_retries, retry_delay_seconds=cfg.pipeline.retry_delay_s)


@flow(name="recipe-stages", log_prints=True)
def recipe_stages(ctx: RecipeContext) -> dict:
    """The stage DAG of one recipe run (a subflow of `full_recipe`)."""
    cfg = ctx.config()
    T = {t.name: _configured(t, cfg) for t in (curate_data, build_sft_data, base_model, sft, rl_stage,
                                                hard_subset, evaluate_checkpoint, register_best)}
    dag = []  # every submitted future, in DAG order

    def submit(kind, name, *args, **kw):
        with placement(cfg, kind):
            dag.append(T[name].submit(ctx, *args, **kw))
        return dag[-1]

    curated = submit("curate", "curate", label="curate")
    sft_data = submit("sft_data", "build-sft-data", label="sft-data")
    base = submit("base_model", "base-model", label=f"base-model ({cfg.model.kind})")
    policy = submit("sft", "sft", base, sft_data, label=_sft_label(cfg.sft))
    evals = {"sft": submit("eval", "evaluate", "sft", policy, label="eval sft")}  # the promotion baseline
    last = len(cfg.rl.stages) - 1
    for i, st in enumerate(cfg.rl.stages):
        data = curated
        if st.dataset == "hard_subset":
            data = submit("hard_subset", "hard-subset", i, policy, curated,
                          label=f"{st.name} hard subset (k={st.hard_subset_k})")
        policy = submit("rl", "rl-stage", i, policy, data, label=stage_label(cfg, i))
        if cfg.pipeline.eval_stages != "last" or i == last:
            evals[st.name] = submit("eval", "evaluate", st.name, policy, label=f"eval {st.name}")
    registered = submit("register", "register-best", evals)
    return _first_failure_or(registered, dag)


def _first_failure_or(final, futures: list):
    """The final task's result; when the DAG failed, raise the error of the task that failed first in time:
    the cause, not a consequence (a task downstream of it, or an independent one that started after and met
    what the first left, e.g. an eval finding the node the RL stage lost: `LayoutDoesNotFit` after
    `NodeLost`). Ties keep DAG order."""
    final.wait()
    for f in futures:
        f.wait()
    failed = [f for f in futures if f.state.is_failed() or f.state.is_crashed()]
    if failed:
        min(failed, key=lambda f: f.state.timestamp).result()
    return final.result()


def _on_failure(flow, flow_run, state):
    final_state_accepted(state)
    p = flow_run.parameters
    close_recipe(p.get("profile", "tiny"), list(p.get("overrides") or []), p.get("run_id") or str(flow_run.id),
                 "FAILED")


def _on_completion(flow, flow_run, state):
    p = flow_run.parameters
    close_recipe(p.get("profile", "tiny"), list(p.get("overrides") or []), p.get("run_id") or str(flow_run.id),
                 "FINISHED")


@flow(name="rstar2", flow_run_name="full-recipe {profile}", log_prints=True, on_failure=[_on_failure], on_completion=[_on_completion])
def full_recipe(profile: str = "tiny", overrides: list[str] | None = None, run_id: str | None = None) -> dict:
    """Run the recipe of `profile` with dotted `overrides`; `run_id` (default: this flow run's id) keys its
    storage, so the UI's Retry of this flow run reuses every finished stage."""
    ctx = open_recipe(profile, list(overrides or []), run_id, runtime.flow_run.id,
                      attempt=int(runtime.flow_run.run_count or 1))
    on_cancel(lambda: close_recipe(profile, list(overrides or []), ctx.run_id, "KILLED"))
    cfg = ctx.config()
    runner = task_runner(cfg)
    summary = recipe_stages.with_options(task_runner=runner, flow_run_name=f"{cfg.profile} stages {ctx.run_id[:8]}")(ctx)
    order = ["sft"] + [s.name for s in cfg.rl.stages]
    table = render_summary(cfg, ctx.store(cfg), summary, order, ctx.parent_run_id)
    create_markdown_artifact(key="recipe-summary", markdown=table, description=f"recipe run {ctx.run_id}")
    ctx.store(cfg).save("summary", {**summary, "markdown": table}, attempt=ctx.attempt)
    print(table)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description="Run the full recipe in this process (no server needed).")
    add_profile_args(ap)
    ap.add_argument("--run-id", default=None, help="an earlier run's id resumes that run with its own config")
    a = ap.parse_args()
    try:
        full_recipe(profile=a.profile, overrides=a.overrides, run_id=a.run_id)
    except RuntimeError as e:
        if not str(e).startswith("Failed to reach API"):      # Prefect's words for a PREFECT_API_URL that does not answer
            raise
        raise SystemExit(f"{e.args[0]}: the Prefect API does not answer; start it (scripts/services.sh up), set "
                         "PREFECT_API_URL to your server's API, or unset it to run on a temporary one") from None


if __name__ == "__main__":
    main()
