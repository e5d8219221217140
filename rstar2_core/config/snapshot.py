"""A recipe run's frozen config: the resolved tree (profile + overrides, every default filled) as canonical
JSON with its sha256 digest, and the way back to a validated `Config` (`config_from_snapshot`).

The pipeline writes one snapshot when a run opens (tasks/run_config.py); every task and every retry of
the run reads it instead of the profile, and `config_drift` lists what the profile on disk changes.

Invariant: nothing is dropped silently. A snapshot this code no longer validates (a field renamed or
removed) raises `SnapshotError` naming the field; fields it lacks take the code's defaults and
`snapshot_gaps` lists them. A snapshot is JSON, never a pickle, so config classes may move between
modules. See docs/pipeline.md, "What a retry runs", and docs/CONTRACTS.md, "config".
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import ValidationError

from rstar2_core.config.base import ConfigError
from rstar2_core.config.loading import _format_validation_error
from rstar2_core.config.root import Config


class SnapshotError(ConfigError):
    """A config snapshot that is corrupted or does not validate with this code; the message names why."""


def canonical_json(tree: Any) -> str:
    """Key-sorted, compact JSON (the form the digest is taken over); NaN/inf are refused."""
    return json.dumps(tree, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def config_digest(tree: dict) -> str:
    return hashlib.sha256(canonical_json(tree).encode("utf-8")).hexdigest()


def config_from_snapshot(tree: dict, source: str, digest: str | None = None) -> Config:
    """Validate a snapshot tree into a `Config` (checked against `digest` when given)."""
    if digest is not None and config_digest(tree) != digest:
        raise SnapshotError(f"{source}: the config snapshot does not match its digest {digest[:12]}: it was "
                            "edited or corrupted after it was written; start a new run")
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        hint = ("  This snapshot was written by another version of the code; the fields above are how it "
                "differs. Retry with the code that started the run, or start a new run.")
        unknown = "not a field of this version of the code (removed or renamed since the snapshot was written)"
        raise SnapshotError(_format_validation_error(e, source, hint=hint, unknown=unknown)) from None


def flatten_tree(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"rl": {"stages": [{"steps": 6}]}} -> {"rl.stages.0.steps": 6}; a list of scalars stays one value."""
    out: dict[str, Any] = {}
    if isinstance(tree, dict) and tree:
        for k, v in tree.items():
            out.update(flatten_tree(v, f"{prefix}{k}."))
    elif isinstance(tree, (list, tuple)) and tree and any(isinstance(x, (dict, list)) for x in tree):
        for i, v in enumerate(tree):
            out.update(flatten_tree(v, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".")] = tree
    return out


_ABSENT = object()


def config_drift(snapshot: dict, current: dict) -> list[str]:
    """`field: <snapshot value> (run) vs <current value> (now)` for every dotted field that differs."""
    def show(v: Any) -> str:
        return "absent" if v is _ABSENT else json.dumps(v)

    a, b = flatten_tree(snapshot), flatten_tree(current)
    return [f"{key}: {show(a.get(key, _ABSENT))} (run) vs {show(b.get(key, _ABSENT))} (now)"
            for key in sorted(set(a) | set(b)) if a.get(key, _ABSENT) != b.get(key, _ABSENT)]


def snapshot_gaps(tree: dict, cfg: Config) -> list[str]:
    """Dotted fields that `cfg` has and the snapshot `tree` lacks (filled with this code's defaults)."""
    have = flatten_tree(tree)
    return sorted(k for k in flatten_tree(cfg.model_dump(mode="json")) if k not in have)
