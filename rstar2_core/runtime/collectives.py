"""Bytes each trainer rank moves per RL update and per SFT step, and the seconds at the operator's link speeds:
what `rstar2 plan` prints (`collectives`). Pure arithmetic over config sections and a `ModelShape`.

ZeRO-3 gathers the whole model for each pass (w·P·(N-1)/N bytes per rank on a ring): per micro-batch the
old-log-prob forward, the forward, and the recompute with the backward (one gather: the recompute's parameters
are reused at once), plus one reduce-scatter of the gradients (reduced every backward). With ZeRO++ hpZ the first gather after a step crosses nodes and the later ones stay
inside the node. Micro-batches assume every trajectory at its stage's longest response: an upper bound.
See docs/production.md, "Collectives per step".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rstar2_core.models.param_count import DTYPE_BYTES, ModelShape
from rstar2_core.runtime.gpu_memory import PROMPT_TOKENS, TrainerSetting


@dataclass(frozen=True)
class Traffic:
    """One step's bytes per rank across nodes and inside a node, and their seconds (None: no link speed)."""

    inter_node_bytes: float
    intra_node_bytes: float
    micro_batches: int
    inter_node_gb_per_s: float | None
    intra_node_gb_per_s: float | None

    @property
    def bytes_per_rank(self) -> float:
        return self.inter_node_bytes + self.intra_node_bytes

    @property
    def seconds(self) -> float | None:
        if self.inter_node_gb_per_s is None or (self.intra_node_bytes and self.intra_node_gb_per_s is None):
            return None
        intra = self.intra_node_bytes / (self.intra_node_gb_per_s * 1e9) if self.intra_node_bytes else 0.0
        return self.inter_node_bytes / (self.inter_node_gb_per_s * 1e9) + intra

    def to_json(self) -> dict[str, Any]:
        return {"bytes_per_rank": self.bytes_per_rank, "inter_node_bytes": self.inter_node_bytes,
                "intra_node_bytes": self.intra_node_bytes, "micro_batches_per_rank": self.micro_batches,
                "seconds": self.seconds}


def step_traffic(s: ModelShape, *, trainer: TrainerSetting, tokens_per_step: int, world: int, gpus_per_node: int,
                 dtype: str, passes_per_micro_batch: int, inter: float | None, intra: float | None,
                 hpz: int | None = None) -> Traffic:
    """One optimizer step's traffic per rank (module docstring): `tokens_per_step` over `world` ranks in
    micro-batches of `trainer.tokens`; `passes_per_micro_batch` parameter gathers each (forward passes and
    backward); `hpz` overrides the trainer's partition size (to compare both)."""
    w, p = DTYPE_BYTES[dtype], s.params
    mb = max(1, math.ceil(tokens_per_step / world / trainer.tokens))
    ring = w * p * (world - 1) / world
    hpz = trainer.hpz if hpz is None else hpz
    if trainer.zero_stage == 3:
        gathers = mb * passes_per_micro_batch
        if hpz > 1 and world > hpz:
            inter_b = ring + mb * ring                      # the first gather after the step, every reduce-scatter
            intra_b = (gathers - 1) * w * p * (hpz - 1) / hpz
        else:
            inter_b, intra_b = (gathers + mb) * ring, 0.0
    elif trainer.zero_stage in (1, 2):
        inter_b, intra_b = mb * ring + ring, 0.0            # gradients per micro-batch, the updated parameters
    else:
        inter_b, intra_b = mb * 2 * ring, 0.0               # an all-reduce of the gradients per micro-batch
    if world == 1:
        inter_b = intra_b = 0.0
    elif world <= gpus_per_node:                            # one node: nothing crosses the network
        inter_b, intra_b = 0.0, inter_b + intra_b
    return Traffic(inter_b, intra_b, mb, inter, intra)


def plan_collectives(s: ModelShape, *, cluster: Any, rl: Any, sft: Any, model: Any, world: int,
                     rl_trainer: TrainerSetting, sft_trainer: TrainerSetting) -> dict[str, Any]:
    """Per-rank traffic of the longest RL stage's update and an SFT step, with the configured hpZ setting and
    with the alternative (off if on, one node's GPUs if off) for comparison: `update_bytes_per_rank`,
    `update_seconds` (None without `cluster.inter_node_gb_per_s`), per stage, SFT, and `hpz_compare`."""
    inter, intra = cluster.inter_node_gb_per_s, cluster.intra_node_gb_per_s
    gpn = max(1, cluster.gpus_per_node)
    # a checkpointed layer's recompute and its backward share one gather (the recompute's parameters are reused
    # at once, so ZeRO-3 keeps them: stage3_max_reuse_distance); the old-log-prob forward is one more
    rl_passes = 2 + (1 if rl.old_logprobs == "recompute" else 0)
    sft_passes = 2
    stages = []
    for st in rl.stages:
        tokens = rl.prompts_per_step * rl.grpo.group_size * (st.max_response_tokens + PROMPT_TOKENS)
        t = step_traffic(s, trainer=rl_trainer, tokens_per_step=tokens, world=world, gpus_per_node=gpn,
                         dtype=model.dtype, passes_per_micro_batch=rl_passes, inter=inter, intra=intra)
        stages.append({"stage": st.name, "tokens_per_step": tokens, **t.to_json()})
    worst = max(stages, key=lambda x: x["bytes_per_rank"])
    sft_tokens = sft.batch_size * sft.max_seq_len
    sft_t = step_traffic(s, trainer=sft_trainer, tokens_per_step=sft_tokens, world=world, gpus_per_node=gpn,
                         dtype=model.dtype, passes_per_micro_batch=sft_passes, inter=inter, intra=intra)
    compare = {}
    if rl_trainer.zero_stage == 3 and world > gpn > 1:
        longest = max(rl.stages, key=lambda st: st.max_response_tokens)
        tokens = rl.prompts_per_step * rl.grpo.group_size * (longest.max_response_tokens + PROMPT_TOKENS)
        for name, hpz in (("flat", 1), ("hpz", gpn)):
            t = step_traffic(s, trainer=rl_trainer, tokens_per_step=tokens, world=world, gpus_per_node=gpn,
                             dtype=model.dtype, passes_per_micro_batch=rl_passes, inter=inter, intra=intra, hpz=hpz)
            compare[name] = {"zero_hpz_partition_size": hpz, **t.to_json(),
                             "extra_memory_gb": (DTYPE_BYTES[model.dtype] * s.params / hpz / 2**30) if hpz > 1 else 0.0}
    return {"update_bytes_per_rank": worst["bytes_per_rank"], "update_seconds": worst["seconds"],
            "update_stage": worst["stage"], "stages": stages,
            "sft_bytes_per_rank": sft_t.bytes_per_rank, "sft_seconds": sft_t.seconds,
            "sft_micro_batches_per_rank": sft_t.micro_batches, "hpz_compare": compare,
            "assumes": "every trajectory at its stage's longest response (+ a prompt allowance): an upper bound",
            "inter_node_gb_per_s": inter, "intra_node_gb_per_s": intra}
