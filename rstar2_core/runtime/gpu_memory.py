"""Each GPU's memory during an RL stage and an SFT step, by part, from the model's shape and the profile: what
`rstar2 plan` prints (`gpu_memory`) and what plan and preflight refuse when a peak passes the device. Pure
arithmetic over config sections and a `ModelShape` (no torch, no Ray); GiB throughout.

Phases of one GPU (colocated: an engine's TP rank and a trainer rank share it; separate: rollout is an engine's
GPU, update a trainer's): rollout = the engine awake (vLLM's `gpu_memory_utilization` share, all-in) + the
trainer's resident states + the weight push; update = the trainer's states, gathered parameters, activations at
the token budget, logits chunk, buckets, context, fragmentation + the engine awake or asleep; sft = the trainer
alone. Invariant: a peak is the sum of its phase's parts. What is not derived from the shape is a named constant
below; the trainer's part is calibrated against a ZeRO-3 rank on the CPU (bench/memory_plan.py).
See docs/production.md, "Memory per GPU".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rstar2_core.models.param_count import DTYPE_BYTES, ModelShape

GIB = float(1 << 30)

RUNTIME_CONTEXT_GB = 1.0
"""A GPU process's device context and library workspaces (CUDA/HIP context, cuBLAS/hipBLASLt workspaces,
kernels loaded): 0.5-1 GB per process on current stacks; the upper end, since nothing here measured it."""
COLLECTIVE_BUFFERS_GB = 1.0
"""NCCL/RCCL buffers of a trainer rank on a 64-rank world: NCCL_BUFFSIZE (4 MiB) per channel and peer of
its rings and trees, plus the process groups' own; an estimate, not a measurement."""
ENGINE_ASLEEP_GB = 2.0
"""A vLLM engine after `sleep(level=1)`: weights offloaded, KV cache dropped; its context and the graph
pool stay."""
ENGINE_PROFILE_TOKENS = 8192
"""Tokens of vLLM's memory-profiling forward (its default batched-token budget): sizes the activations the
engine keeps out of its KV cache."""
FRAGMENTATION = 0.10
"""Share added to the trainer's varying allocations (activations, gathered parameters, logits, buckets)
for the caching allocator's reserved-but-unused memory: packed micro-batches change shape every pass."""
PROMPT_TOKENS = 1024
"""A trajectory's prompt and tool turns beyond its response budget, where a count of trajectories (not a
token budget) sets a micro-batch."""
LOGITS_CHUNK_ELEMENTS = 1 << 26
"""models/token_logprobs.py's chunk: logits of at most this many (token, word) pairs alive at once."""
ACTIVATION_ELEMENTS_PER_TOKEN = "5*hidden + 4*q + 4*kv + 4*intermediate"
"""A decoder layer's saved activations per token (norm outputs, q/k/v before and after norm and rotary,
attention output, residuals, MLP gate/up/activation/product): the formula of `_layer_elements`."""
REDUCE_BUCKET_ELEMENTS = 50_000_000
"""models/deepspeed_backend.py's reduce and prefetch bucket (elements)."""
MAX_LIVE_PARAMETERS = 1_000_000_000
"""DeepSpeed's `stage3_max_live_parameters` (its default; models/deepspeed_backend.py leaves it): ZeRO-3 keeps
up to this many parameters gathered (with `stage3_max_reuse_distance`, also 1e9, a parameter reused soon, as
in a checkpointed layer's recompute, is not released), so a model below it stays gathered whole."""
IPC_BUCKET_BYTES = 1 << 30
"""runtime/ray/weight_sync.py's IPC push bucket (a trainer rank packs gathered tensors into it)."""


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU peaks (GiB) of the three phases, their parts (`parts`: "<phase>.<part>" -> GiB) and the
    problems: a peak past `device_gb`, named by its largest part and the setting to change."""

    device_gb: float
    rollout_peak_gb: float
    update_peak_gb: float
    sft_peak_gb: float
    parts: dict[str, float]
    problems: tuple[str, ...] = ()
    assumptions: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"device_gb": self.device_gb, "rollout_peak_gb": round(self.rollout_peak_gb, 2),
                "update_peak_gb": round(self.update_peak_gb, 2), "sft_peak_gb": round(self.sft_peak_gb, 2),
                "parts": {k: round(v, 3) for k, v in self.parts.items()}, "problems": list(self.problems),
                "assumptions": self.assumptions}


def _layer_elements(s: ModelShape) -> int:
    return 5 * s.hidden + 4 * s.q_dim + 4 * s.kv_dim + 4 * s.intermediate


def zero_states(s: ModelShape, *, zero_stage: int, world: int, bf16: bool, hpz: int = 1) -> dict[str, float]:
    """A trainer rank's resident model and optimizer states (bytes) under DeepSpeed ZeRO `zero_stage` over
    `world` ranks: the training-dtype parameters (partitioned at 3), the fp32 master copy and the fp32
    gradient (partitioned at >= 1 and >= 2; DeepSpeed keeps both even when training in fp32), AdamW's two
    fp32 moments (partitioned at >= 1), and with ZeRO++ hpZ (`hpz` > 1) the secondary copy of the
    parameters partitioned within a node."""
    p, w = s.params, 2 if bf16 else 4
    part = {0: (1, 1, 1), 1: (1, 1, world), 2: (1, world, world), 3: (world, world, world)}[zero_stage]
    out = {"params": p * w / part[0], "grads": p * 4 / part[1], "optimizer": p * 8 / part[2]}
    out["master_params"] = p * 4 / part[2] if (bf16 or zero_stage) else 0.0
    if hpz > 1:
        out["hpz_secondary_params"] = p * w / hpz
    return out


def activations(s: ModelShape, tokens: int, *, checkpointing: bool, dtype_bytes: int) -> dict[str, float]:
    """Activation bytes of one forward/backward over `tokens` packed tokens: with checkpointing every layer
    keeps its input and one layer at a time recomputes its activations (and holds their gradients);
    without, every layer keeps its activations."""
    per_layer = tokens * _layer_elements(s) * dtype_bytes
    if checkpointing:
        return {"activations_checkpointed": s.layers * tokens * s.hidden * dtype_bytes,
                "activations_recompute": 2 * per_layer}
    return {"activations": s.layers * per_layer + per_layer}


def logits_chunk(s: ModelShape, tokens: int) -> float:
    """Bytes of the LM head's chunk: fp32 logits, their log-softmax and gradient for at most
    LOGITS_CHUNK_ELEMENTS (token, word) pairs."""
    rows = min(tokens, max(1, LOGITS_CHUNK_ELEMENTS // s.vocab))
    return 3 * rows * s.vocab * 4


def trainer_update(s: ModelShape, *, tokens: int, zero_stage: int, world: int, bf16: bool, hpz: int,
                   checkpointing: bool, contexts: bool = True) -> dict[str, float]:
    """A trainer rank's parts (bytes) during an optimizer step over micro-batches of `tokens` tokens; the
    context and collective buffers only where `contexts` (a GPU process)."""
    w = 2 if bf16 else 4
    out = zero_states(s, zero_stage=zero_stage, world=world, bf16=bf16, hpz=hpz)
    varying = dict(activations(s, tokens, checkpointing=checkpointing, dtype_bytes=w))
    varying["logits_chunk"] = logits_chunk(s, tokens)
    if zero_stage == 3:
        varying["gathered_params"] = min(s.params, MAX_LIVE_PARAMETERS) * w
    if zero_stage >= 2:
        varying["reduce_bucket"] = REDUCE_BUCKET_ELEMENTS * 4
    out.update(varying)
    out["allocator_fragmentation"] = FRAGMENTATION * sum(varying.values())
    if contexts:
        out["trainer_context"] = RUNTIME_CONTEXT_GB * GIB
        out["collective_buffers"] = COLLECTIVE_BUFFERS_GB * GIB
    return out


# ------------------------------------------------------------------------------------------- the plan
DEFAULT_GPU_MEMORY_UTILIZATION = 0.85
"""What a vLLM engine takes when `rollout.gpu_memory_utilization` is None (rollout/vllm_engine.py)."""


@dataclass(frozen=True)
class TrainerSetting:
    """What the memory of one trainer role depends on: its section's backend, ZeRO stage, hpZ partition
    and micro-batch token budget (`tokens`), and the field that sets that budget (named in problems)."""

    zero_stage: int
    hpz: int
    tokens: int
    tokens_field: str


def rl_trainer(rl: Any) -> TrainerSetting:
    """The RL trainer's setting: tokens = `rl.max_tokens_per_micro_batch`, or `rl.micro_batch_size`
    trajectories at the longest stage's response budget plus PROMPT_TOKENS."""
    if rl.max_tokens_per_micro_batch:
        tokens, f = rl.max_tokens_per_micro_batch, "rl.max_tokens_per_micro_batch"
    else:
        tokens = (rl.micro_batch_size or 8) * (max(s.max_response_tokens for s in rl.stages) + PROMPT_TOKENS)
        f = "rl.micro_batch_size"
    return TrainerSetting(rl.zero_stage if rl.backend == "deepspeed" else 0, rl.zero_hpz_partition_size, tokens, f)


def sft_trainer(sft: Any) -> TrainerSetting:
    """SFT's: tokens = `sft.max_tokens_per_micro_batch`, or `sft.micro_batch_size` rows of max_seq_len."""
    if sft.max_tokens_per_micro_batch:
        tokens, f = sft.max_tokens_per_micro_batch, "sft.max_tokens_per_micro_batch"
    else:
        tokens, f = (sft.micro_batch_size or 8) * sft.max_seq_len, "sft.micro_batch_size"
    return TrainerSetting(sft.zero_stage if sft.backend == "deepspeed" else 0, sft.zero_hpz_partition_size, tokens, f)


def engine_parts(s: ModelShape, rollout: Any, device_gb: float, dtype_bytes: int,
                 longest_tokens: int) -> tuple[dict[str, float], int]:
    """(an engine's parts on one of its GPUs in bytes, the KV cache's capacity in tokens per engine). vLLM
    takes `gpu_memory_utilization` of the device all-in: its weights (1/TP each), its profiled activations
    and context, the KV cache in the rest. The HF engine holds the whole model and `max_batch_size` slots of
    `longest_tokens` (or `kv_capacity_tokens`)."""
    tp = rollout.tensor_parallel_size
    kv_per_token = s.kv_bytes_per_token(dtype_bytes) / tp
    weights = s.params * dtype_bytes / tp
    other = RUNTIME_CONTEXT_GB * GIB + ENGINE_PROFILE_TOKENS * _layer_elements(s) * dtype_bytes / tp
    if rollout.engine == "vllm":
        share = (rollout.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION) * device_gb * GIB
        kv = share - weights - other
    else:
        kv = (rollout.kv_capacity_tokens or rollout.max_batch_size * longest_tokens) * kv_per_token
    parts = {"engine_weights": weights, "engine_kv_cache": max(kv, 0.0), "engine_activations_and_context": other}
    return parts, int(max(kv, 0.0) // kv_per_token)


def plan_memory(s: ModelShape, *, device_gb: float, layout: Any, rollout: Any, rl: Any, sft: Any,
                model: Any, longest_tokens: int, push: str) -> MemoryPlan:
    """Each GPU's peak in the three phases (module docstring) for the layout (`runtime.layout.ClusterLayout`)
    and sections; `longest_tokens`: the longest sequence an engine must hold (prompt + the largest response
    budget of RL, eval or the label check); `push`: the resolved `rollout.weight_sync`."""
    w = DTYPE_BYTES[model.dtype]
    bf16 = model.dtype != "float32"
    world = len(layout.trainer_shards)
    colocated = layout.mode == "colocated"
    engine, kv_tokens = engine_parts(s, rollout, device_gb, w, longest_tokens)
    ro, up = rl_trainer(rl), sft_trainer(sft)
    trainer = trainer_update(s, tokens=ro.tokens, zero_stage=ro.zero_stage, world=world, bf16=bf16, hpz=ro.hpz,
                             checkpointing=model.gradient_checkpointing)
    resident = {k: v for k, v in trainer.items() if k in ("params", "grads", "optimizer", "master_params",
                                                          "hpz_secondary_params", "trainer_context",
                                                          "collective_buffers")}
    parts: dict[str, float] = {f"rollout.{k}": v for k, v in engine.items()}
    if colocated:
        parts.update({f"rollout.trainer_{k}" if not k.startswith("trainer") else f"rollout.{k}": v
                      for k, v in resident.items()})
        if push in ("ipc", "nccl"):
            parts["rollout.weight_push_bucket"] = IPC_BUCKET_BYTES if push == "ipc" else 0.0
            parts["rollout.weight_push_gathered"] = (s.largest_module_params * w) if ro.zero_stage == 3 else 0.0
        asleep = rollout.release_memory_during_training
        parts["update.engine_asleep" if asleep else "update.engine_awake"] = (
            ENGINE_ASLEEP_GB * GIB if asleep else sum(engine.values()))
    parts.update({f"update.{k}" if k.startswith("trainer") else f"update.trainer_{k}": v for k, v in trainer.items()})
    sft_parts = trainer_update(s, tokens=up.tokens, zero_stage=up.zero_stage, world=world, bf16=bf16, hpz=up.hpz,
                               checkpointing=model.gradient_checkpointing)
    parts.update({f"sft.{k}" if k.startswith("trainer") else f"sft.trainer_{k}": v for k, v in sft_parts.items()})
    gb = {k: v / GIB for k, v in parts.items()}
    peak = {ph: sum(v for k, v in gb.items() if k.startswith(ph + ".")) for ph in ("rollout", "update", "sft")}
    problems = _problems(gb, peak, device_gb, rollout, ro, up, model, colocated, kv_tokens, longest_tokens)
    assumptions = {"trainer_world": world, "rl_tokens_per_micro_batch": ro.tokens,
                   "sft_tokens_per_micro_batch": up.tokens, "engine_kv_capacity_tokens": kv_tokens,
                   "longest_sequence_tokens": longest_tokens, "gradient_checkpointing": model.gradient_checkpointing,
                   "runtime_context_gb": RUNTIME_CONTEXT_GB, "collective_buffers_gb": COLLECTIVE_BUFFERS_GB,
                   "fragmentation": FRAGMENTATION}
    return MemoryPlan(device_gb, peak["rollout"], peak["update"], peak["sft"], gb, tuple(problems), assumptions)


def _largest(gb: dict[str, float], phase: str) -> str:
    k = max((k for k in gb if k.startswith(phase + ".")), key=gb.__getitem__)
    return f"{k} {gb[k]:.1f} GiB"


def _problems(gb: dict[str, float], peak: dict[str, float], device: float, rollout: Any, ro: TrainerSetting,
              up: TrainerSetting, model: Any, colocated: bool, kv_tokens: int, longest: int) -> list[str]:
    out = []
    engine = sum(v for k, v in gb.items() if k.startswith("rollout.engine"))
    fix_ckpt = "" if model.gradient_checkpointing else ", or model.gradient_checkpointing = true"
    if peak["rollout"] > device:
        room = (device - (peak["rollout"] - engine)) / device
        out.append(f"GPU memory: the rollout peak {peak['rollout']:.1f} GiB passes the device's {device:g} GiB "
                   f"(largest: {_largest(gb, 'rollout')}); set rollout.gpu_memory_utilization <= {max(room, 0):.2f}")
    elif rollout.engine == "vllm" and kv_tokens < longest:
        out.append(f"GPU memory: an engine's KV cache holds {kv_tokens:,} tokens, fewer than the longest sequence "
                   f"({longest:,}); raise rollout.gpu_memory_utilization or rollout.tensor_parallel_size")
    if peak["update"] > device:
        trainer = peak["update"] - gb.get("update.engine_awake", 0.0) - gb.get("update.engine_asleep", 0.0)
        fixes = [f"lower {ro.tokens_field}{fix_ckpt}"]
        if colocated and "update.engine_awake" in gb:
            room = (device - trainer) / device
            fixes.insert(0, f"set rollout.gpu_memory_utilization <= {max(room, 0):.2f} (the engines stay awake beside "
                            "the trainer), or rollout.release_memory_during_training = true (vLLM sleep mode; "
                            "unreliable on ROCm)")
        out.append(f"GPU memory: the update peak {peak['update']:.1f} GiB passes the device's {device:g} GiB (largest: "
                   f"{_largest(gb, 'update')}; the trainer's part {trainer:.1f} GiB); " + "; or ".join(fixes))
    if peak["sft"] > device:
        out.append(f"GPU memory: the SFT peak {peak['sft']:.1f} GiB passes the device's {device:g} GiB (largest: "
                   f"{_largest(gb, 'sft')}); lower {up.tokens_field}{fix_ckpt}, or sft.zero_stage = 3")
    return out
