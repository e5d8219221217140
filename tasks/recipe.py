"""Recipe-level steps around the stage tasks: validate inputs before any compute, freeze the run's config,
open/close the MLflow parent run, decide the promotion of the best checkpoint and register it.

    preflight(cfg)              bad data/benchmark URLs, unknown resource keys, unreachable storage -> ConfigError
    open_recipe(...)            -> RecipeContext (config snapshot written once, parent MLflow run created once)
    register_best(ctx, reports) -> summary dict (idempotent per recipe run)

The summary a user reads (table, timings, plot) is tasks/summary.py.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rstar2_core import storage
from rstar2_core.config import Config, ConfigError, SnapshotError, load_config
from rstar2_core.eval.compare import primary_benchmark, rank_checkpoints
from rstar2_core.eval.metrics import EvalReport
from rstar2_core.eval.promotion import SFT_STAGE, decide_promotion
from tasks import registry, tracking
from tasks.context import RecipeContext, apply_storage_settings
from tasks.retry import retry_on_infrastructure_error
from tasks.run_config import drift_notes, locate_store, read_snapshot, write_snapshot


def preflight(cfg: Config, kind: str = "recipe") -> None:
    """Fail fast, before any compute, on inputs that cannot work: every source, SFT file, benchmark and
    checkpoint the run will read (`kind` "recipe": the whole recipe; another kind, an evaluation, reads
    only the benchmarks), the storage root it writes, the MLflow server and the Ray address it talks to.
    One `ConfigError` names each problem and the setting that points at it."""
    apply_storage_settings(cfg)
    dead_s3 = s3_endpoint_problem(cfg)
    if dead_s3:     # every object check would wait out botocore's retries against it: name the endpoint once
        raise ConfigError("the recipe cannot start:\n  " + "\n  ".join([dead_s3, *endpoint_problems(cfg)]))
    with storage.outage_budget(0):  # a check fails at once on a store that does not answer (StoreUnavailable)
        problems = [*_recipe_input_problems(cfg), *gpu_memory_problems(cfg)] if kind == "recipe" else []
        for i, b in enumerate(cfg.eval.benchmarks):
            if b.url and not storage.exists(b.url):
                problems.append(f"eval.benchmarks.{i}.url = {b.url!r} ({b.name}) does not exist; fix the URL "
                                "or drop the benchmark")
        root = cfg.resolved_storage_root()
        try:
            probe = storage.join(root, ".preflight")
            storage.write_text_atomic(probe, "ok")
            storage.remove(probe)
        except Exception as e:  # noqa: BLE001 - whatever the cause, the run could not save anything: say so
            problems.append(f"storage root {root!r} is not writable ({type(e).__name__}: {e}); fix storage.root "
                            "or storage.s3_endpoint_url")
    problems += endpoint_problems(cfg)
    if problems:
        raise ConfigError("the recipe cannot start:\n  " + "\n  ".join(problems))


def _recipe_input_problems(cfg: Config) -> list[str]:
    """What only the whole recipe reads: the RL and SFT sources, the base and label-check models."""
    problems = []
    for i, src in enumerate(cfg.data.sources):
        if not storage.exists(src.url):
            problems.append(f"data.sources.{i}.url = {src.url!r} does not exist; fix the URL or remove the source")
    for i, url in enumerate(cfg.data.sft_sources):
        if not storage.exists(url):
            problems.append(f"data.sft_sources.{i} = {url!r} does not exist; fix the URL or remove the file")
    if not (cfg.data.synthetic.enabled and cfg.data.synthetic.n_sft) and not cfg.data.sft_sources:
        problems.append("the SFT set would be empty: data.synthetic is off (or n_sft = 0) and data.sft_sources "
                        "lists no file; list the SFT data (function calling, instruction following, chat: "
                        "JSONL/parquet in OpenAI `messages` or ShareGPT `conversations` form) in "
                        "data.sft_sources, or enable data.synthetic")
    checkpoints = [("model.name_or_path", cfg.model.name_or_path)] if cfg.model.kind == "hf" else []
    if cfg.data.label_check.enabled and cfg.data.label_check.model:
        checkpoints.append(("data.label_check.model", cfg.data.label_check.model))
    for field, path in checkpoints:
        if "://" not in (path or "") and not storage.exists(path or ""):
            problems.append(f"{field} = {path!r} does not exist locally")
        elif "://" in (path or "") and not storage.is_complete(path) and not (
                field == "model.name_or_path" and storage.exists(storage.join(path, "config.json"))):
            # a base model may be a plain HF folder (models/prepare.py copies it); a checkpoint needs its marker
            problems.append(f"{field} = {path!r} is not a complete checkpoint (no {storage.COMPLETE_MARKER} "
                            "marker: missing, or its upload did not finish); upload it (infra/README.md) or fix the URL")
    if not cfg.data.sources and not cfg.data.synthetic.enabled:
        problems.append("no training data: add data.sources or set data.synthetic.enabled = true")
    return problems


def gpu_memory_problems(cfg: Config) -> list[str]:
    """Where the run's GPUs would run out of memory (rstar2_core/runtime/cluster_plan.py): sized from the
    policy's config.json in the store. Nothing to check on CPUs, logical GPUs or without
    `cluster.gpu_memory_gb` (`rstar2 plan` says so); a model missing from the store is named by the input
    check, a config.json that cannot be read or sized is a problem here."""
    from rstar2_core.runtime.cluster_plan import gpu_plan, skip_reason
    from rstar2_core.runtime.specs import gpu_plan_sections

    if cfg.model.kind != "hf" or skip_reason(cfg.cluster, {}, "") is not None:
        return []
    url = storage.join(cfg.model.name_or_path, "config.json")
    if not storage.exists(url):
        return []
    try:
        hf = storage.read_json(url)
    except ValueError as e:
        return [f"{url} is not a readable config.json ({e}); the GPU memory check needs it: fix model.name_or_path"]
    plan = gpu_plan(**gpu_plan_sections(cfg), hf=hf, source=url)
    if "skipped" in plan["gpu_memory"]:
        return [(f"GPU memory cannot be checked: {plan['gpu_memory']['skipped']}; add the model's layout to "
                 "rstar2_core/models/param_count.py, or unset cluster.gpu_memory_gb to run unchecked")]
    return plan["problems"]


ENDPOINT_TIMEOUT_S = 5.0
"""How long preflight waits for the MLflow server or the Ray head to answer."""


def s3_endpoint_problem(cfg: Config) -> str | None:
    """A line naming `storage.s3_endpoint_url` when it is set and nothing answers HTTP there within
    `ENDPOINT_TIMEOUT_S` (any HTTP status is an answer: S3 APIs refuse anonymous requests), else None."""
    import urllib.error
    import urllib.request

    url = cfg.storage.s3_endpoint_url
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=ENDPOINT_TIMEOUT_S) as r:
            r.read(0)
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as e:
        return (f"storage.s3_endpoint_url = {url!r}: the S3 endpoint does not answer ({e}); every dataset, "
                "checkpoint and the storage root are read through it: start it or fix the URL")
    return None


def endpoint_problems(cfg: Config) -> list[str]:
    """The MLflow server (`tracking.tracking_uri` over HTTP: its /health), the Ray head (`cluster.ray_address`
    as host:port: a TCP connection) and the tool service (`sandbox.service.url`'s /health, with
    `sandbox.backend = "service"`) answer within `ENDPOINT_TIMEOUT_S`, or a line
    naming the endpoint, the setting and what went wrong."""
    import socket
    import urllib.request

    out = []
    uri = cfg.tracking.tracking_uri or ""
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=ENDPOINT_TIMEOUT_S) as r:
                r.read()
        except OSError as e:
            out.append(f"tracking.tracking_uri = {uri!r}: the MLflow server does not answer ({e}); start it "
                       "(infra/README.md) or fix the URI")
    addr = cfg.cluster.ray_address or ""
    if cfg.cluster.runtime == "ray" and addr and addr != "auto" and not addr.startswith("ray://"):
        host, _, port = addr.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=ENDPOINT_TIMEOUT_S).close()
        except (OSError, ValueError) as e:
            out.append(f"cluster.ray_address = {addr!r}: no Ray head answers there ({e}); start the cluster "
                       "(`rstar2 cluster up`, infra/README.md) or fix the address")
    svc = cfg.sandbox.service
    if cfg.sandbox.backend == "service" and svc.url:     # without a URL each stage checks it through Ray at start
        try:
            with urllib.request.urlopen(svc.url.rstrip("/") + "/health", timeout=ENDPOINT_TIMEOUT_S) as r:
                r.read()
        except OSError as e:
            out.append(f"sandbox.service.url = {svc.url!r}: the tool service does not answer its health check ({e}); "
                       "deploy it (`rstar2 tools deploy`, docs/sandbox.md) or fix the URL")
    return out


def open_recipe(profile: str, overrides: list[str], run_id: str | None, flow_run_id: str | None,
                attempt: int, kind: str = "recipe") -> RecipeContext:
    """Freeze or read back the run's config, validate its inputs, get or create its MLflow parent run
    (named `<kind> <profile> <id>`); returns the tasks' context.

    First attempt: the profile + overrides are validated, checked (`preflight`) and only then written as
    the run's snapshot (an attempt that fails before that leaves `state/open-failure.json`). Any later
    attempt (the UI's Retry) runs that snapshot, whatever the profile on disk says now, and logs what
    differs (Prefect log, and tag `rstar2.drift.attempt_<n>` on the parent MLflow run). A later attempt
    that finds neither the snapshot nor that record is looking in another store than the first attempt
    wrote to (another RSTAR2_HOME or storage root): it fails with `SnapshotError` naming the path and the
    fix, instead of starting the run again from the profile."""
    log = get_run_logger()
    rid = run_id or flow_run_id
    if not rid:
        raise ConfigError(f"{kind} needs a run_id when it runs outside a Prefect flow run")
    store = locate_store(profile, overrides, rid)
    rc = read_snapshot(store)
    notes: list[str] = []
    if rc is None:
        failed = store.open_failure()
        if attempt > 1 and failed is None:
            raise SnapshotError(
                f"attempt {attempt} of run {rid} found no config snapshot at {store.config_url()}, and no record "
                "there of an earlier attempt that failed before writing one: the run's first attempt froze its "
                "config under another storage root (this attempt resolves it from RSTAR2_HOME / state_dir / "
                f"storage.root to {store.root}). Retry with the same RSTAR2_HOME (or state_dir, storage.root) as "
                "the first attempt, e.g. in the worker's environment, so that the retry runs that snapshot and "
                "reuses its finished stages; or start a new run. Nothing was run.")
        if failed is not None:
            log.info(f"run {rid}: attempt {failed['attempt']} failed before freezing the config "
                     f"({failed['error'][:200]}); attempt {attempt} freezes it from the profile")
        try:
            cfg = load_config(profile, overrides)
            preflight(cfg, kind)
            rc = write_snapshot(store, cfg, profile, overrides)
        except BaseException as e:
            why = store.record_open_failure(attempt, e)
            if why is not None:
                log.warning(f"run {rid}: could not note in {store.root} that attempt {attempt} failed before "
                            f"freezing its config ({why}); a retry will refuse to start without a snapshot")
            raise
        log.info(f"run {rid}: config snapshot {rc.digest[:12]} written to {store.config_url()}")
    else:
        preflight(rc.config)
        notes = drift_notes(rc, profile, overrides)
        log.info(f"run {rid} (attempt {attempt}): running its config snapshot {rc.digest[:12]} "
                 f"({store.config_url()})")
        for note in notes:
            log.warning(f"{note}; the run keeps its snapshot (start a new run to use the profile as it is now)")
    cfg = rc.config
    parent = store.tracking_id("parent")
    if parent is None:
        parent = tracking.start_parent_run(cfg, run_name=f"{kind} {cfg.profile} {rid[:8]}", recipe_run_id=rid,
                                           flow_run_id=flow_run_id, config_tree=rc.tree, config_digest=rc.digest)
        store.set_tracking_id("parent", parent)
    else:
        tracking.reopen(cfg, parent)
        c = tracking.client(cfg)
        c.set_tag(parent, f"prefect.attempt.{attempt}", flow_run_id or "")
        if notes:
            c.set_tag(parent, f"rstar2.drift.attempt_{attempt}", "\n".join(notes)[:5000])
    return RecipeContext(run_id=rid, config_json=rc.json, config_digest=rc.digest, attempt=attempt,
                         parent_run_id=parent, flow_run_id=flow_run_id, state_dir=str(cfg.resolved_state_dir()))


def close_recipe(profile: str, overrides: list[str], run_id: str, status: str) -> None:
    """Mark the parent MLflow run FINISHED/FAILED (called from flow state hooks), or KILLED with every
    stage run still RUNNING under it (a cancelled run: `flows.flow_process.on_cancel`)."""
    try:
        store = locate_store(profile, overrides, run_id)
        rc = read_snapshot(store)
    except ConfigError:  # the run failed on its config: it never opened an MLflow run
        return
    if rc is None:  # failed before its snapshot was written: no MLflow run either
        return
    apply_storage_settings(rc.config)
    parent = store.tracking_id("parent")
    if parent is not None:
        if status == "KILLED":
            tracking.finish_running_children(rc.config, parent, status)
        tracking.finish(rc.config, parent, status)


def _stage_figures(store, stage: str) -> dict:
    """What the summary shows of a stage beside its pass@1: an RL stage's largest engine/trainer log-prob
    gap of a sampled token (None for SFT, or a stage that took no optimizer step), and SFT's optimizer
    steps and the step it converged at (None for the RL stages)."""
    res = store.load(stage)
    metrics = getattr(res, "metrics", None) or {}
    gap = metrics.get("total/actor/engine_logprob_gap_max")
    conv = metrics.get("sft/converged_step")
    sft = None if stage != SFT_STAGE else {"steps": int(getattr(res, "steps", 0) or 0),
                                           "converged_step": None if conv is None else int(conv)}
    return {"engine_logprob_gap_max": None if gap is None else float(gap), "sft": sft}


@task(name="register-best", task_run_name="register best checkpoint", retries=2, retry_delay_seconds=2,
      retry_condition_fn=retry_on_infrastructure_error, cache_policy=NO_CACHE, persist_result=False)
def register_best(ctx: RecipeContext, reports: dict[str, EvalReport]) -> dict:
    """Rank the evaluated checkpoints, decide the best one's aliases against the run's SFT checkpoint and
    the current champion, and register it as this recipe run's version of the model. `reports` holds
    every evaluated stage (always "sft"); the SFT checkpoint itself is ranked only with
    `pipeline.eval_stages = "all"`."""
    log = get_run_logger()
    cfg = ctx.config()
    store = ctx.store(cfg)
    done = store.load("register")
    if done is not None:
        return done
    if SFT_STAGE not in reports:
        raise ValueError(f"register-best needs the SFT evaluation to decide promotion; got {sorted(reports)}")
    bench = primary_benchmark(cfg.eval)
    ranked = rank_checkpoints({s: r for s, r in reports.items()
                               if s != SFT_STAGE or cfg.pipeline.eval_stages == "all"}, bench)
    stage, best = ranked[0]
    c = tracking.client(cfg)
    written = tracking.written_steps(cfg, ctx.parent_run_id)   # by an attempt that failed later (registering)
    for st, rep in reports.items():  # the eval table on the parent run, one metric per stage x benchmark, once
        for b, p in rep.pass1().items():
            key = tracking.metric_key(f"eval/{st}/{b}/pass@1")
            if key not in written:
                c.log_metric(ctx.parent_run_id, key, p)
    decision = store.load("promotion")  # decided once: a retry must not re-judge against itself as champion
    if decision is None:
        p = decide_promotion(stage, best, reports[SFT_STAGE], champion=registry.champion(cfg), benchmark=bench,
                             confidence=cfg.eval.comparison_confidence, seed=cfg.eval.seed)
        decision = p.to_json()
        store.save("promotion", decision, attempt=ctx.attempt)
    log.info(f"promotion: {decision['line']}")
    c.set_tag(ctx.parent_run_id, "promotion", decision["line"][:5000])
    reg = registry.register(cfg, parent_run_id=ctx.parent_run_id, recipe_run_id=ctx.run_id, stage=stage,
                            report=best, primary_pass1=best.metrics[bench].pass1,
                            aliases=tuple(decision["aliases"]), promotion_line=decision["line"],
                            lineage={"prefect.flow_run_id": ctx.flow_run_id or "",
                                     "mlflow.parent_run_id": ctx.parent_run_id or ""})
    log.info(f"best checkpoint: {stage}; {reg.summary_line()}")
    out = {"registration": {"name": reg.name, "version": reg.version, "aliases": list(reg.aliases),
                            "stage": reg.stage, "checkpoint_url": reg.checkpoint_url,
                            "primary_pass1": reg.primary_pass1, "line": reg.summary_line()},
           "promotion": decision,
           "stages": [{"stage": st, "primary_pass1": rep.metrics[bench].pass1 if bench in rep.metrics else None,
                       "pass1": rep.pass1(), "checkpoint_url": rep.checkpoint_url, "report_url": rep.json_url,
                       **_stage_figures(store, st)}
                      for st, rep in reports.items()],
           "primary_benchmark": bench, "run_id": ctx.run_id, "mlflow_parent_run_id": ctx.parent_run_id,
           "config_digest": ctx.config_digest}
    store.save("register", out, attempt=ctx.attempt)
    return out
