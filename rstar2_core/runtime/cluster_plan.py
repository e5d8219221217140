"""The GPU side of a profile, planned before a GPU is rented: each GPU's memory by part
(runtime/gpu_memory.py) and each trainer rank's collective traffic (runtime/collectives.py), from the
policy's config.json and the profile. `rstar2 plan` prints it; preflight refuses a run whose memory does not
fit, since there the store holds the model's config.json.

    out = gpu_plan(cluster=cfg.cluster, ..., push=resolved_weight_sync(cfg), hf=config_json)
    out["problems"]                     # [] when every GPU's peak fits its memory

A profile on logical GPUs (the CPU rehearsal), on CPU nodes, on the local runtime, without
`cluster.gpu_memory_gb`, or whose model's config.json could not be read is not checked: the result says
which and why, never a silent pass.
"""

from __future__ import annotations

from typing import Any

from rstar2_core.config import (
    ClusterConfig,
    EvalConfig,
    LabelCheckConfig,
    ModelConfig,
    RLConfig,
    RolloutConfig,
    SandboxConfig,
    SFTConfig,
)
from rstar2_core.config.runtime_rules import computes_on_gpu
from rstar2_core.models.param_count import model_shape
from rstar2_core.runtime.collectives import plan_collectives
from rstar2_core.runtime.gpu_memory import PROMPT_TOKENS, plan_memory, rl_trainer, sft_trainer
from rstar2_core.runtime.layout import compute_layout


def longest_sequence(rl: RLConfig, eval_: EvalConfig, label_check: LabelCheckConfig) -> int:
    """The longest sequence an engine must hold: a prompt allowance plus the largest response budget of
    the RL stages, the evaluation and the label check."""
    budgets = [st.max_response_tokens for st in rl.stages] + [eval_.max_tokens]
    if label_check.enabled:
        budgets.append(label_check.max_response_tokens or eval_.max_tokens)
    return max(budgets) + PROMPT_TOKENS


def skip_reason(cluster: ClusterConfig, hf: dict | None, source: str) -> str | None:
    """Why the GPU plan cannot be computed for this cluster (None: it can)."""
    if not cluster.gpus_per_node:
        return "no GPUs (cluster.gpus_per_node = 0)"
    if not computes_on_gpu(cluster):
        return "logical GPUs (cluster.logical_gpus = true): engines and trainer compute on the CPU"
    if cluster.runtime != "ray":
        return "cluster.runtime = \"local\": the GPU layout is the Ray runtime's"
    if cluster.gpu_memory_gb is None:
        return "cluster.gpu_memory_gb is not set (MI300X: 192, H100: 79.6, H200: 139.8)"
    if hf is None:
        return f"the model's config.json: {source}"
    return None


def gpu_plan(*, cluster: ClusterConfig, rollout: RolloutConfig, sandbox: SandboxConfig, rl: RLConfig,
             sft: SFTConfig, model: ModelConfig, eval_: EvalConfig, label_check: LabelCheckConfig, push: str,
             hf: dict | None, source: str = "") -> dict[str, Any]:
    """{"gpu_memory", "collectives", "problems"} for the sections and the policy's config.json `hf` (None: not
    read; `source` says where it came from or why not); `push`: the resolved `rollout.weight_sync`."""
    why = skip_reason(cluster, hf, source)
    if why is None:
        try:
            shape = model_shape(hf)
        except (KeyError, ValueError) as e:
            why = f"the model's config.json ({source}) cannot be sized: {e}"
    if why is not None:
        return {"gpu_memory": {"skipped": why}, "collectives": {"skipped": why}, "problems": []}
    layout = compute_layout(cluster, rollout, sandbox)
    ro, sf = rl_trainer(rl), sft_trainer(sft)
    mem = plan_memory(shape, device_gb=cluster.gpu_memory_gb, layout=layout, rollout=rollout, rl=rl, sft=sft,
                      model=model, longest_tokens=longest_sequence(rl, eval_, label_check), push=push)
    coll = plan_collectives(shape, cluster=cluster, rl=rl, sft=sft, model=model, world=len(layout.trainer_shards),
                            rl_trainer=ro, sft_trainer=sf)
    return {"gpu_memory": {**mem.to_json(), "source": source}, "collectives": coll, "problems": list(mem.problems)}
