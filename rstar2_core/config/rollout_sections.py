"""Sections of the config tree for rollout: `[sandbox]` (the Python tool service) and `[rollout]`
(engines, scheduler, tool-response rendering, weight sync).

Invariant: every field has exactly one docstring, the setting's public documentation (validation errors
quote it); `IsolationProperty` names exactly rstar2_core/sandbox/properties.py's PROPERTIES (a test
checks). See docs/sandbox.md and docs/rollout.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rstar2_core.config.base import _Section

# ------------------------------------------------------------------------------------------- sandbox
IsolationProperty = Literal["minimal_root", "no_capabilities", "private_tmp", "own_proc", "pid_namespace",
                           "no_network", "private_abstract_sockets", "private_ipc", "seccomp", "per_call_uid"]
"""The names of rstar2_core/sandbox/properties.py's PROPERTIES (a test keeps the two equal)."""
_NO_NAMESPACE_LOSS = ("minimal_root", "private_tmp", "own_proc", "pid_namespace", "no_network",
                      "private_abstract_sockets", "private_ipc")


class ToolServiceConfig(_Section):
    """The tool service (`sandbox.backend = "service"`): the sandbox served by Ray Serve on CPU nodes of its
    own, reached in-cluster through a Serve handle and from elsewhere over HTTP (docs/sandbox.md, "The tool
    service"). Everything else about a call (limits, isolation, workers) is the enclosing `[sandbox]`."""

    url: str = ""
    """HTTP address of the service's API, e.g. `http://rstar2-tools.rstar2.svc:8000/sandbox`, for callers
    not connected to its Ray cluster. Empty: callers must reach it through the Ray cluster (`connect`)."""
    app_name: str = "rstar2-tools"
    """The Ray Serve application's name: `rstar2 tools deploy` creates it, the in-cluster handle looks it up."""
    route_prefix: str = "/sandbox"
    """The HTTP path under which `rstar2 tools deploy` serves the API (`url` ends with it)."""
    connect: Literal["auto", "handle", "http"] = "auto"
    """`handle`: Ray Serve's in-cluster handle (Ray's own transport, no HTTP; the caller must be connected
    to the service's Ray cluster). `http`: `url`. `auto`: the handle when this process is connected to a Ray
    cluster that runs the application, else `url`."""
    replicas: int = Field(2, ge=1)
    """Replicas at deploy (the minimum when `max_replicas` autoscales)."""
    max_replicas: int = Field(0, ge=0)
    """Autoscaling ceiling: Ray Serve adds replicas while requests queued and running per replica exceed
    `target_ongoing_requests`. 0 = a fixed `replicas`."""
    target_ongoing_requests: float = Field(2.0, gt=0)
    """Requests (a batch counts once) per replica that autoscaling aims at."""
    max_ongoing_requests: int = Field(64, ge=1)
    """Requests one replica takes at once; more wait in Serve's router (the queue autoscaling reads)."""
    cpus_per_replica: float = Field(4.0, gt=0)
    """CPUs each replica reserves in Ray; its sandbox runs `sandbox.workers` calls at once (0 = two per
    reserved CPU, at least 2)."""
    node_resource: str = ""
    """A custom Ray resource each replica needs one unit of, declared only by the tool nodes' `ray start
    --resources` (infra/k8s/raycluster.yaml declares `rstar2_tools`): keeps replicas off the GPU nodes.
    Empty: any node with free CPUs."""
    max_code_chars: int = Field(100_000, ge=1)
    """Longest `code` (and `stdin`) the API accepts; longer is refused with HTTP 413 before a sandbox sees it."""
    max_batch: int = Field(1024, ge=1)
    """Most calls in one `run_batch` request; more is refused with HTTP 413. Clients split larger batches."""
    ready_timeout_s: float = Field(10.0, gt=0)
    """How long a stage waits at its start for the service's health answer before failing with a named,
    retryable error."""
    call_retries: int = Field(2, ge=0)
    """A batch lost with a replica (dead actor, HTTP 5xx, a dropped connection) is sent again up to this
    many times; calls that still fail answer status `internal`, the service's fault, never the program's."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Client-side limit for one request (a batch waits in the service's queue, then runs)."""

    @model_validator(mode="after")
    def _autoscaling_range(self) -> ToolServiceConfig:
        if 0 < self.max_replicas < self.replicas:
            raise ValueError(f"sandbox.service.max_replicas = {self.max_replicas} is below sandbox.service.replicas = "
                             f"{self.replicas} (the autoscaling floor): set max_replicas >= replicas to autoscale "
                             "between the two, or max_replicas = 0 for a fixed count")
        return self


class SandboxConfig(_Section):
    backend: Literal["local", "ray", "service"] = "local"
    """`local`: forked workers on this host. `ray`: an actor pool over every node's CPUs (on the GPU
    nodes' placement groups under the Ray runtime). `service`: the tool service on CPU nodes of its own
    (`sandbox.service`), deployed once with `rstar2 tools deploy`."""
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
    """Isolation properties (docs/sandbox-isolation.md, "What is isolated") the service may start without. Default
    none: a service whose calls would lack any property refuses to start (SandboxError naming them and
    why), rather than running the model's code with less confinement than documented. Name a property
    here only on a host that cannot provide it and where what it guards is acceptable to lose, e.g.
    `["per_call_uid", "own_proc"]` when not root; the service then starts and logs a WARNING with the
    missing ones. `network = "host"` needs no_network and private_abstract_sockets here, `namespaces =
    false` also minimal_root, private_tmp, own_proc, pid_namespace and private_ipc."""

    service: ToolServiceConfig = Field(default_factory=ToolServiceConfig)
    """The tool service's deployment and how callers reach it (`backend = "service"`)."""

    @model_validator(mode="after")
    def _service_settings_need_the_service(self) -> SandboxConfig:
        if self.backend != "service" and self.service != ToolServiceConfig():
            raise ValueError(f"sandbox.service is set but sandbox.backend = \"{self.backend}\" does not use it: set "
                             "sandbox.backend = \"service\" or remove the sandbox.service settings")
        if self.backend == "service" and self.service.connect == "http" and not self.service.url:
            raise ValueError("sandbox.service.connect = \"http\" needs sandbox.service.url (the API's address, e.g. "
                             "http://rstar2-tools:8000/sandbox)")
        return self

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
    would not, and refills as trajectories finish (docs/rollout-scheduling.md, "KV admission"); `static` fixes
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
    or what gpu_memory_utilization leaves (vLLM on GPUs). Set, it must exceed the longest response budget
    (RL stages, eval, label check), refused at load; the exact need (+ the longest prompt) is checked when
    an engine starts."""
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
    ~29.5 GB per node per step for 14B, one object: any size the node's store holds, `rstar2 plan --address`
    checks; a vLLM engine takes it in 64 MiB messages). `checkpoint`: engines reload the checkpoint the step just
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
    vLLM's sleep mode is unreliable on ROCm; off = engines keep
    rollout.gpu_memory_utilization of the GPU throughout and the trainer lives in the rest."""

    @model_validator(mode="after")
    def _affinity_needs_kv_aware(self) -> RolloutConfig:
        if self.group_affinity and self.scheduler != "kv_aware":
            raise ValueError('group_affinity applies to scheduler = "kv_aware" only (static allocation cuts the '
                             'batch into fixed chunks); set scheduler = "kv_aware" or group_affinity = false')
        return self
