"""Flow tests run against Prefect's test harness (a temporary local server, once per session) with the
core stage functions replaced by tests/flows/stage_doubles.py (monkeypatched into tasks/stages.py), each
test in its own state folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import stage_doubles

# Small and fast: threads instead of Ray, no retry delay, short RL stages.
FAST = ["cluster.use_ray=false", "cluster.resources={}", "pipeline.retry_delay_s=0", "rl.stages.0.steps=3",
        "rl.stages.1.steps=2", "rl.stages.2.steps=2"]


@dataclass(frozen=True)
class State:
    path: Path
    overrides: list[str]


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def shared_mlflow(tmp_path_factory):
    """One MLflow SQLite DB for the session (creating one costs seconds of schema migrations)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture
def state(tmp_path, monkeypatch, prefect_harness, shared_mlflow, request) -> State:
    """A fresh RSTAR2_HOME, core stage functions swapped for the doubles, overrides that point at the shared
    MLflow DB with a registered model name of this test's own."""
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path))
    monkeypatch.delenv("RSTAR2_FAULT_INJECT", raising=False)
    stage_doubles.install(monkeypatch)
    model = "rstar2-agent-" + request.node.name.removeprefix("test_")[:30].replace("_", "-")
    return State(tmp_path, FAST + [f"tracking.tracking_uri={shared_mlflow}", f"tracking.registered_model={model}"])
