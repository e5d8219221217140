"""The stage tasks' metrics callback: buffered, written at most every flush_s seconds and on flush()."""

from __future__ import annotations

from rstar2_core.config import load_config
from tasks import tracking


def test_metrics_are_buffered_then_written_in_batches(shared_mlflow, tmp_path, monkeypatch):
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path))
    cfg = load_config("tiny", [f"tracking.tracking_uri={shared_mlflow}"])
    c = tracking.client(cfg)
    run_id = c.create_run(tracking.experiment_id(cfg)).info.run_id
    calls = []
    log = tracking.metrics_logger(cfg, run_id, flush_s=3600.0)
    real = log._client.log_batch
    monkeypatch.setattr(log._client, "log_batch", lambda rid, metrics: (calls.append(len(metrics)), real(rid, metrics)))

    for step in range(1, 401):                          # 3 numeric metrics a step; the text and the flag are skipped
        log({"sft/loss": 1.0 / step, "sft/lr": 3e-3, "sft/tokens": step, "note": "x", "done": True}, step)
    assert calls == [] and tracking.metric_steps(cfg, run_id, "sft/loss") == []
    log.flush()
    assert calls == [1000, 200]                         # MLflow takes at most 1,000 metrics per call
    assert tracking.metric_steps(cfg, run_id, "sft/loss") == list(range(1, 401))
    assert set(c.get_run(run_id).data.metrics) == {"sft/loss", "sft/lr", "sft/tokens"}

    eager = tracking.metrics_logger(cfg, run_id, flush_s=0.0)     # flush_s = 0: a write per call
    eager({"sft/loss": 0.5}, 401)
    assert tracking.metric_steps(cfg, run_id, "sft/loss")[-1] == 401


def test_a_retry_keeps_the_points_an_earlier_attempt_wrote_and_adds_the_rest(shared_mlflow, tmp_path, monkeypatch):
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path))
    cfg = load_config("tiny", [f"tracking.tracking_uri={shared_mlflow}"])
    run_id = tracking.client(cfg).create_run(tracking.experiment_id(cfg)).info.run_id
    first = tracking.metrics_logger(cfg, run_id, flush_s=0.0)
    for step in (1, 2, 3):
        first({"actor/pg_loss": 1.0 / step, "actor/lr": 1e-6}, step)
    first({"actor/pg_loss": 0.2}, 4)                   # the attempt fails after step 4's loss
    written = tracking.written_steps(cfg, run_id)
    assert written == {"actor/pg_loss": 4, "actor/lr": 3}
    retry = tracking.metrics_logger(cfg, run_id, flush_s=3600.0, written=written)
    for step in (3, 4, 5):                              # resumed from a checkpoint at step 2
        retry({"actor/pg_loss": 9.0, "actor/lr": 1e-6}, step)
    retry.flush()
    assert tracking.metric_steps(cfg, run_id, "actor/pg_loss") == [1, 2, 3, 4, 5]
    assert tracking.metric_steps(cfg, run_id, "actor/lr") == [1, 2, 3, 4, 5]
    history = {m.step: m.value for m in tracking.client(cfg).get_metric_history(run_id, "actor/pg_loss")}
    assert history[3] == 1.0 / 3 and history[5] == 9.0  # the first attempt's points stay
