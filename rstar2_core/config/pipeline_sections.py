"""Sections of the config tree for where and how the recipe runs: `[eval]`, `[tracking]`, `[storage]`,
`[cluster]` and `[pipeline]`.

Invariant: every field has exactly one docstring, the setting's public documentation (validation errors
quote it); `TASK_KINDS` are the keys `cluster.resources` accepts and must match the task kinds
tasks/runners.py submits. See docs/pipeline.md and docs/cluster.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rstar2_core.config.base import _Section


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
    outage_retry_s: float = Field(120.0, ge=0)
    """How long a read or write waits out a store that does not answer (connection refused or reset, a
    timeout; after the S3 client's own few retries), retrying with backoff (0.5 s doubling to 8 s), before
    it raises `StoreUnavailable` (retryable: the stage's retry resumes from its last complete checkpoint).
    Trade-off: longer rides out a longer outage without restarting the stage (minutes of engine and
    trainer start-up at 14B), but a store that is really gone is reported that much later. 0 = no wait."""
    shared_filesystem: bool = False
    """A local root (`file://` or a path) is one file system that every Ray node mounts at the same path
    (NFS, Lustre, or one machine: the local multi-node rehearsal, `rstar2 cluster up`). On a multi-node Ray
    runtime (`cluster.nodes > 1`, or a live cluster of several nodes) a local root is refused unless this
    is true: trainer ranks on other nodes
    write their checkpoint shards straight to storage, and on node-local disks the driver would find an
    incomplete checkpoint. S3 needs nothing. Trade-off: true trusts the operator about the mounts."""
    node_cache_max_gb: float | None = Field(200.0, gt=0)
    """GB (1e9 bytes) of remote checkpoints each machine keeps in its cache (`$RSTAR2_HOME/cache`: the base
    model and each stage's checkpoint its engines, trainer ranks and evaluations read; weight sync's step
    checkpoints are read from the store, not cached). Before a download would pass it, the least recently
    used complete checkpoints are removed, never one a process is reading. None = no bound. Default 200:
    six Qwen3-14B checkpoints (29.5 GB each). Trade-off: lower saves node disk, but an evicted checkpoint
    read again is downloaded again; it must exceed the largest checkpoint (a smaller one is refused when
    that download starts)."""


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
    the RL driver's CPUs, goes to the sandbox actors (rstar2_core/runtime/layout.py). The trainer shard
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
    loading its model from the node's disk (vLLM: and profiling memory), so raise this when engines load
    slowly; the download of a remote model to each node is bounded by `model_download_timeout_s` instead."""
    model_download_timeout_s: float = Field(1800.0, gt=0)
    """Seconds a runtime waits, once its placement groups exist and before it starts any actor, for every
    node that runs trainer shards or engines to hold the remote policy checkpoint in its cache (one task per
    node downloads it under the node's lock; a node that has it is done at once). Past it the runtime stops
    and raises ModelDownloadTimeout (retryable) naming each late node and the bytes that arrived; the
    retry downloads again from the start. Default 1800: 29.5 GB (Qwen3-14B) at ~16 MB/s per node.
    Trade-off: longer rides out a slow store, but a stuck download holds the cluster's placement groups idle
    that much longer."""
    node_death_wait_s: float = Field(60.0, ge=0)
    """When an actor call fails as a vanished node's would (the connection dropped), how long the runtime
    waits for Ray to declare the node dead before it names the failure: Ray's verdict comes after its health
    check (`health_check_period_ms` x `health_check_failure_threshold`, ~15 s by default), the call fails
    within seconds. Found dead: `NodeLost` naming the node and the actors it held; not by then: the plain
    `ActorFailure`. Both are retryable. Trade-off: longer names more losses correctly on a cluster with a
    slower health check, and delays the stage's failure (and its retry) by up to this much. 0 = check once."""
    logical_gpus: bool = False
    """The cluster's GPUs are logical Ray resources on CPU nodes (`ray start --num-gpus=N` without GPUs: the
    local multi-node rehearsal, `rstar2 cluster up`). The layout, placement groups and every actor's place
    are the GPU layout's (`gpus_per_node` GPU bundles per node), but engines and trainer shards compute on
    the CPU (gloo, float32, HF or vLLM's CPU build, TP 1). False on a real GPU cluster, where an actor that
    sees no GPU fails instead of silently running on the CPU."""
    gpu_memory_gb: float | None = Field(None, gt=0)
    """Memory of one GPU in GiB, as torch reports it (`torch.cuda.get_device_properties(0).total_memory /
    2**30`: MI300X 192, H100 79.6, H200 139.8). `rstar2 plan` and preflight size every GPU's peak against it
    (rstar2_core/runtime/gpu_memory.py) and refuse a profile that does not fit; None on GPU nodes = the
    check is skipped, and plan says so."""
    inter_node_gb_per_s: float | None = Field(None, gt=0)
    """Bandwidth one GPU gets to other nodes in GB/s (its NIC: 400 Gb/s RoCE/InfiniBand = 50), as the
    operator states it: `rstar2 plan` turns each RL update's and SFT step's collective bytes into
    seconds with it (rstar2_core/runtime/collectives.py). None = bytes only."""
    intra_node_gb_per_s: float | None = Field(None, gt=0)
    """Bandwidth between GPUs of one node in GB/s per GPU (MI300X Infinity Fabric: 7 links x 64 = 448;
    H100 NVLink: 450), as the operator states it: prices the collectives that stay inside a node (ZeRO++
    hpZ's gathers). None = bytes only."""
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
