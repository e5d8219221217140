"""RL sections of the config tree: GRPO-RoC, the stages, the RL optimizer and loop."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rstar2_core.config.base import AdamBetas, _Section, check_one_cut, default_micro_batch_count


# ------------------------------------------------------------------------------------------ GRPO-RoC
class GRPOConfig(_Section):
    advantage_estimator: Literal["grpo"] = "grpo"
    """Advantage registry key: `grpo` = (r - mean) / (std + eps) per group (population std)."""
    policy_loss: Literal["ppo_clip"] = "ppo_clip"
    """Policy-loss registry key: `ppo_clip` = clipped ratio with clip-higher, token-level mean."""
    resample: Literal["roc", "none"] = "roc"
    """`roc`: Resample-on-Correct down-sampling of oversample x group_size rollouts to group_size.
    `none`: plain GRPO, keep every rollout (oversample should then be 1)."""
    oversample: int = Field(2, ge=1)
    """Rollouts per prompt = oversample x group_size. Paper: 2 (32 rollouts -> 16 kept)."""
    group_size: int = Field(16, ge=2)
    """Rollouts kept per prompt (G). Paper: 16."""
    positive_mode: Literal["weighted", "lowest_penalty"] = "weighted"
    """How positives are kept: sampled with p ~ 1/penalty (paper) or lowest penalty first (reference code)."""
    min_per_class: int = Field(2, ge=0)
    """Floor of kept rollouts per class when a group has both classes (reference code: 2)."""
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower PPO clip: ratio >= 1 - clip_low. Paper: 0.2."""
    clip_high: float = Field(0.28, ge=0.0)
    """Upper PPO clip (clip-higher): ratio <= 1 + clip_high. Paper: 0.28."""
    adv_eps: float = Field(1e-6, gt=0)
    """Added to the group std in the advantage denominator."""


# The names the pipeline (tasks/, flows/) keys its own records by in a run's store
# (`state/<key>.json`, `state/mlflow/<key>.json`, `checkpoints/<key>`, `data/<key>`, `eval/<key>`) and in
# the evaluations it ranks ("sft" is the promotion baseline). An RL stage's name keys the same places, so
# it may be none of these, nor have the shape of a key the pipeline derives from a stage name.
# tests/flows/test_task_helpers.py reads every such literal in tasks/ and flows/ and checks it is here.
PIPELINE_KEYS: frozenset[str] = frozenset({
    "curate", "sft-data", "base-model", "sft",  # stage records and MLflow runs (tasks/stages.py)
    "base", "curated",                          # checkpoints/base, data/curated
    "model",                                    # the evaluate flows' evaluation (eval/model, eval-model)
    "resolved-model",                           # what the evaluate flows resolved, pinned for a retry
    "register", "promotion", "summary",         # records of register-best and of the recipe's summary
    "config", "mlflow", "parent",               # the config snapshot, the MLflow ids folder, the parent run
    "unsent-metrics",                           # metric points MLflow did not take, written by the retry
    "untracked",                                # results computed while MLflow was away, logged by the retry
    "open-failure",                             # an attempt that failed before freezing the config
})
DERIVED_KEY_PREFIXES = ("eval-",)               # eval-<stage>: a stage's evaluation
DERIVED_KEY_SUFFIXES = ("-hard-subset",)        # <stage>-hard-subset: the hard subset a stage trains on
STAGE_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class RLStageConfig(_Section):
    name: str = ""
    """Stage name used in run names, run-store keys, MLflow runs and checkpoint URLs; default
    `rl-stage-<n>`. Lower-case letters, digits and `-`, starting with a letter or digit, and none of the
    names the pipeline uses itself (`PIPELINE_KEYS`: sft, curate, register, ...; nor `eval-...` or
    `...-hard-subset`)."""
    steps: int = Field(ge=1)
    """RL steps in this stage. Paper: 300, 85, 125."""
    max_response_tokens: int = Field(ge=1)
    """Budget of generated + tool tokens per trajectory. Paper: 8K, 12K, 12K."""
    max_turns: int = Field(ge=1)
    """Most assistant turns per trajectory. Paper: 10, 10, 15."""
    dataset: Literal["curated", "hard_subset"] = "curated"
    """Problems to train on: the curated set, or its hard subset under the previous stage's policy."""
    reset_optimizer: bool = False
    """Start this stage with fresh AdamW state (paper: at stage 3)."""
    hard_subset_k: int = Field(8, ge=1)
    """For dataset = hard_subset: rollouts per problem; problems solved k/k are dropped. Paper: 8."""

    @field_validator("name")
    @classmethod
    def _name_rules(cls, name: str) -> str:
        if name == "":  # filled with rl-stage-<n> by RLConfig
            return name
        if not STAGE_NAME_PATTERN.match(name):
            raise ValueError(f"{name!r} is not a stage name: use lower-case letters, digits and '-', starting "
                             "with a letter or digit (it becomes a folder and a run-store key), e.g. "
                             "\"rl-stage-1\"")
        if name in PIPELINE_KEYS:
            clash, fix = f"{name!r} is a name the pipeline uses itself", f"e.g. \"rl-{name}\""
        elif name.startswith(DERIVED_KEY_PREFIXES):
            clash, fix = f"{name!r} has the shape of the key of a stage's evaluation", "one not starting with eval-"
        elif name.endswith(DERIVED_KEY_SUFFIXES):
            clash, fix = f"{name!r} has the shape of the key of a stage's hard subset", "one not ending with -hard-subset"
        else:
            return name
        raise ValueError(f"{clash}, so the stage would share run-store records, MLflow runs or folders with "
                         f"it; pick another name ({fix}) or leave it unset for rl-stage-<n>. Reserved: "
                         f"{', '.join(sorted(PIPELINE_KEYS))}, names starting with "
                         f"{' or '.join(DERIVED_KEY_PREFIXES)} and names ending with {' or '.join(DERIVED_KEY_SUFFIXES)}")


class RLConfig(_Section):
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate, constant after warm-up. Paper: 1e-6."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up steps (counted over the whole RL run). Paper: 20."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    betas: AdamBetas = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip. Paper: 1.0."""
    prompts_per_step: int = Field(512, ge=1)
    """Prompts sampled per RL step. Paper: 512."""
    temperature: float = Field(1.0, gt=0)
    """Rollout sampling temperature. Paper: 1.0."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Trajectories per forward/backward; gradients accumulate to one optimizer step per RL step. Set this
    or max_tokens_per_micro_batch; neither = 8 trajectories."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=32)
    """Token budget of one forward/backward instead of a trajectory count (verl's dynamic batch size):
    a rank's trajectories are packed first-fit-decreasing into rows of at most this many tokens (prompt
    and response; the shared system turn once), so long-tailed response lengths (most short, a few at
    the cap) give evenly full passes and the activation memory of a pass is bounded by tokens. Must
    hold the longest response of any stage (a trajectory longer than the budget runs alone, counted in
    `actor/over_budget`). Larger: fewer, fuller passes, more activation memory. The step's loss and
    gradient do not depend on the cut. None = by micro_batch_size."""
    old_logprobs: Literal["recompute", "engine"] = "recompute"
    """Where the PPO ratio's old log-probs come from: a no-grad forward of the policy before the update
    (verl; ratio exactly 1 for identical weights) or the engine's sampling log-probs (one forward less;
    the ratio then also carries engine/trainer numeric mismatch)."""
    tis_cap: float | None = Field(None, ge=1.0)
    """Truncated importance sampling (rl/loss.py): each sampled token's loss is weighted by
    min(exp(trainer - engine log-prob), tis_cap), correcting for the engine sampling from a slightly
    different distribution than the trainer computes (kernels, bf16, a stale sync). None = off (the
    paper). verl's default cap is 2. Most useful with old_logprobs = "engine", where the ratio is then taken
    against the trainer's own log-probs; with "recompute" it reweights the same way. The cap trades
    bias (tokens above it are under-corrected) for variance."""
    max_staleness: int = Field(0, ge=0, le=8)
    """Asynchronous RL (rl/pipelined.py): 0 = every step rolls out with the weights of the step before and
    waits for them (the paper). k >= 1: the engines roll the next batches out while the trainer updates,
    with weights at most k optimizer steps older than the trainer's; weights reach the engines between
    batches (never inside a trajectory), and a batch is never launched beyond the bound, so none is
    dropped for age. Stale tokens are reweighted by truncated importance sampling (`tis_cap`, required).
    Trade-off: the engines and the trainer work at once (peers report 2-2.8x at scale; on a 2-core CPU
    they compete for the cores), for gradients from data up to k steps off-policy."""
    checkpoint_every: int = Field(1, ge=1)
    """Save a resumable checkpoint (model, optimizer, scheduler, RNG, data cursor, run id) every N steps."""
    keep_checkpoints: int = Field(2, ge=1)
    """Step checkpoints kept per stage (the stage's final checkpoint is always kept)."""
    backend: Literal["torch", "deepspeed"] = "torch"
    """Actor training backend: `torch` (CPU/one GPU) or `deepspeed` ZeRO."""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage for the actor (3 for 14B); with backend = "torch" only the default is accepted."""
    zero_hpz_partition_size: int = Field(1, ge=1)
    """DeepSpeed ZeRO++ hierarchical partitioning (hpZ, ZeRO-3 only): each rank also keeps the parameters
    partitioned over this many ranks (one node's GPUs: cluster.gpus_per_node), so only the first gather of a
    parameter after each optimizer step crosses the network and the later ones stay inside the node. Costs
    2/this of the model's bytes per GPU; 1 = off. `rstar2 plan` compares both (its `collectives`)."""
    seed: int = 0
    """Seed of prompt sampling, rollout sampling and resampling."""
    max_infra_failure_share: float = Field(0.1, ge=0.0, le=1.0)
    """A step in which more than this share of trajectories failed for infrastructure reasons (an engine
    request failed, the sandbox answered `internal` or failed, the grader timed out) raises
    InfraFailureShareExceeded (retryable: the stage resumes from its last checkpoint) instead of
    training on the remainder. 0.1: a healthy cluster sees ~0, while a dead engine or a saturated
    sandbox pool shows up as a large share at once; 1.0 only stops a step where every trajectory failed."""
    max_engine_logprob_gap: float = Field(0.1, gt=0.0)
    """The step fails (StaleEngineWeights, retryable) when the mean |engine - trainer| log-prob over
    sampled tokens (`actor/engine_logprob_gap`, logged every step with its max) exceeds this, i.e. the
    engines sample from other weights than the trainer holds. Measured here: HF engine or vLLM's CPU
    build vs the trainer, float32, ~1e-6 mean (docs/production.md); bf16 vLLM vs a bf16 trainer ~0.015
    (peers' reports); stale weights after a failed sync ~0.2 (TRL issue #5312)."""
    require_update: bool = True
    """A stage none of whose steps took an optimizer step (every group dropped: all rollouts wrong, all
    right, or too few valid) fails with StageTrainedNothing (not retried) instead of passing the
    unchanged policy on as trained. False accepts such a stage, with a warning: only for machinery
    checks at sizes that learn nothing (`make demo-quick`, the deployment e2e test)."""
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    """GRPO-RoC settings."""
    stages: list[RLStageConfig] = Field(min_length=1)
    """The RL stages in order; each starts from the previous one's weights."""

    @model_validator(mode="before")
    @classmethod
    def _count_by_default(cls, data: Any) -> Any:
        return default_micro_batch_count(data)

    @model_validator(mode="after")
    def _one_micro_batch_cut(self) -> RLConfig:
        check_one_cut("rl", self.micro_batch_size, self.max_tokens_per_micro_batch)
        if self.max_tokens_per_micro_batch is None:
            return self
        longest = max(st.max_response_tokens for st in self.stages)
        if self.max_tokens_per_micro_batch <= longest:
            raise ValueError(f"rl.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} cannot hold a "
                             f"trajectory at the longest stage's max_response_tokens={longest} and its prompt; "
                             f"raise it above {longest} (room for the prompt)")
        return self

    @model_validator(mode="after")
    def _stage_rules(self) -> RLConfig:
        for i, st in enumerate(self.stages):
            if not st.name:
                st.name = f"rl-stage-{i + 1}"
        if self.stages[0].dataset == "hard_subset":
            raise ValueError("rl.stages.0.dataset = \"hard_subset\" needs a previous stage's policy; "
                             "use \"curated\" for the first stage")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"rl.stages names must be unique, got {names}")
        if self.max_staleness and self.tis_cap is None:
            raise ValueError(f"rl.max_staleness = {self.max_staleness} trains on tokens sampled by weights up to "
                             f"{self.max_staleness} steps older than the trainer's: set rl.tis_cap (truncated importance "
                             "sampling, 2.0 is verl's default) or rl.max_staleness = 0")
        return self


