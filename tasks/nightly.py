"""History of nightly evaluations: each night's pass@1 table under `<storage root>/nightly/`, so the next
night compares against the previous one (whatever model was champion then)."""

from __future__ import annotations

import time

from rstar2_core import storage
from rstar2_core.config import Config


def _dir(cfg: Config) -> str:
    return storage.join(cfg.resolved_storage_root(), "nightly")


def previous(cfg: Config) -> dict | None:
    """The most recent recorded nightly result, or None on the first night."""
    fs, path = storage.fs_for(_dir(cfg))
    if not fs.exists(path):
        return None
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False) if p.endswith(".json"))
    return storage.read_json(storage.join(_dir(cfg), names[-1])) if names else None


def record(cfg: Config, result: dict, flow_run_id: str | None) -> str:
    """Store tonight's result (names sort by time); returns its URL."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    url = storage.join(_dir(cfg), f"{stamp}-{(flow_run_id or 'local')[:8]}.json")
    storage.write_json_atomic(url, {**result, "recorded_at": stamp, "flow_run_id": flow_run_id})
    return url
