"""open_recipe on a retry (attempt > 1): it runs the run's frozen snapshot; without one it starts afresh
only when the store records that the earlier attempt failed before freezing the config, and otherwise
fails naming where it looked and the fix (the snapshot is in another RSTAR2_HOME / storage root)."""

from __future__ import annotations

import logging

import pytest

from rstar2_core.config import SnapshotError
from tasks import recipe
from tasks.run_config import locate_store


@pytest.fixture
def opened(tmp_path, monkeypatch, shared_mlflow):
    monkeypatch.setattr(recipe, "get_run_logger", lambda: logging.getLogger("test-open-recipe"))
    overrides = [f"tracking.tracking_uri={shared_mlflow}", "cluster.use_ray=false", "cluster.resources={}"]

    def home(name: str):
        monkeypatch.setenv("RSTAR2_HOME", str(tmp_path / name))
        return locate_store("tiny", overrides, "run-1")

    return home, overrides


def test_a_retry_that_cannot_find_the_snapshot_fails_naming_the_path_and_the_fix(opened):
    home, overrides = opened
    first = home("home-a")
    ctx = recipe.open_recipe("tiny", overrides, "run-1", "flow-1", attempt=1)
    assert first.read_config_snapshot()["digest"] == ctx.config_digest
    other = home("home-b")  # the retry's worker resolves another RSTAR2_HOME
    with pytest.raises(SnapshotError) as e:
        recipe.open_recipe("tiny", overrides, "run-1", "flow-1", attempt=2)
    msg = str(e.value)
    assert other.config_url() in msg and "same RSTAR2_HOME" in msg and "start a new run" in msg
    assert other.read_config_snapshot() is None and other.tracking_id("parent") is None  # nothing started
    home("home-a")  # back in the first attempt's store: the retry runs its snapshot
    again = recipe.open_recipe("tiny", overrides, "run-1", "flow-1", attempt=2)
    assert again.config_digest == ctx.config_digest and again.parent_run_id == ctx.parent_run_id


def test_a_retry_after_a_first_attempt_that_failed_before_its_snapshot_starts_afresh(opened, tmp_path):
    home, overrides = opened
    store = home("home-a")
    data = tmp_path / "later.jsonl"
    bad = overrides + [f'data.sources=[{{url="{data}", layout="generic", name="g"}}]']
    with pytest.raises(Exception, match="does not exist"):
        recipe.open_recipe("tiny", bad, "run-1", "flow-1", attempt=1)
    assert store.read_config_snapshot() is None and store.open_failure()["attempt"] == 1
    data.write_text('{"id": "a", "problem": "1+1", "answer": "2"}\n')  # the fix, then the UI's Retry
    ctx = recipe.open_recipe("tiny", bad, "run-1", "flow-1", attempt=2)
    assert store.read_config_snapshot()["digest"] == ctx.config_digest


def test_tasks_use_the_flows_state_folder_whatever_their_own_environment(opened, monkeypatch, tmp_path):
    home, overrides = opened
    first = home("home-a")
    ctx = recipe.open_recipe("tiny", overrides, "run-1", "flow-1", attempt=1)
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path / "home-b"))   # a Ray worker started with another home
    cfg = ctx.config()
    assert cfg.resolved_storage_root() == (tmp_path / "home-a" / "artifacts").as_uri()
    assert ctx.store(cfg).root == first.root
    assert ctx.config_digest == first.read_config_snapshot()["digest"]     # the snapshot itself is unchanged


def test_closing_a_cancelled_run_ends_the_stage_runs_it_left_running(opened):
    """A Cancel ends the flow process under its stage threads, which never reach their own `finish`:
    `close_recipe(..., "KILLED")` (flows.flow_process.on_cancel) ends the parent run and every stage run
    still RUNNING under it; a stage that had finished keeps FINISHED."""
    from tasks import tracking

    home, overrides = opened
    home("home-a")
    ctx = recipe.open_recipe("tiny", overrides, "run-1", "flow-1", attempt=1)
    cfg = ctx.config()
    done = tracking.start_stage_run(cfg, parent_run_id=ctx.parent_run_id, stage="sft", params={})
    tracking.finish(cfg, done)
    live = tracking.start_stage_run(cfg, parent_run_id=ctx.parent_run_id, stage="rl-stage-1", params={})
    other = recipe.open_recipe("tiny", overrides, "run-2", "flow-2", attempt=1)   # another run's stage
    elsewhere = tracking.start_stage_run(cfg, parent_run_id=other.parent_run_id, stage="sft", params={})
    recipe.close_recipe("tiny", overrides, "run-1", "KILLED")
    status = {r: tracking.client(cfg).get_run(r).info.status for r in (ctx.parent_run_id, done, live, elsewhere)}
    assert status == {ctx.parent_run_id: "KILLED", done: "FINISHED", live: "KILLED", elsewhere: "RUNNING"}
