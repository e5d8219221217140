"""The nightly history (tasks/nightly.py): which night tonight is compared with, also when the flow run is
retried (the UI's Retry reruns the same flow run id after its first attempt recorded and then failed)."""

from __future__ import annotations

import time

import pytest
import stage_doubles

from rstar2_core import storage
from rstar2_core.config import load_config
from tasks import nightly


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    clock = iter(range(1_800_000_000, 1_800_001_000, 60))  # each record a minute after the last
    real = time.gmtime
    monkeypatch.setattr(nightly.time, "gmtime", lambda *a: real(*a) if a else real(next(clock)))
    return load_config("tiny", [f"storage.root={tmp_path.as_uri()}"])


def _night(cfg, name: str, quality: float) -> tuple[dict, object]:
    rep = stage_doubles.fixed_report("file:///ckpt", quality, ["synthetic"],
                                     storage.join(cfg.resolved_storage_root(), name))
    return {"model": "champion", "version": "1", "report_url": rep.json_url}, rep


def test_a_retried_nightly_still_compares_with_the_night_before(cfg):
    res1, _ = _night(cfg, "night1", 0.5)
    nightly.record(cfg, res1, "run-night-1")
    res2, tonight = _night(cfg, "night2", 0.1)  # a regression: 10 of 20 solved -> 2
    first = nightly.compare_with_previous(cfg, "champion", "1", tonight, "run-night-2")
    url = nightly.record(cfg, res2, "run-night-2")
    assert first.regressions == ["synthetic"]
    # the Retry of the same flow run: tonight's own record must not become "the previous night"
    again = nightly.compare_with_previous(cfg, "champion", "1", tonight, "run-night-2")
    assert again.regressions == ["synthetic"] and again.rows[0]["previous"] == 0.5
    assert nightly.record(cfg, res2, "run-night-2") == url  # one record per flow run, kept in its place
    assert len(nightly._records(cfg)) == 2
    # the next night compares with tonight's (regressed) result
    assert nightly.previous(cfg, "run-night-3")["report_url"] == res2["report_url"]
    assert nightly.previous(cfg, "run-night-2")["report_url"] == res1["report_url"]


def test_the_first_night_stays_the_first_on_a_retry(cfg):
    res, tonight = _night(cfg, "night1", 0.5)
    assert nightly.previous(cfg, "run-1") is None
    nightly.record(cfg, res, "run-1")
    retry = nightly.compare_with_previous(cfg, "champion", "1", tonight, "run-1")
    assert "first night" in retry.markdown and retry.regressions == []


def test_a_night_measured_another_way_is_reported_as_not_compared_not_as_a_regression_or_ok(cfg):
    from dataclasses import replace

    res1, _ = _night(cfg, "night1", 0.5)
    nightly.record(cfg, res1, "run-night-1")
    _, tonight = _night(cfg, "night2", 0.1)  # would be a regression under the same protocol...
    tonight = replace(tonight, protocol={**tonight.protocol, "k": 8})  # ...but sampled with k=8, not 4
    night = nightly.compare_with_previous(cfg, "champion", "1", tonight, "run-night-2")
    assert night.regressions == [] and night.incomparable == ["synthetic"]
    assert night.rows[0]["verdict"] == "incomparable" and night.rows[0]["differs"] == ["k: 8 vs 4"]
    assert "synthetic not compared, the previous night measured them another way (k: 8 vs 4)" in night.markdown
    assert "| not comparable (k: 8 vs 4) |" in night.markdown and "| ok |" not in night.markdown
    # benchmark content edited between the nights: the same
    edited = replace(_night(cfg, "night3", 0.1)[1], benchmark_digests={"synthetic": "e" * 64})
    night = nightly.compare_with_previous(cfg, "champion", "1", edited, "run-night-3")
    assert night.regressions == [] and "synthetic content: digest eeeeeeeeeeee vs dddddddddddd" in night.markdown
