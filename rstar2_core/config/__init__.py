"""One typed config tree for the whole recipe, loaded from `configs/<profile>.toml` plus dotted overrides.

Every field carries one docstring: unit, default, the paper's value (RECIPE.md) and the trade-off.
Bounds live on the field; cross-field rules live in validators whose message names the fix.

    cfg = load_config("tiny", ["rl.stages.0.max_response_tokens=4096"])

A bad value raises `ConfigError` whose message names the dotted field path, what was wrong and
what to set instead. Profiles are looked up in `$RSTAR2_CONFIG_DIR` (default: `configs/` at the
repository root); a path to a `.toml` file also works as a profile.
"""


from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, model_validator

from rstar2_core.config.base import REPO_ROOT, ConfigError, _Section
from rstar2_core.config.rl import GRPOConfig, RLConfig, RLStageConfig
from rstar2_core.config.runtime_rules import runtime_problems
from rstar2_core.config.sections import (
    BenchmarkConfig,
    ClusterConfig,
    DataConfig,
    EvalConfig,
    LabelCheckConfig,
    ModelConfig,
    PipelineConfig,
    RolloutConfig,
    SandboxConfig,
    SFTConfig,
    SourceConfig,
    StorageConfig,
    SyntheticConfig,
    TaskResources,
    TinyModelConfig,
    TrackingConfig,
)


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


# loading.py and snapshot.py import Config from this module: imported once it is defined
from rstar2_core.config.loading import (
    apply_override,
    available_profiles,
    config_dir,
    config_from_dict,
    config_to_toml_dict,
    load_config,
    profile_storage,
    profile_tree,
)
from rstar2_core.config.snapshot import (
    SnapshotError,
    canonical_json,
    config_digest,
    config_drift,
    config_from_snapshot,
)

__all__ = [
    "REPO_ROOT",
    "BenchmarkConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "GRPOConfig",
    "LabelCheckConfig",
    "ModelConfig",
    "PipelineConfig",
    "RLConfig",
    "RLStageConfig",
    "RolloutConfig",
    "SFTConfig",
    "SandboxConfig",
    "SnapshotError",
    "SourceConfig",
    "StorageConfig",
    "SyntheticConfig",
    "TaskResources",
    "TinyModelConfig",
    "TrackingConfig",
    "apply_override",
    "available_profiles",
    "canonical_json",
    "config_digest",
    "config_dir",
    "config_drift",
    "config_from_dict",
    "config_from_snapshot",
    "config_to_toml_dict",
    "load_config",
    "profile_storage",
    "profile_tree",
    "resolve_state_dir",
    "resolve_storage_root",
]
