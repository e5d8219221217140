"""What every stage task of one recipe run needs to know, passed as one small frozen value.

The context carries the run's frozen config snapshot (its canonical JSON and digest, tasks/run_config.py),
never a profile name: every task, in the flow process or in a Ray worker, and every retry of the run
rebuilds the same validated `Config` from it with `config()` (configuring s3fs from `cfg.storage` on the
way), whatever `configs/<profile>.toml` says by then.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from rstar2_core import storage
from rstar2_core.config import Config, config_from_snapshot
from tasks.run_store import RunStore


@dataclass(frozen=True)
class RecipeContext:
    """run_id keys the run's storage; config_json/config_digest = the run's config snapshot; attempt =
    flow-run attempt (1-based); parent_run_id = the recipe's MLflow parent run; state_dir = the state
    folder the flow resolved when it opened the run (its `$RSTAR2_HOME`): where a snapshot leaves
    `state_dir` unset, `config()` fills it in, so every task, in any process (a Ray worker with another
    environment included), uses the flow's storage root and MLflow store, never one of its own."""

    run_id: str
    config_json: str
    config_digest: str
    attempt: int = 1
    parent_run_id: str | None = None
    flow_run_id: str | None = None
    state_dir: str | None = None

    def config(self) -> Config:
        cfg = config_from_snapshot(json.loads(self.config_json), f"config snapshot of run {self.run_id}",
                                   self.config_digest)
        if cfg.state_dir is None and self.state_dir is not None:
            cfg = cfg.model_copy(update={"state_dir": self.state_dir})
        apply_storage_settings(cfg)
        return cfg

    def store(self, cfg: Config | None = None) -> RunStore:
        cfg = cfg or self.config()
        return RunStore.for_run(cfg.resolved_storage_root(), self.run_id)


def apply_storage_settings(cfg: Config) -> None:
    """Point s3fs at `cfg.storage.s3_endpoint_url`/`s3_region` in this process (left as it is when unset)
    and set the store's outage budget and the machine's cache bound (`storage.outage_retry_s`,
    `storage.node_cache_max_gb`)."""
    if cfg.storage.s3_endpoint_url or cfg.storage.s3_region:
        storage.configure_from(cfg.storage)
    else:
        storage.set_outage_retry_s(cfg.storage.outage_retry_s)
        storage.set_node_cache_max_gb(cfg.storage.node_cache_max_gb)


def stage_label(cfg: Config, stage_index: int) -> str:
    """Run name of an RL stage: `rl-stage-2 (12K, 10 turns)`."""
    st = cfg.rl.stages[stage_index]
    n = st.max_response_tokens
    size = f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else (f"{n / 1000:g}K" if n >= 1000 else str(n))
    return f"{st.name} ({size}, {st.max_turns} turns)"
