"""What a runtime is built from: typed specs that `open_runtime` resolves from the `Config` once.

    spec = RuntimeSpec.from_config(cfg, policy_url=url, max_model_len=n, trainer=TrainerSpec(...))

Below `open_runtime` nothing reads the root config: the local and the Ray runtime, their trainers,
engines, sandbox and weight sync each take their part of a `RuntimeSpec`, and the Ray layout is computed
here from the config's sections (`layout_for`). Invariant: a spec is complete and frozen when a runtime
starts, so a retried stage's runtime is built from exactly what its frozen config snapshot says
(tests/unit/runtime/test_specs.py). The fields: docs/runtime.md, "Specs".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rstar2_core.config import Config
from rstar2_core.config.pipeline_sections import ClusterConfig
from rstar2_core.config.rl import RLConfig
from rstar2_core.config.rollout_sections import SandboxConfig
from rstar2_core.config.runtime_rules import is_node_local, resolved_weight_sync
from rstar2_core.config.sections import ModelConfig, SFTConfig
from rstar2_core.runtime.engine_builder import EngineSpec
from rstar2_core.runtime.layout import ClusterLayout, compute_layout
from rstar2_core.runtime.protocol import TrainerSpec

RUNTIMES = ("local", "ray")


@dataclass(frozen=True)
class TrainerSetup:
    """The trainer a runtime builds: the stage's step and schedule (`spec`), the config section of its
    optimizer (`optim`: `cfg.rl` or `cfg.sft`) and the model settings it trains under."""

    spec: TrainerSpec
    optim: RLConfig | SFTConfig
    model: ModelConfig


@dataclass(frozen=True)
class RuntimeSpec:
    """Everything one runtime is built from (see the module docstring)."""

    kind: Literal["local", "ray"]
    policy_url: str
    engines: tuple[EngineSpec, ...]
    trainer: TrainerSetup | None
    sandbox: SandboxConfig | None
    grader_timeout_s: float | None
    weight_sync: str
    release_memory_during_training: bool
    tensor_parallel_size: int
    cluster: ClusterConfig
    layout: ClusterLayout | None = None
    shared_storage: bool = True
    """Every node can read what another wrote to the storage root: s3://, or a local root declared shared
    (`storage.shared_filesystem`). Without it the Ray runtime refuses a trainer or engines on a live
    cluster of several nodes."""

    @classmethod
    def from_config(cls, cfg: Config, *, policy_url: str, max_model_len: int | None = None,
                    trainer: TrainerSpec | None = None, engines: bool = True, sandbox: bool = True,
                    grader: bool = True, device: str | None = None) -> RuntimeSpec:
        """The spec of the runtime `cfg.cluster.runtime` for a policy checkpoint. `device`: where local
        engines run (default: `cuda` when this process has one, else `cpu`; Ray engines pick their own)."""
        kind = cfg.cluster.runtime
        if kind not in RUNTIMES:
            raise ValueError(f"unknown cluster.runtime {kind!r}; valid: {list(RUNTIMES)}")
        layout = None
        if kind == "ray":
            layout = layout_for(cfg)
            device = "cpu"                   # each engine actor sets its own (EngineSpec.for_actor)
        engine_specs: tuple[EngineSpec, ...] = ()
        if engines:
            dev = device or local_device()
            engine_specs = tuple(engine_spec(cfg, policy_url, max_model_len, dev, i)
                                 for i in range(cfg.rollout.num_engines))
        setup = None
        if trainer is not None:
            setup = TrainerSetup(trainer, getattr(cfg, trainer.section), cfg.model)
        return cls(kind, policy_url, engine_specs, setup, cfg.sandbox if sandbox else None,
                   cfg.eval.grader_timeout_s if grader else None,
                   resolved_weight_sync(cfg), cfg.rollout.release_memory_during_training,
                   cfg.rollout.tensor_parallel_size, cfg.cluster, layout,
                   not is_node_local(cfg.resolved_storage_root()) or cfg.storage.shared_filesystem)


def layout_for(cfg: Config) -> ClusterLayout:
    """The Ray runtime's actor layout for `cfg`: `compute_layout` of its `cluster`, `rollout` and `sandbox`
    sections (raises `LayoutError` naming the field to change)."""
    return compute_layout(cfg.cluster, cfg.rollout, cfg.sandbox)


def engine_spec(cfg: Config, checkpoint_url: str, max_model_len: int | None, device: str,
                index: int = 0) -> EngineSpec:
    """Engine `index`'s spec: `rollout.*` sizing, the model dtype, seed `rl.seed + index`, and the vLLM
    weight-transfer backend when `rollout.weight_sync` resolves to one (nccl / ipc)."""
    ro = cfg.rollout
    ws = resolved_weight_sync(cfg)
    return EngineSpec(ro.engine, checkpoint_url, max_model_len, ro.tensor_parallel_size, ro.gpu_memory_utilization,
                      ro.max_batch_size, ro.kv_capacity_tokens or None, cfg.model.dtype, device, cfg.rl.seed + index,
                      ws if ws in ("nccl", "ipc") else None, sleep_mode=ro.release_memory_during_training)


def local_device() -> str:
    """`cuda` when this process sees a GPU, else `cpu`."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def gpu_plan_sections(cfg: Config) -> dict:
    """The sections `runtime.cluster_plan.gpu_plan` reads, by keyword, with the weight sync resolved: the one
    place the root config is taken apart for the GPU plan (`rstar2 plan`, the recipe's preflight)."""
    return {"cluster": cfg.cluster, "rollout": cfg.rollout, "sandbox": cfg.sandbox, "rl": cfg.rl, "sft": cfg.sft,
            "model": cfg.model, "eval_": cfg.eval, "label_check": cfg.data.label_check,
            "push": resolved_weight_sync(cfg)}
