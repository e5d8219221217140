"""The production rehearsal's overlay: qwen3-14b-mi300x scaled down in size and devices only.

`configs/production-rehearsal.overrides` turns the production profile into one a 2-core CPU machine runs
(SmolLM2-135M for Qwen3-14B, a local 2-node Ray cluster of logical GPUs, object_store weight sync for
CUDA IPC, small counts, lengths and steps). `ALLOWED` is the documented list of config keys it may change;
`differences(base, rehearsed)` lists every key whose value differs and `not_allowed` those outside the
list, which a test keeps empty: data layouts, SFT formats, the label check's rules, curation, RoC, the stage
schedule's shape, the benchmark list and metrics, promotion and the registry run as the profile writes them.

    cfg = load_config("qwen3-14b-mi300x", overlay_overrides())
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

OVERLAY = Path(__file__).resolve().parents[1] / "configs" / "production-rehearsal.overrides"

ALLOWED: dict[str, str] = {
    "model.name_or_path": "SmolLM2-135M-Instruct (what a package ships here) for Qwen3-14B-Base",
    "model.dtype": "float32: vLLM's CPU build and CPU training",
    "model.gradient_checkpointing": "activation memory is no constraint at 135M",
    "cluster.nodes": "a local multi-node Ray cluster of 2 worker nodes for 8 machines",
    "cluster.gpus_per_node": "1 logical GPU per node for 8 MI300X",
    "cluster.logical_gpus": "the GPUs are logical: every actor computes on the CPU",
    "cluster.cpus_per_node": "a 2-core machine's share per node",
    "cluster.cpus_per_gpu": "a 2-core machine's share per GPU bundle",
    "cluster.ray_address": "the local cluster's address (endpoint)",
    "cluster.resources.*.num_cpus": "the stage tasks' CPU reservations on a small head",
    "rollout.num_engines": "one engine per logical GPU",
    "rollout.tensor_parallel_size": "one device per engine",
    "rollout.gpu_memory_utilization": "GPUs only (vLLM on CPU refuses it)",
    "rollout.kv_capacity_tokens": "the KV budget of a CPU engine",
    "rollout.max_batch_size": "requests per engine on 2 cores",
    "rollout.weight_sync": "object_store: CUDA IPC needs GPUs",
    "sandbox.workers": "tool processes on 2 cores",
    "data.label_check.k": "samples per problem",
    "data.label_check.min_agree": "agreement needed of k = 2",
    "data.label_check.max_problems": "problems checked",
    "data.label_check.max_response_tokens": "sample length",
    "data.label_check.max_turns": "turns per sample",
    "sft.batch_size": "rows per optimizer step",
    "sft.micro_batch_size": "rows per micro-batch",
    "sft.max_seq_len": "row length",
    "sft.epochs": "passes",
    "sft.max_steps": "steps",
    "sft.checkpoint_every": "steps between checkpoints (every one is rehearsed)",
    "rl.prompts_per_step": "prompts per step",
    "rl.grpo.group_size": "rollouts kept per prompt (the oversampling factor stays)",
    "rl.micro_batch_size": "trajectories per micro-batch",
    "rl.checkpoint_every": "steps between checkpoints (every one is rehearsed)",
    "rl.stages.*.steps": "steps per stage",
    "rl.stages.*.max_response_tokens": "response lengths (still growing across the stages)",
    "rl.stages.*.max_turns": "turns (still growing into stage 3)",
    "rl.stages.*.hard_subset_k": "samples per problem of the hard subset",
    "eval.k": "samples per problem",
    "eval.max_tokens": "evaluation length",
    "eval.max_turns": "evaluation turns",
    "eval.benchmarks.*.limit": "problems per benchmark",
    "tracking.tracking_uri": "the local MLflow server (endpoint)",
    "storage.s3_endpoint_url": "the local S3 server (endpoint)",
    "storage.s3_region": "the local S3 server's region (endpoint)",
}
"""Config keys the overlay may change (`*`: any index or name), each with why: sizes, devices, endpoints."""


def overlay_overrides(path: Path = OVERLAY) -> list[str]:
    """The dotted overrides of the overlay file (comments and blank lines dropped)."""
    return [x.strip() for x in path.read_text().splitlines() if x.strip() and not x.lstrip().startswith("#")]


def _flat(x: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(x, dict):
        out: dict[str, Any] = {}
        for k, v in x.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    if isinstance(x, list) and x and all(isinstance(v, dict) for v in x):
        out = {}
        for i, v in enumerate(x):
            out.update(_flat(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: x}


def differences(base: Any, rehearsed: Any) -> list[tuple[str, Any, Any]]:
    """(key, base value, rehearsed value) of every leaf of the two configs that differs, sorted by key."""
    a, b = _flat(base.model_dump(mode="json")), _flat(rehearsed.model_dump(mode="json"))
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def not_allowed(diffs: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """The differences outside `ALLOWED`."""
    return [d for d in diffs if not any(fnmatch.fnmatchcase(d[0], pat) for pat in ALLOWED)]
