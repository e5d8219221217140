"""Loading profiles, dotted overrides and readable validation errors."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from rstar2_core.config.base import REPO_ROOT, ConfigError
from rstar2_core.config.pipeline_sections import StorageConfig
from rstar2_core.config.root import Config, resolve_storage_root


def config_dir() -> Path:
    return Path(os.environ.get("RSTAR2_CONFIG_DIR") or REPO_ROOT / "configs")


def available_profiles() -> list[str]:
    return sorted(p.stem for p in config_dir().glob("*.toml"))


def _profile_path(profile: str) -> Path:
    p = Path(profile)
    if p.suffix == ".toml" and p.exists():
        return p
    cand = config_dir() / f"{profile}.toml"
    if not cand.exists():
        raise ConfigError(f"unknown profile {profile!r}: choose one of {available_profiles()} "
                          f"(files in {config_dir()}) or pass a path to a .toml file")
    return cand


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


CUTS = ("micro_batch_size", "max_tokens_per_micro_batch")
"""A section's two ways of cutting micro-batches: an override that sets one replaces the profile's other."""


def apply_override(tree: dict, dotted: str) -> None:
    """Apply one `a.b.0.c=value` override to a raw dict tree in place (value parsed as TOML, else string).
    Setting `rl.`/`sft.` `micro_batch_size` or `max_tokens_per_micro_batch` drops the other from the
    tree: an override picks the section's cut (a profile file that sets both is refused)."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} must look like section.field=value "
                          "(e.g. rl.stages.0.max_response_tokens=4096)")
    key, raw = dotted.split("=", 1)
    parts = key.strip().split(".")
    node: Any = tree
    for i, part in enumerate(parts[:-1]):
        path = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {key}: {path} indexes a list of {len(node)} items; "
                                  f"use an index 0..{len(node) - 1}")
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"override {key}: {path} is a value, not a section")
    last = parts[-1]
    value = _parse_value(raw.strip())
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"override {key}: index {last} out of range for a list of {len(node)} items")
        node[int(last)] = value
    else:
        node[last] = value
        if parts[0] in ("rl", "sft") and len(parts) == 2 and last in CUTS and value is not None:
            node.pop(CUTS[1 - CUTS.index(last)], None)


def _field_doc(loc: tuple) -> str:
    model: Any = Config
    doc = ""
    for part in loc:
        if isinstance(part, int) or not hasattr(model, "model_fields"):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return ""
        doc = field.description or ""
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        model = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            dict_or_list = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            model = dict_or_list[0] if dict_or_list else None
    return " ".join(doc.split())


_UNKNOWN_FIELD = "unknown field; check the spelling against `rstar2 config show`"


def _format_validation_error(err: ValidationError, source: str, prefix: tuple = (), hint: str = "",
                             unknown: str = _UNKNOWN_FIELD) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = prefix + tuple(x for x in e["loc"] if not (isinstance(x, str) and x.startswith("function-after")))
        path = ".".join(str(x) for x in loc) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        got = f" (got {e['input']!r})" if e["type"] not in ("missing",) and not isinstance(e["input"], dict) else ""
        if e["type"] == "extra_forbidden":
            msg = unknown
        doc = _field_doc(loc)
        fix = f"\n    field: {doc}" if doc else ""
        lines.append(f"  {path}: {msg}{got}{fix}")
    if hint:
        lines.append(hint)
    return "\n".join(lines)


def profile_tree(profile: str = "tiny", overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """The raw (unvalidated) tree of `configs/<profile>.toml` (or a .toml path) with dotted overrides."""
    path = _profile_path(profile)
    try:
        tree = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    tree.setdefault("profile", path.stem)
    for o in overrides:
        apply_override(tree, o)
    return tree


def load_config(profile: str = "tiny", overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load `configs/<profile>.toml` (or a .toml path), apply dotted overrides, validate."""
    tree = profile_tree(profile, overrides)
    source = f"profile {tree['profile']}" + (f" with {list(overrides)}" if overrides else "")
    return config_from_dict(tree, source=source)


def profile_storage(profile: str, overrides: list[str] | tuple[str, ...] = ()) -> tuple[str, StorageConfig]:
    """(storage root, `[storage]` section) of a profile, validating only `state_dir` and `[storage]`: where
    a run's store lives even when the rest of the profile no longer validates (a retried run reads its
    config snapshot from there)."""
    tree = profile_tree(profile, overrides)
    source = f"profile {tree['profile']}" + (f" with {list(overrides)}" if overrides else "")
    state_dir = tree.get("state_dir")
    if state_dir is not None and not isinstance(state_dir, str):
        raise ConfigError(f"invalid config ({source}):\n  state_dir: must be a path string "
                          f"(got {state_dir!r})")
    try:
        section = StorageConfig.model_validate(tree.get("storage") or {})
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source, prefix=("storage",))) from None
    return resolve_storage_root(state_dir, section), section


def config_from_dict(tree: dict, source: str = "dict") -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def config_to_toml_dict(cfg: Config) -> dict:
    """Plain JSON-able dict of the resolved config (for printing and MLflow params)."""
    return cfg.model_dump(mode="json")
