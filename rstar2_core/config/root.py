"""The root of the config tree (`Config`: one field per section) and where its state and artifacts live."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, model_validator

from rstar2_core.config.base import REPO_ROOT, _Section
from rstar2_core.config.pipeline_sections import (
    ClusterConfig,
    EvalConfig,
    PipelineConfig,
    StorageConfig,
    TrackingConfig,
)
from rstar2_core.config.rl import RLConfig
from rstar2_core.config.rollout_sections import RolloutConfig, SandboxConfig
from rstar2_core.config.runtime_rules import runtime_problems
from rstar2_core.config.sections import DataConfig, ModelConfig, SFTConfig


# ---------------------------------------------------------------------------------------------- root
class Config(_Section):
    profile: str = "custom"
    """Name of the profile this config was loaded from."""
    seed: int = 0
    """Global seed."""
    state_dir: str | None = None
    """Local state folder (caches, Prefect home, MLflow DB, artifacts, Ray temp); default
    $RSTAR2_HOME or <repo>/.rstar2."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rl: RLConfig
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Orchestration settings of the Prefect pipeline (retries, which checkpoints are ranked)."""

    @model_validator(mode="after")
    def _cross(self) -> Config:
        g = self.rl.grpo
        if g.resample == "none" and g.oversample != 1:
            raise ValueError("rl.grpo.resample = \"none\" (plain GRPO) keeps every rollout; set "
                             "rl.grpo.oversample = 1 or use resample = \"roc\"")
        if self.cluster.layout == "separate" and self.cluster.gpus_per_node:
            total = self.cluster.nodes * self.cluster.gpus_per_node
            if not 0 < self.cluster.trainer_gpus < total:
                raise ValueError(f"cluster.layout = \"separate\" needs 0 < cluster.trainer_gpus < {total} "
                                 "(the rest go to engines)")
        problems = runtime_problems(self)
        if problems:
            raise ValueError("settings the chosen runtime would not honour:\n    - " + "\n    - ".join(problems))
        return self

    # resolved locations -------------------------------------------------------------------------
    def resolved_state_dir(self) -> Path:
        return resolve_state_dir(self.state_dir)

    def resolved_storage_root(self) -> str:
        return resolve_storage_root(self.state_dir, self.storage)

    def resolved_tracking_uri(self) -> str:
        return self.tracking.tracking_uri or f"sqlite:///{self.resolved_state_dir() / 'mlflow.db'}"


def resolve_state_dir(state_dir: str | None) -> Path:
    """`state_dir`, else $RSTAR2_HOME, else <repo>/.rstar2 (resolved in the calling process)."""
    return Path(state_dir or os.environ.get("RSTAR2_HOME") or REPO_ROOT / ".rstar2").resolve()


def resolve_storage_root(state_dir: str | None, storage: StorageConfig) -> str:
    """`storage.root`, else file://<state dir>/artifacts."""
    return storage.root or (resolve_state_dir(state_dir) / "artifacts").as_uri()
