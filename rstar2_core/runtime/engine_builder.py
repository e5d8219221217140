"""The one place that builds inference engines: `build_engine(EngineSpec)`.

`runtime.specs` fills one `EngineSpec` per engine from the config (`engine_spec`); the local runtime
builds from it in its own process, the Ray runtime inside each engine actor. Invariant: one builder, so
`rollout.engine` (hf | vllm), `tensor_parallel_size`, `gpu_memory_utilization`, `max_batch_size` and
`kv_capacity_tokens` mean the same thing on both runtimes. `engine_busy_seconds(engine)` reads how long
an engine has computed, for the stage's time accounting. See docs/runtime.md, "Building engines".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal


@dataclass(frozen=True)
class EngineSpec:
    """What one engine is built from: kind, checkpoint, sizing (from `cfg.rollout`) and its seed
    (`runtime.specs.engine_spec`)."""

    kind: Literal["hf", "vllm"]
    checkpoint_url: str
    max_model_len: int | None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None   # None: vLLM's GPU share default (0.85); refused on CPU
    max_batch_size: int = 64
    kv_capacity_tokens: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    weight_transfer: str | None = None      # vLLM weight-transfer backend: "nccl" | "ipc" | None
    distributed_executor_backend: str | None = None
    sleep_mode: bool = False                 # vLLM sleep mode (rollout.release_memory_during_training)

    def for_actor(self, device: str, tp_over_ray: bool) -> EngineSpec:
        """The spec as built inside a Ray engine actor: its device, and vLLM's Ray executor when its TP
        ranks are placed on the layout's bundles."""
        return replace(self, device=device, distributed_executor_backend="ray" if tp_over_ray else None)


def build_engine(spec: EngineSpec):
    """Build the engine of `spec` in this process."""
    if spec.kind == "hf":
        import torch

        from rstar2_core.models.io import load_model_and_tokenizer
        from rstar2_core.rollout.hf_engine import HFEngine

        model, tok = load_model_and_tokenizer(spec.checkpoint_url, dtype=getattr(torch, spec.dtype),
                                              device=spec.device)
        for p in model.parameters():
            p.requires_grad_(False)
        max_len = spec.max_model_len or int(model.config.max_position_embeddings)
        return HFEngine(model, tok, max_batch_size=spec.max_batch_size, device=spec.device,
                        max_seq_len=min(max_len, int(model.config.max_position_embeddings)),
                        kv_capacity_tokens=spec.kv_capacity_tokens)
    if spec.kind == "vllm":
        from rstar2_core.models.io import checkpoint_in_use
        from rstar2_core.rollout.vllm_engine import VLLMEngine

        with checkpoint_in_use(spec.checkpoint_url) as path:     # vLLM reads it while it builds, not after
            return VLLMEngine(str(path), max_model_len=spec.max_model_len,
                              max_num_seqs=spec.max_batch_size, tensor_parallel_size=spec.tensor_parallel_size,
                              gpu_memory_utilization=spec.gpu_memory_utilization, dtype=spec.dtype,
                              seed=spec.seed, kv_capacity_tokens=spec.kv_capacity_tokens,
                              weight_transfer=spec.weight_transfer, sleep_mode=spec.sleep_mode,
                              distributed_executor_backend=spec.distributed_executor_backend)
    raise ValueError(f"unknown engine kind {spec.kind!r}; valid: ['hf', 'vllm']")


def engine_busy_seconds(engine: Any) -> float:
    """Seconds `engine` has spent computing since it was built (0 when it does not say)."""
    busy = getattr(engine, "busy_seconds", None)
    if callable(busy):
        return float(busy())
    stats = getattr(engine, "stats", None)
    if isinstance(stats, dict):
        return float(stats.get("decode_s", 0.0)) + float(stats.get("prefill_s", 0.0))
    return 0.0


class EngineFault(RuntimeError):
    """A request refused by an engine under the `engine-errors` fault (rstar2_core.faults)."""


class FailingEngine:
    """An engine that fails every request (the `engine-errors` fault): the agent loop marks each of its
    trajectories infra-failed, which the step's infra-failure share then counts."""

    def __init__(self, inner: Any):
        self.inner = inner

    async def generate(self, prompt_ids, params):
        raise EngineFault("engine-errors fault: this engine fails every request (RSTAR2_FAULT_INJECT)")

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
