"""Base pieces of the config tree: the error type and the strict section base class."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

REPO_ROOT = Path(__file__).resolve().parents[2]


class ConfigError(ValueError):
    """A profile or override that does not describe a valid config; the message says how to fix it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


