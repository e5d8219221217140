"""Base pieces of the config tree: the error type and the strict section base class."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

REPO_ROOT = Path(__file__).resolve().parents[2]


class ConfigError(ValueError):
    """A profile or override that does not describe a valid config; the message says how to fix it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


AdamBetas = tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]]
"""AdamW (beta1, beta2), each in [0, 1)."""
