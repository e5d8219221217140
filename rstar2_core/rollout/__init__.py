"""Agentic rollout: inference engines (HF continuous batching, vLLM adapter), the multi-turn tool loop
and the KV-aware scheduler. See docs/rollout.md and docs/rollout-scheduling.md.

    from rstar2_core.rollout import HFEngine, RolloutLimits, run_rollout_groups

Names are imported on first use (PEP 562), so `rstar2_core.rollout.hf_engine` and `.types` load with
torch + transformers alone (the GPU check runs on a box with nothing else); the agent loop and the
scheduler pull in the chat format and the sandbox only when asked for, and vLLM only for `VLLMEngine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rstar2_core.lazy_exports import lazy_exports

_EXPORTS = {
    "run_trajectory": "agent",
    "HFEngine": "hf_engine",
    "KVAdmission": "admission", "LengthModel": "length_model", "StaticAdmission": "admission",
    "rollout_groups": "scheduler", "rollout_metrics": "scheduler",
    "run_rollout_groups": "scheduler",
    "Engine": "types", "GenerationOutput": "types", "RolloutLimits": "types", "SamplingParams": "types",
    "ToolCallRecord": "types", "Trajectory": "types",
    "VLLMEngine": "vllm_engine",
}
__all__ = ["Engine", "GenerationOutput", "HFEngine", "KVAdmission", "LengthModel", "RolloutLimits", "SamplingParams",
           "StaticAdmission", "ToolCallRecord", "Trajectory", "VLLMEngine", "rollout_groups", "rollout_metrics",
           "run_rollout_groups", "run_trajectory"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from rstar2_core.rollout.admission import KVAdmission, StaticAdmission
    from rstar2_core.rollout.agent import run_trajectory
    from rstar2_core.rollout.hf_engine import HFEngine
    from rstar2_core.rollout.length_model import LengthModel
    from rstar2_core.rollout.scheduler import rollout_groups, rollout_metrics, run_rollout_groups
    from rstar2_core.rollout.types import (
        Engine,
        GenerationOutput,
        RolloutLimits,
        SamplingParams,
        ToolCallRecord,
        Trajectory,
    )
    from rstar2_core.rollout.vllm_engine import VLLMEngine
