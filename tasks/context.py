"""What every stage task of one recipe run needs to know, passed as one small frozen value.

Tasks may run in another process (a Ray worker) than the flow, so the context carries the profile and
overrides (not a live config object) and `config()` rebuilds and validates the same config there,
configuring s3fs from `cfg.storage` on the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rstar2_core import storage
from rstar2_core.config import Config, load_config
from tasks.run_store import RunStore


@dataclass(frozen=True)
class RecipeContext:
    """profile + overrides -> the config; run_id keys the run's storage; attempt = flow-run attempt (1-based);
    parent_run_id = the recipe's MLflow parent run."""

    profile: str
    overrides: tuple[str, ...] = ()
    run_id: str = ""
    attempt: int = 1
    parent_run_id: str | None = None
    flow_run_id: str | None = None
    labels: dict = field(default_factory=dict)

    def config(self) -> Config:
        cfg = load_config(self.profile, list(self.overrides))
        apply_storage_settings(cfg)
        return cfg

    def store(self, cfg: Config | None = None) -> RunStore:
        cfg = cfg or self.config()
        return RunStore.for_run(cfg.resolved_storage_root(), self.run_id)


def apply_storage_settings(cfg: Config) -> None:
    """Point s3fs at `cfg.storage.s3_endpoint_url`/`s3_region` in this process (no-op when unset)."""
    if cfg.storage.s3_endpoint_url or cfg.storage.s3_region:
        storage.configure_s3(endpoint_url=cfg.storage.s3_endpoint_url, region=cfg.storage.s3_region)


def stage_label(cfg: Config, stage_index: int) -> str:
    """Run name of an RL stage: `rl-stage-2 (12K, 10 turns)`."""
    st = cfg.rl.stages[stage_index]
    n = st.max_response_tokens
    size = f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else (f"{n / 1000:g}K" if n >= 1000 else str(n))
    return f"{st.name} ({size}, {st.max_turns} turns)"
