"""Agentic rollout: inference engines (HF continuous batching, vLLM adapter), the multi-turn tool loop
and the KV-aware scheduler. See docs/rollout.md.

    from rstar2_core.rollout import HFEngine, RolloutLimits, run_rollout_groups
"""

from rstar2_core.rollout.admission import KVAdmission, LengthModel, StaticAdmission
from rstar2_core.rollout.agent import run_trajectory
from rstar2_core.rollout.hf_engine import HFEngine
from rstar2_core.rollout.scheduler import rollout_groups, rollout_metrics, run_rollout_groups
from rstar2_core.rollout.types import (
    Engine,
    GenerationOutput,
    RolloutLimits,
    SamplingParams,
    ToolCallRecord,
    Trajectory,
)


def __getattr__(name: str):
    if name == "VLLMEngine":   # vllm is imported only when asked for (gpu extra)
        from rstar2_core.rollout.vllm_engine import VLLMEngine
        return VLLMEngine
    raise AttributeError(name)


__all__ = [
    "Engine",
    "GenerationOutput",
    "HFEngine",
    "KVAdmission",
    "LengthModel",
    "RolloutLimits",
    "SamplingParams",
    "StaticAdmission",
    "ToolCallRecord",
    "Trajectory",
    "VLLMEngine",
    "rollout_groups",
    "rollout_metrics",
    "run_rollout_groups",
    "run_trajectory",
]
