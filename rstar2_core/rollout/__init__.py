"""Agentic rollout: inference engines (HF continuous batching, vLLM adapter), the multi-turn tool loop
and the KV-aware scheduler. See docs/rollout.md.

    from rstar2_core.rollout import HFEngine, RolloutLimits, run_rollout_groups

Names are imported on first use (PEP 562), so `rstar2_core.rollout.hf_engine` and `.types` load with
torch + transformers alone (the GPU check runs on a box with nothing else); the agent loop and the
scheduler pull in the chat format and the sandbox only when asked for, and vLLM only for `VLLMEngine`.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "run_trajectory": "agent",
    "HFEngine": "hf_engine",
    "KVAdmission": "scheduler", "rollout_groups": "scheduler", "rollout_metrics": "scheduler",
    "run_rollout_groups": "scheduler",
    "Engine": "types", "GenerationOutput": "types", "RolloutLimits": "types", "SamplingParams": "types",
    "ToolCallRecord": "types", "Trajectory": "types",
    "VLLMEngine": "vllm_engine",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = list(_EXPORTS)
