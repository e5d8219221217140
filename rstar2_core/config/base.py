"""Base pieces of the config tree: the error type and the strict section base class."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

REPO_ROOT = Path(__file__).resolve().parents[2]


class ConfigError(ValueError):
    """A profile or override that does not describe a valid config; the message says how to fix it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


AdamBetas = tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]]
"""AdamW (beta1, beta2), each in [0, 1)."""


def default_micro_batch_count(data: Any, count: int = 8) -> Any:
    """A section's raw input with `micro_batch_size` = `count` where neither it nor
    `max_tokens_per_micro_batch` is set (a config cuts micro-batches one way; a snapshot keeps the other None)."""
    if isinstance(data, dict) and data.get("micro_batch_size") is None and data.get("max_tokens_per_micro_batch") is None:
        return {**data, "micro_batch_size": count}
    return data


def check_one_cut(section: str, micro_batch_size: int | None, max_tokens: int | None) -> None:
    """Refuse a section that sets both ways of cutting micro-batches."""
    if micro_batch_size is not None and max_tokens is not None:
        raise ValueError(f"{section}.micro_batch_size and {section}.max_tokens_per_micro_batch both cut "
                         "micro-batches; keep one in the profile (an override of either replaces the other)")
