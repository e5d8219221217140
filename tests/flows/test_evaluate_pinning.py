"""The evaluate flows resolve their model once per flow run: a retry evaluates what the first attempt
resolved, even after the alias moved (tasks/registry.py `resolve_pinned`)."""

from __future__ import annotations

import logging

from tasks import recipe, registry


def test_a_retry_evaluates_the_model_the_first_attempt_resolved(tmp_path, monkeypatch, shared_mlflow):
    logger = logging.getLogger("test-evaluate-pinning")
    monkeypatch.setattr(recipe, "get_run_logger", lambda: logger)
    monkeypatch.setattr(registry, "get_run_logger", lambda: logger)
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path))
    overrides = [f"tracking.tracking_uri={shared_mlflow}", "cluster.use_ray=false", "cluster.resources={}"]
    champion = {"url": "file:///models/v3", "version": "3"}
    monkeypatch.setattr(registry, "resolve_model", lambda cfg, model: (champion["url"], champion["version"]))
    first = recipe.open_recipe("tiny", overrides, None, "flow-ev", attempt=1, kind="evaluate")
    assert registry.resolve_pinned(first, "champion") == ("file:///models/v3", "3")
    champion.update(url="file:///models/v4", version="4")      # promoted between the attempts
    retry = recipe.open_recipe("tiny", overrides, None, "flow-ev", attempt=2, kind="evaluate")
    assert registry.resolve_pinned(retry, "champion") == ("file:///models/v3", "3")
    fresh = recipe.open_recipe("tiny", overrides, None, "flow-ev2", attempt=1, kind="evaluate")
    assert registry.resolve_pinned(fresh, "champion") == ("file:///models/v4", "4")   # a new run sees the move
