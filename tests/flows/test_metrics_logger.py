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


def test_before_the_stage_ends_only_steps_up_to_its_last_checkpoint_are_written(shared_mlflow, tmp_path, monkeypatch):
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path))
    cfg = load_config("tiny", [f"tracking.tracking_uri={shared_mlflow}"])
    run_id = tracking.client(cfg).create_run(tracking.experiment_id(cfg)).info.run_id
    last_ckpt = {"step": None}
    log = tracking.metrics_logger(cfg, run_id, flush_s=0.0, resumed_through=lambda: last_ckpt["step"])
    for step in (1, 2):
        log({"actor/pg_loss": 1.0 / step}, step)
    assert tracking.metric_steps(cfg, run_id, "actor/pg_loss") == []  # no checkpoint: a retry starts over
    last_ckpt["step"] = 2
    log({"actor/pg_loss": 0.3}, 3)
    assert tracking.metric_steps(cfg, run_id, "actor/pg_loss") == [1, 2]
    log({"actor/pg_loss": 0.25}, 4)
    assert log.fail() == {3: {"actor/pg_loss": 0.3}, 4: {"actor/pg_loss": 0.25}}  # the retry logs them again
    assert tracking.metric_steps(cfg, run_id, "actor/pg_loss") == [1, 2]
    log({"actor/pg_loss": 0.2}, 3)
    log.flush()  # the stage finished: everything
    assert tracking.metric_steps(cfg, run_id, "actor/pg_loss") == [1, 2, 3]
