"""The MLflow tracking server restarted while a stage logs (issue #44): a real `mlflow server` on SQLite,
stopped by PID and started again on the same port and database. No metric point is lost: points that
meet a stopped server stay buffered and are written once it is back, and the points a stage could not
write before it ended are kept in the run store and written by its retry (no step twice)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rstar2_cli.rehearsal_stack import free_port, wait_http
from rstar2_core.config import load_config
from tasks import tracking
from tasks.retry import is_infrastructure_error

pytestmark = pytest.mark.slow


class MlflowServer:
    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.root / "mlflow.log", "ab") as log:      # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                 str(self.port), "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
                 "--default-artifact-root", (self.root / "artifacts").as_uri()],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
        wait_http(f"{self.uri}/health", "MLflow tracking server", 180, self.proc, self.root / "mlflow.log")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


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


def test_points_a_stage_could_not_write_are_written_by_its_retry(server, tmp_path):
    from rstar2_core import storage

    cfg = load_config("tiny", [f'tracking.tracking_uri="{server.uri}"', f'state_dir="{tmp_path / "state"}"'])
    run_id = tracking.start_stage_run(cfg, parent_run_id="", stage="sft", params={})
    log = tracking.metrics_logger(cfg, run_id, flush_s=3600)       # buffered to the end, as a short stage is
    for step in (1, 2, 3):
        log({"sft/loss": 1.0 / step}, step)
    server.stop()
    with pytest.warns(UserWarning):
        assert not log.flush()                                     # the stage's last flush meets the outage
    unsent = (tmp_path / "unsent" / "sft.json").as_uri()
    tracking.save_points(unsent, log.pending_points())             # what tasks/stages.py does before raising
    err = tracking.TrackingUnavailable("sft: the MLflow server did not take the stage's last 3 metric points")
    assert is_infrastructure_error(err)
    server.start()
    assert tracking.replay_points(cfg, run_id, unsent) == 3 and not storage.exists(unsent)
    assert tracking.written_steps(cfg, run_id) == {"sft/loss": 3}  # the retry logs no step twice
    assert _history(cfg, run_id, "sft/loss") == [1, 2, 3]


def test_an_mlflow_call_that_cannot_reach_its_server_is_retryable(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = load_config("tiny", [f'tracking.tracking_uri="http://127.0.0.1:{free_port()}"',
                               f'state_dir="{tmp_path / "state"}"'])
    with pytest.raises(Exception) as err:
        tracking.client(cfg).get_run("0" * 32)
    assert tracking.unreachable(err.value) and is_infrastructure_error(err.value), repr(err.value)
