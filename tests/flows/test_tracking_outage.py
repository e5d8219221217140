"""The MLflow tracking server restarted while a stage logs (issue #44): a real `mlflow server` on SQLite,
stopped by PID and started again on the same port and database. No metric point is lost: points that
meet a stopped server stay buffered and are written once it is back, and the points a stage could not
write before it ended are kept in the run store and written by its retry (no step twice)."""

from __future__ import annotations

import pytest

from rstar2_cli.local_services import MlflowServer
from rstar2_cli.rehearsal_stack import free_port
from rstar2_core.config import load_config
from tasks import tracking
from tasks.retry import is_infrastructure_error

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")     # the client's own retries: seconds, not minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    s = MlflowServer(tmp_path)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _history(cfg, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in tracking.client(cfg).get_metric_history(run_id, key))


def test_a_restart_mid_stage_loses_no_point(server, tmp_path):
    cfg = load_config("tiny", [f'tracking.tracking_uri="{server.uri}"', f'state_dir="{tmp_path / "state"}"'])
    run_id = tracking.start_stage_run(cfg, parent_run_id="", stage="rl-stage-1", params={})
    log = tracking.metrics_logger(cfg, run_id, flush_s=0)          # a write per call
    for step in (1, 2, 3):
        log({"actor/pg_loss": 0.1 * step, "rollout/pass_rate": 0.5}, step)
    server.stop()
    with pytest.warns(UserWarning, match="does not answer"):
        log({"actor/pg_loss": 0.4, "rollout/pass_rate": 0.5}, 4)
    log({"actor/pg_loss": 0.5, "rollout/pass_rate": 0.5}, 5)       # still down: buffered too
    assert log.outages >= 1 and len(log.pending_points()) == 4      # steps 4 and 5, two metrics each
    server.start()                                                 # same port, same database
    log({"actor/pg_loss": 0.6, "rollout/pass_rate": 0.5}, 6)
    assert log.flush() and not log.pending_points()
    for key in ("actor/pg_loss", "rollout/pass_rate"):
        assert _history(cfg, run_id, key) == [1, 2, 3, 4, 5, 6]


def test_points_a_stage_could_not_write_are_written_by_its_retry(server, tmp_path, monkeypatch):
    """tasks/stages.py `_run_tracked` with the stage doubles (no Prefect server): the server goes away while
    curation runs, the stage's last flush meets the outage, the task raises TrackingUnavailable (retryable)
    with the points and the stage's result kept in the run store; its retry, with the server back, writes
    them before anything else, logs no step twice, and records the kept result without computing it again."""
    import logging

    import stage_doubles

    from rstar2_core import storage
    from tasks import recipe, stages

    logger = logging.getLogger("test-tracking-outage")
    monkeypatch.setattr(recipe, "get_run_logger", lambda: logger)
    monkeypatch.setattr(stages, "get_run_logger", lambda: logger)
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path))
    stage_doubles.install(monkeypatch)
    ctx = recipe.open_recipe("tiny", [f'tracking.tracking_uri="{server.uri}"', "cluster.use_ray=false",
                                      "cluster.resources={}"], "outage-run", "flow-1", attempt=1)
    cfg = ctx.config()

    def curate_through_an_outage(cfg, out_url, log_metrics=None, *, sampler=None):
        log_metrics({"data/kept": 1.0}, 0)
        assert log_metrics.flush()                 # step 0 reached the server
        server.stop()
        log_metrics({"data/kept": 2.0}, 1)         # buffered: the server is away
        return stage_doubles.curate(cfg, out_url, None, sampler=sampler)

    monkeypatch.setattr(stages, "curate", curate_through_an_outage)
    with pytest.warns(UserWarning, match="does not answer"), pytest.raises(tracking.TrackingUnavailable) as err:
        stages.curate_data.fn(ctx, label="curate")
    assert is_infrastructure_error(err.value)      # Prefect retries the task
    unsent = ctx.store(cfg).url("state", "unsent-metrics", "curate.json")
    assert [p["step"] for p in storage.read_json(unsent)] == [1]
    server.start()

    def curate_again(cfg, out_url, log_metrics=None, *, sampler=None):
        raise AssertionError("the retry computed the stage again instead of logging the result it kept")

    store = ctx.store(cfg)
    kept = store.load("curate", untracked=True)
    assert kept is not None and store.load("curate") is None   # computed, not done: MLflow lacks its end
    monkeypatch.setattr(stages, "curate", curate_again)
    assert stages.curate_data.fn(ctx, label="curate") == kept
    assert store.load("curate") == kept and store.load("curate", untracked=True) is None
    run_id = store.tracking_id("curate")
    assert tracking.metric_steps(cfg, run_id, "data/kept") == [0, 1]             # each step once
    assert [m.value for m in sorted(tracking.client(cfg).get_metric_history(run_id, "data/kept"),
                                    key=lambda m: m.step)] == [1.0, 2.0]
    assert not storage.exists(unsent)


def test_an_mlflow_call_that_cannot_reach_its_server_is_retryable(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = load_config("tiny", [f'tracking.tracking_uri="http://127.0.0.1:{free_port()}"',
                               f'state_dir="{tmp_path / "state"}"'])
    with pytest.raises(Exception) as err:
        tracking.client(cfg).get_run("0" * 32)
    assert tracking.unreachable(err.value) and is_infrastructure_error(err.value), repr(err.value)
