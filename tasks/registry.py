"""The MLflow model registry side of the pipeline: one version of `rstar2-agent` per recipe run.

Convention (docs/CONTRACTS.md): a version carries tag `checkpoint_url` (the fsspec URL of its HF
checkpoint); `models:/rstar2-agent@champion` resolves through that tag, and tag `eval_report_url` (its
`report.json`) lets the next run compare against the champion's per-problem results. The version's
`source` is a small pointer artifact logged under the parent run (so an MLflow server accepts it; the
weights are never copied). Which aliases a version gets is decided before it is registered
(`rstar2_core.eval.promotion.decide_promotion`: `candidate` when it beats its run's SFT checkpoint,
`champion` when it also beats the current champion); tag `promotion` holds that decision's line.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from prefect import get_run_logger

from rstar2_core import storage
from rstar2_core.config import Config
from rstar2_core.eval.metrics import EvalReport
from tasks import tracking
from tasks.context import RecipeContext
from tasks.modelref import registry_checkpoint


@dataclass(frozen=True)
class Registration:
    """A registered version: `version` of `name`, the stage it came from, its primary score, aliases set."""

    name: str
    version: int
    stage: str
    checkpoint_url: str
    primary_pass1: float
    aliases: tuple[str, ...] = ()
    metrics: dict = field(default_factory=dict)

    def summary_line(self) -> str:
        alias = f" (alias {', '.join(self.aliases)})" if self.aliases else " (no alias)"
        return f"{self.name} version {self.version}{alias}"


def _ensure_model(c, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        c.get_registered_model(name)
    except MlflowException:
        try:
            c.create_registered_model(name, description="rStar2-Agent recipe checkpoints; tag checkpoint_url "
                                                        "holds the HF checkpoint URL")
        except MlflowException:
            c.get_registered_model(name)  # created concurrently


def _alias_version(c, name: str, alias: str):
    from mlflow.exceptions import MlflowException

    try:
        return c.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def existing_version(cfg: Config, recipe_run_id: str):
    """The version already registered for this recipe run (a retried flow run must not add another)."""
    c = tracking.client(cfg)
    name = cfg.tracking.registered_model
    versions = c.search_model_versions(f"name='{name}' and tag.`rstar2.recipe_run_id`='{recipe_run_id}'")
    return versions[0] if versions else None


def champion(cfg: Config) -> tuple[str, EvalReport | None] | None:
    """(label `version N`, its EvalReport, or None when its `eval_report_url` tag is missing or the file
    is gone) of the current champion, or None when there is none."""
    mv = _alias_version(tracking.client(cfg), cfg.tracking.registered_model, "champion")
    if mv is None:
        return None
    url = (mv.tags or {}).get("eval_report_url")
    return f"version {mv.version}", EvalReport.load(url) if url and storage.exists(url) else None


def register(cfg: Config, *, parent_run_id: str, recipe_run_id: str, stage: str, report: EvalReport,
             primary_pass1: float, aliases: tuple[str, ...], promotion_line: str,
             lineage: dict[str, str]) -> Registration:
    """Register `report`'s checkpoint as this recipe run's version (idempotent per recipe run) and set
    `aliases` on it."""
    c = tracking.client(cfg)
    name = cfg.tracking.registered_model
    checkpoint_url = report.checkpoint_url
    metrics = {f"eval/{b}/pass@1": p for b, p in report.pass1().items()}
    _ensure_model(c, name)
    mv = existing_version(cfg, recipe_run_id)
    if mv is None:
        with tempfile.TemporaryDirectory(prefix="rstar2-ptr-") as d:
            ptr = Path(d) / "checkpoint.json"
            ptr.write_text(json.dumps({"checkpoint_url": checkpoint_url, "stage": stage}, indent=2))
            c.log_artifact(parent_run_id, str(ptr), artifact_path="model")
        source = f"{c.get_run(parent_run_id).info.artifact_uri.rstrip('/')}/model"
        tags = {"checkpoint_url": checkpoint_url, "stage": stage, "rstar2.recipe_run_id": recipe_run_id,
                "eval_report_url": report.json_url or "", "primary_pass1": f"{primary_pass1:.6g}",
                "promotion": promotion_line[:5000],
                "git_sha": c.get_run(parent_run_id).data.tags.get("git_sha", tracking.git_sha()), **lineage,
                **{tracking.metric_key(k): f"{v:.6g}" for k, v in metrics.items()}}
        mv = c.create_model_version(name, source=source, run_id=parent_run_id, tags=tags)
    version = int(mv.version)
    for alias in aliases:
        c.set_registered_model_alias(name, alias, version)
    c.set_tag(parent_run_id, "registered_model_version", f"{name}/{version}")
    return Registration(name=name, version=version, stage=stage, checkpoint_url=checkpoint_url,
                        primary_pass1=primary_pass1, aliases=tuple(aliases), metrics=dict(metrics))


def resolve_model(cfg: Config, model: str) -> tuple[str, str | None]:
    """(checkpoint URL, version) for `models:/<name>@<alias>`, `models:/<name>/<version>`, a bare alias
    (`champion`, looked up under `cfg.tracking.registered_model`) or a checkpoint URL/path (returned
    as is, version None)."""
    if "/" not in model and "." not in model and ":" not in model:
        model = f"models:/{cfg.tracking.registered_model}@{model}"
    if not model.startswith("models:/"):
        return model, None
    return registry_checkpoint(model, cfg.resolved_tracking_uri())


def resolve_pinned(ctx: RecipeContext, model: str) -> tuple[str, str | None]:
    """`resolve_model` once per flow run: the first attempt records what it resolved (run store key
    `resolved-model`) and a retry returns that, even if an alias such as `champion` moved since (the retry
    would otherwise pair the new version with the first attempt's stored report)."""
    cfg = ctx.config()
    store = ctx.store(cfg)
    pinned = store.record("resolved-model")
    if pinned is not None:
        got = pinned["result"]
        get_run_logger().info(f"{model}: evaluating {got['checkpoint_url']} (version {got['version']}), as "
                              f"resolved by attempt {pinned['attempt']} of this flow run")
        return got["checkpoint_url"], got["version"]
    checkpoint_url, version = resolve_model(cfg, model)
    store.save("resolved-model", {"model": model, "checkpoint_url": checkpoint_url, "version": version},
               attempt=ctx.attempt)
    return checkpoint_url, version
