"""One typed config tree for the whole recipe, loaded from `configs/<profile>.toml` plus dotted overrides.

    cfg = load_config("tiny", ["rl.stages.0.max_response_tokens=4096"])

Every field carries one docstring: unit, default, the paper's value and the trade-off. Bounds live on
the field; cross-field rules live in validators whose message names the fix, so a bad value raises
`ConfigError` naming the dotted field path, what was wrong and what to set instead. Profiles are looked
up in `$RSTAR2_CONFIG_DIR` (default: `configs/` at the repository root); a path to a `.toml` file also
works as a profile. Which module holds which section: docs/CONTRACTS.md, "config".
"""


from __future__ import annotations

from rstar2_core.config.base import REPO_ROOT, ConfigError
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
from rstar2_core.config.pipeline_sections import (
    BenchmarkConfig,
    ClusterConfig,
    EvalConfig,
    PipelineConfig,
    StorageConfig,
    TaskResources,
    TrackingConfig,
)
from rstar2_core.config.rl import GRPOConfig, RLConfig, RLStageConfig
from rstar2_core.config.rollout_sections import RolloutConfig, SandboxConfig, ToolServiceConfig
from rstar2_core.config.root import Config, resolve_state_dir, resolve_storage_root
from rstar2_core.config.sections import (
    DataConfig,
    LabelCheckConfig,
    ModelConfig,
    SFTConfig,
    SourceConfig,
    SyntheticConfig,
    TinyModelConfig,
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
    "ToolServiceConfig",
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
