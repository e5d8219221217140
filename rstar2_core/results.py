"""Results that cross the boundary between a recipe stage (rstar2_core) and the pipeline (tasks/flows).

See docs/CONTRACTS.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class DatasetRef:
    """A published dataset: parquet/JSONL at `url`, `digest` = sha256 of its content, `n_rows` rows."""

    url: str
    digest: str
    n_rows: int
    manifest_url: str | None = None
    counts: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StageResult:
    """A finished stage: its final checkpoint (an HF folder URL with a _COMPLETE marker), final metrics,
    steps run, and stage-specific extras (e.g. the tracking run id stored in RL checkpoints)."""

    name: str
    checkpoint_url: str
    metrics: dict = field(default_factory=dict)
    steps: int = 0
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)
