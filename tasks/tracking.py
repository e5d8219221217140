"""MLflow lineage for the pipeline (the only place besides flows/ that imports mlflow).

One parent run per recipe run (tags: Prefect flow run id, git SHA, profile), one nested run per stage
(tags: checkpoint URL, dataset URLs), params = the run's config snapshot flattened to dotted keys, metrics
per step through the `log_metrics(dict, step)` callback the core receives, datasets as run inputs with
their content digests, PNG plots of each stage's metric curves as artifacts. Checkpoints are never
copied into MLflow: runs carry their fsspec URLs as tags and params.

Every call names its run id explicitly (`MlflowClient`, no fluent "active run"), so it works the same
from the flow process, a thread or a Ray worker. The tracking URI is `cfg.resolved_tracking_uri()`
(SQLite under the state folder by default; an http:// server URI works the same).
"""

from __future__ import annotations

import functools
import re
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from rstar2_core.config import REPO_ROOT, Config
from rstar2_core.config.snapshot import flatten_tree
from rstar2_core.errors import InfraError
from rstar2_core.results import DatasetRef

# The panels a stage's PNG shows first, by the names the core emits (tests/flows/test_task_helpers.py
# checks each against the metrics of the RL step, the evaluation and curation); the rest follow by name.
_PLOT_FIRST = ("rollout/reward_mean", "actor/pg_loss", "actor/grad_norm", "rollout/response_tokens_mean",
               "rollout/tool_calls_per_traj", "rollout/dropped_group_frac", "eval/synthetic/pass1", "data/kept")
_BAD_KEY_CHARS = re.compile(r"[^0-9A-Za-z_\-. /:]")


def metric_key(name: str) -> str:
    """MLflow-safe metric/param key: `eval/synthetic/pass@1` -> `eval/synthetic/pass_at_1`."""
    return _BAD_KEY_CHARS.sub("_", name.replace("@", "_at_"))


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """{"rl": {"stages": [{"steps": 6}]}} -> {"rl.stages.0.steps": "6"} (None values kept as "None")."""
    return {k: str(v) for k, v in flatten_tree(tree, prefix).items()}


@functools.lru_cache(maxsize=1)
def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@functools.lru_cache(maxsize=8)
def _client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def client(cfg: Config):
    return _client(cfg.resolved_tracking_uri())


EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
"""The experiment tag that tells MLflow 3's UI this is model training (runs table, nested runs, metric
charts), not a GenAI app (traces, "evaluation runs"). UIs that choose the view from the sidebar's
workflow switch instead read `?workflowType=machine_learning` in the link the demo prints (scripts/demo.sh)."""


def experiment_id(cfg: Config) -> str:
    """Id of `cfg.tracking.experiment`, tagged as a model-training experiment (`EXPERIMENT_KIND`). Created
    with its artifacts where the tracking store keeps them: a tracking server (http/https) its own artifact
    root (production: `--serve-artifacts` to S3, so that a plot logged on any node reaches the server's
    store; the production rehearsal found them in each node's local folder), a local store (sqlite, a
    folder) the state folder's `mlartifacts`."""
    c = client(cfg)
    exp = c.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        server = cfg.resolved_tracking_uri().startswith(("http://", "https://"))
        location = None if server else (cfg.resolved_state_dir() / "mlartifacts").as_uri()
        from mlflow.exceptions import MlflowException

        err: MlflowException | None = None
        try:
            c.create_experiment(cfg.tracking.experiment, artifact_location=location, tags=dict([EXPERIMENT_KIND]))
        except MlflowException as e:  # created concurrently by another process: read it back
            err = e
        exp = c.get_experiment_by_name(cfg.tracking.experiment)
        if exp is None:
            raise RuntimeError(f"MLflow experiment {cfg.tracking.experiment!r} could not be created at "
                               f"{cfg.resolved_tracking_uri()}") from err
    if exp.tags.get(EXPERIMENT_KIND[0]) is None:   # an experiment made before the tag existed, or by hand
        c.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
    return exp.experiment_id


def log_params(cfg: Config, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    items = [Param(metric_key(k), str(v)[:6000]) for k, v in params.items()]
    existing = client(cfg).get_run(run_id).data.params
    items = [p for p in items if p.key not in existing]  # a resumed run already has them
    for i in range(0, len(items), 100):
        client(cfg).log_batch(run_id, params=items[i:i + 100])


def start_parent_run(cfg: Config, *, run_name: str, recipe_run_id: str, flow_run_id: str | None,
                     config_tree: dict, config_digest: str) -> str:
    """Create the recipe run's parent MLflow run with lineage tags, the run's config snapshot as params and
    its digest as tag `config_digest`."""
    c = client(cfg)
    run = c.create_run(experiment_id(cfg), run_name=run_name, tags={
        "rstar2.recipe_run_id": recipe_run_id, "rstar2.profile": cfg.profile, "config_digest": config_digest,
        "prefect.flow_run_id": flow_run_id or "", "git_sha": git_sha(), "mlflow.source.git.commit": git_sha()})
    log_params(cfg, run.info.run_id, flatten(config_tree))
    return run.info.run_id


def start_stage_run(cfg: Config, *, parent_run_id: str, stage: str, params: dict[str, Any]) -> str:
    """Create a nested run for one stage under the parent run."""
    c = client(cfg)
    run = c.create_run(experiment_id(cfg), run_name=stage, tags={
        "mlflow.parentRunId": parent_run_id, "rstar2.stage": stage, "git_sha": git_sha()})
    log_params(cfg, run.info.run_id, params)
    return run.info.run_id


def reopen(cfg: Config, run_id: str) -> None:
    """Mark a run RUNNING again (a retried stage continues the same MLflow run)."""
    client(cfg).update_run(run_id, status="RUNNING")


def finish(cfg: Config, run_id: str, status: str = "FINISHED") -> None:
    client(cfg).set_terminated(run_id, status=status)


def finish_running_children(cfg: Config, parent_run_id: str, status: str) -> list[str]:
    """End every nested run of `parent_run_id` still RUNNING with `status`; returns their ids. For a
    cancelled run, whose stage threads never reach their own `finish` (the process is ended under them)."""
    runs = client(cfg).search_runs([experiment_id(cfg)], max_results=1000, filter_string=(
        f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.status = 'RUNNING'"))
    for r in runs:
        finish(cfg, r.info.run_id, status)
    return [r.info.run_id for r in runs]


class MetricsLogger:
    """The `log_metrics(metrics, step)` callback handed to the core. Non-numeric values are skipped.

    Metrics are buffered and written in one `log_batch` once `flush_s` seconds passed since the last
    write (on the call that finds it so), and by `flush()`, which the stage task calls when the stage
    ends, failed or not: the UI's curves are live, at most `flush_s` late. A write per step is one SQLite
    commit (6.6 ms on the 2-core machine, timed once), which SFT's 1,993 steps would pay on the critical
    path.

    No point twice across a retry: a retried stage's logger gets `written` ({metric key: highest step an
    earlier attempt wrote}, `written_steps`) and drops a metric at a step up to that. A failed RL or SFT
    stage resumes from its last checkpoint (every `rl.checkpoint_every` / `sft.checkpoint_every` steps)
    and runs the steps after it again: their points stay those of the first attempt, which an exact resume
    repeats (docs/rl.md, "Checkpoints and resume"; wall-clock timings differ). A stage a retry starts over
    (curation, evaluation) keeps its first attempt's points the same way, and logs what that attempt did
    not reach. A process killed outright loses at most `flush_s` of points, which the retry then logs."""

    def __init__(self, cfg: Config, run_id: str, prefix: str = "", flush_s: float = 5.0,
                 written: dict[str, int] | None = None):
        self._client, self.run_id, self.prefix, self.flush_s = client(cfg), run_id, prefix, flush_s
        self.written = dict(written or {})
        self._pending: list = []
        self.outages = 0
        self._last = time.monotonic()

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for k, v in metrics.items():
            key = metric_key(self.prefix + k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and step > self.written.get(key, -1):
                self._pending.append(Metric(key, float(v), now, int(step)))
        if time.monotonic() - self._last >= self.flush_s:
            self.flush()

    def flush(self) -> bool:
        """Write every buffered metric (MLflow takes at most 1,000 per call). When the tracking server does
        not answer (after the MLflow client's own retries), the points stay buffered for the next flush
        and this returns False: a server restarted mid-stage costs no point."""
        batch, self._pending = self._pending, []
        self._last = time.monotonic()
        for i in range(0, len(batch), 1000):
            try:
                self._client.log_batch(self.run_id, metrics=batch[i:i + 1000])
            except Exception as e:
                if not unreachable(e):
                    raise
                self._pending = batch[i:] + self._pending
                self.outages += 1
                if self.outages == 1 or self.outages % 20 == 0:
                    warnings.warn(f"the MLflow server does not answer ({str(e)[:200]}); {len(self._pending)} "
                                  f"metric points of run {self.run_id} stay buffered and are written when it is "
                                  "back", stacklevel=2)
                return False
        return True

    def pending_points(self) -> list[dict]:
        """The buffered points, as JSON (what `save_points` keeps for the stage's retry)."""
        return [{"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step} for m in self._pending]


class TrackingUnavailable(InfraError):
    """The MLflow server did not take a stage's last metric points (after the client's retries). The points
    are kept beside the run's state (`save_points`) and the stage's retry writes them first; retryable."""


def unreachable(exc: BaseException) -> bool:
    """An MLflow client call that did not reach its server: the `MlflowException` the REST client raises
    while handling a connection error or timeout (after its own retries)."""
    if not type(exc).__module__.startswith("mlflow"):
        return False
    seen, e = set(), exc.__cause__ or exc.__context__
    while e is not None and id(e) not in seen:
        if isinstance(e, (OSError, ConnectionError, TimeoutError)):   # requests' errors are OSErrors
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return "failed with exception" in str(exc) and ("Connection" in str(exc) or "Max retries" in str(exc))


def save_points(url: str, points: list[dict]) -> None:
    """Keep metric points the server did not take (a stage ending during a tracking outage) at `url`, for
    `replay_points` in the stage's retry."""
    from rstar2_core import storage

    storage.write_json_atomic(url, points)


def replay_points(cfg: Config, run_id: str, url: str) -> int:
    """Write the points `save_points` kept at `url` into run `run_id` and delete the file; returns how many."""
    from mlflow.entities import Metric

    from rstar2_core import storage

    if not storage.exists(url):
        return 0
    points = [Metric(p["key"], float(p["value"]), int(p["timestamp"]), int(p["step"]))
              for p in storage.read_json(url)]
    for i in range(0, len(points), 1000):
        client(cfg).log_batch(run_id, metrics=points[i:i + 1000])
    storage.remove(url)
    return len(points)


def written_steps(cfg: Config, run_id: str) -> dict[str, int]:
    """{metric key: the highest step logged} of a run: what an earlier attempt of its stage wrote."""
    c = client(cfg)
    return {key: max(m.step for m in c.get_metric_history(run_id, key))
            for key in c.get_run(run_id).data.metrics}


def metrics_logger(cfg: Config, run_id: str, prefix: str = "", flush_s: float = 5.0,
                   written: dict[str, int] | None = None) -> MetricsLogger:
    """The `log_metrics(metrics, step)` callback of a stage's run (`MetricsLogger`; call `.flush()` at the end)."""
    return MetricsLogger(cfg, run_id, prefix, flush_s, written)


def log_dataset(cfg: Config, run_id: str, ref: DatasetRef, *, name: str, context: str = "training") -> None:
    """Log a published dataset as a run input: its URL, content digest and row count."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.exceptions import MlflowException

    try:
        with warnings.catch_warnings():  # "can be interpreted in multiple ways": all are the same local source
            warnings.simplefilter("ignore")
            source = resolve_dataset_source(ref.url)
    except MlflowException:  # a URL scheme MLflow has no source type for: record it as a URL source
        from mlflow.data.http_dataset_source import HTTPDatasetSource

        source = HTTPDatasetSource(ref.url)
    ds = MetaDataset(source=source, name=name, digest=ref.digest[:36])
    client(cfg).log_inputs(run_id, datasets=[DatasetInput(ds._to_mlflow_entity(),
                                                           tags=[InputTag("mlflow.data.context", context)])])
    c = client(cfg)
    c.set_tag(run_id, f"dataset.{name}.url", ref.url)
    c.set_tag(run_id, f"dataset.{name}.digest", ref.digest)
    c.set_tag(run_id, f"dataset.{name}.rows", str(ref.n_rows))


def log_checkpoint(cfg: Config, run_id: str, checkpoint_url: str, key: str = "checkpoint_url") -> None:
    """A checkpoint is referenced by URL (tag), never copied into the artifact store."""
    client(cfg).set_tag(run_id, key, checkpoint_url)


def log_metric_plot(cfg: Config, run_id: str, title: str, max_metrics: int = 6) -> str | None:
    """PNG of the run's per-step metric curves (the first `max_metrics` keys), logged as `plots/<run>.png`."""
    c = client(cfg)
    have = c.get_run(run_id).data.metrics
    keys = ([k for k in _PLOT_FIRST if k in have] + sorted(k for k in have if k not in _PLOT_FIRST))[:max_metrics]
    series = {k: sorted((m.step, m.value) for m in c.get_metric_history(run_id, k)) for k in keys}
    series = {k: v for k, v in series.items() if len(v) > 1}
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(series), 1, figsize=(6, 2.2 * len(series)), squeeze=False)
    for ax, (k, pts) in zip(axes[:, 0], series.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".")
        ax.set_title(k, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    with tempfile.TemporaryDirectory(prefix="rstar2-plot-") as d:
        path = Path(d) / f"{re.sub(r'[^0-9A-Za-z_.-]', '_', title)}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        c.log_artifact(run_id, str(path), artifact_path="plots")
        return f"plots/{path.name}"


def log_file_artifact(cfg: Config, run_id: str, url: str, artifact_path: str) -> None:
    """Copy one small file (a PNG or report) from a storage URL into the run's artifacts."""
    from rstar2_core import storage

    with tempfile.TemporaryDirectory(prefix="rstar2-art-") as d:
        path = Path(d) / url.rstrip("/").rsplit("/", 1)[-1]
        path.write_bytes(storage.read_bytes(url))
        client(cfg).log_artifact(run_id, str(path), artifact_path=artifact_path)


def metric_steps(cfg: Config, run_id: str, key: str) -> list[int]:
    """Steps at which `key` was logged, in logging order (for resume checks)."""
    hist = client(cfg).get_metric_history(run_id, metric_key(key))
    return [m.step for m in sorted(hist, key=lambda m: (m.timestamp, m.step))]
