"""The run's frozen config: written once to the run's store when a recipe run opens, read back by every
task and every retry of the run (docs/pipeline.md, "What a retry runs").

    store = locate_store(profile, overrides, run_id)   # where the run keeps its state
    rc = read_snapshot(store)                          # None on the first attempt
    rc = rc or write_snapshot(store, load_config(profile, overrides), profile, overrides)
    rc.config, rc.digest, rc.tree                      # the Config every task of the run uses

Invariant: the store is found from the profile's `state_dir` and `[storage]` only (`profile_storage`), so
a retry finds its snapshot even when the rest of the profile was edited into something invalid.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rstar2_core import storage
from rstar2_core.config import (
    Config,
    ConfigError,
    config_digest,
    config_drift,
    config_from_snapshot,
    load_config,
    profile_storage,
)
from rstar2_core.config.snapshot import canonical_json, snapshot_gaps
from tasks.run_store import RunStore
from tasks.tracking import git_sha

FORMAT = 1


@dataclass(frozen=True)
class RunConfig:
    """A run's config snapshot: the validated `config`, its JSON `tree`, `digest` and the stored `record`."""

    config: Config
    tree: dict
    digest: str
    record: dict

    @property
    def json(self) -> str:
        return canonical_json(self.tree)


def locate_store(profile: str, overrides: list[str] | tuple[str, ...], run_id: str) -> RunStore:
    """The run's store under the profile's storage root (s3fs configured from its `[storage]`)."""
    root, section = profile_storage(profile, overrides)
    if section.s3_endpoint_url or section.s3_region:
        storage.configure_from(section)
    return RunStore.for_run(root, run_id)


def _validated(store: RunStore, record: dict) -> RunConfig:
    source = f"config snapshot of run {store.run_id} ({store.config_url()})"
    missing = sorted({"config", "digest"} - set(record))
    if missing:
        raise ConfigError(f"{source} lacks {missing}: it was not written by tasks/run_config.py; start a new run")
    cfg = config_from_snapshot(record["config"], source, record["digest"])
    return RunConfig(config=cfg, tree=record["config"], digest=record["digest"], record=record)


def read_snapshot(store: RunStore) -> RunConfig | None:
    """The run's snapshot, validated by this code's config models (SnapshotError names a field that no
    longer validates), or None when the run has none yet."""
    record = store.read_config_snapshot()
    return None if record is None else _validated(store, record)


def write_snapshot(store: RunStore, cfg: Config, profile: str, overrides: list[str] | tuple[str, ...]) -> RunConfig:
    """Freeze `cfg` as the run's config (a snapshot already there wins: it is written once)."""
    tree = cfg.model_dump(mode="json")
    record = {"format": FORMAT, "run_id": store.run_id, "profile": profile, "overrides": list(overrides),
              "digest": config_digest(tree), "git_sha": git_sha(),
              "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "config": tree}
    return _validated(store, store.write_config_snapshot(record))


def drift_notes(rc: RunConfig, profile: str, overrides: list[str] | tuple[str, ...]) -> list[str]:
    """What differs from the run's snapshot now: the profile on disk (field by field, or why it no longer
    validates), the code's git SHA, fields the snapshot lacks (they take this code's defaults)."""
    notes = []
    try:
        now = load_config(profile, overrides).model_dump(mode="json")
    except ConfigError as e:
        notes.append(f"profile {profile!r} on disk no longer validates ({' '.join(str(e).split())})")
    else:
        changed = config_drift(rc.tree, now)
        if changed:
            notes.append(f"profile {profile!r} on disk differs from the run's snapshot: " + "; ".join(changed))
    sha = rc.record.get("git_sha")
    if sha and sha != git_sha():
        notes.append(f"code changed since the snapshot was written: {sha[:12]} -> {git_sha()[:12]}")
    gaps = snapshot_gaps(rc.tree, rc.config)
    if gaps:
        notes.append(f"fields absent from the snapshot take this code's defaults: {', '.join(gaps)}")
    return notes
