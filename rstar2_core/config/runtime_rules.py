"""Cross-field rules of the runtime seam: which settings each runtime honours.

A setting the chosen runtime (`cluster.runtime`) would not honour is refused at load time with the
field path and what to set instead, never silently ignored. `runtime_problems(cfg)` returns the list;
`Config` raises them together (pydantic then prefixes nothing: the messages name their own fields).
"""

from __future__ import annotations

from typing import Any

STAGE_TASKS = ("sft", "rl", "hard_subset", "eval")
"""Pipeline tasks that drive a stage through a runtime (their actors hold the GPUs)."""


def runtime_tasks(cfg: Any) -> tuple[str, ...]:
    """The task kinds that drive a runtime in this config: the stage tasks, and curation when its label
    check samples a model (`data.label_check.enabled`). On the Ray runtime each holds the cluster's one
    runtime slot while it runs, so a label check never competes with SFT for the GPUs."""
    return STAGE_TASKS + (("curate",) if cfg.data.label_check.enabled else ())


def computes_on_gpu(cluster: Any) -> bool:
    """Whether the Ray runtime's engines and trainer shards compute on GPUs: the nodes have GPUs and they
    are not logical ones (`cluster.logical_gpus`, the CPU rehearsal of a GPU layout)."""
    return bool(cluster.gpus_per_node) and not cluster.logical_gpus


def is_node_local(root: str | None) -> bool:
    """Whether a storage root is a local file system path (`file://...`, a bare path, or None: the
    default file://<state dir>/artifacts), as opposed to an object store every node reaches."""
    return root is None or "://" not in root or root.startswith(("file:", "local:"))


def resolved_weight_sync(cfg: Any) -> str:
    """`rollout.weight_sync` with `auto` resolved for the runtime, engine and layout."""
    ws = cfg.rollout.weight_sync
    if ws != "auto":
        return ws
    if cfg.cluster.runtime == "local":
        return "state_dict"
    if cfg.rollout.engine == "vllm" and computes_on_gpu(cfg.cluster):
        return "ipc" if cfg.cluster.layout == "colocated" else "nccl"
    return "object_store"


def runtime_problems(cfg: Any) -> list[str]:
    cl, ro, p = cfg.cluster, cfg.rollout, []
    ws = resolved_weight_sync(cfg)
    if ro.engine == "hf":
        if ro.tensor_parallel_size != 1:
            p.append(f"rollout.tensor_parallel_size = {ro.tensor_parallel_size}: the HF engine has no tensor "
                     "parallelism; set it to 1 or use rollout.engine = \"vllm\"")
        if ro.gpu_memory_utilization is not None:
            p.append("rollout.gpu_memory_utilization applies to vLLM engines only; the HF engine's KV cache is "
                     "rollout.max_batch_size slots of the maximum length (or rollout.kv_capacity_tokens): remove it")
        if ro.release_memory_during_training:
            p.append("rollout.release_memory_during_training needs vLLM's sleep mode (rollout.engine = \"vllm\"); "
                     "set it to false")
    if ro.engine == "vllm" and cfg.model.kind == "tiny":
        t = cfg.model.tiny
        head = t.head_dim or t.hidden_size // t.num_heads
        if not 32 <= head <= 256:
            how = (f"model.tiny.head_dim {t.head_dim}" if t.head_dim else
                   f"model.tiny.hidden_size {t.hidden_size} / num_heads {t.num_heads}")
            p.append(f"rollout.engine = \"vllm\" cannot serve the tiny model's head size {head} ({how}): vLLM's "
                     "attention takes 32 to 256; set model.tiny.head_dim in that range")
    if ws in ("nccl", "ipc") and (ro.engine != "vllm" or not computes_on_gpu(cl)):
        p.append(f"rollout.weight_sync = \"{ws}\" is vLLM's GPU weight transfer: it needs rollout.engine = \"vllm\" "
                 "and cluster.gpus_per_node > 0 with real GPUs (cluster.logical_gpus = false); use \"object_store\" "
                 "or \"checkpoint\"")
    for section in ("rl", "sft"):
        sec = getattr(cfg, section)
        if sec.backend == "torch" and sec.zero_stage != type(sec).model_fields["zero_stage"].default:
            p.append(f"{section}.zero_stage = {sec.zero_stage} applies to {section}.backend = \"deepspeed\"; the torch "
                     f"backend has no ZeRO: remove it or set {section}.backend = \"deepspeed\"")
        hpz = sec.zero_hpz_partition_size
        if hpz > 1 and (sec.backend != "deepspeed" or sec.zero_stage != 3):
            p.append(f"{section}.zero_hpz_partition_size = {hpz} is ZeRO++ hpZ, a DeepSpeed ZeRO-3 feature: set "
                     f"{section}.backend = \"deepspeed\" and {section}.zero_stage = 3, or remove it")
        elif hpz > 1 and cl.gpus_per_node and (cl.gpus_per_node % hpz or hpz > cl.gpus_per_node):
            p.append(f"{section}.zero_hpz_partition_size = {hpz} must divide cluster.gpus_per_node = "
                     f"{cl.gpus_per_node} (a secondary partition stays inside one node); set it to {cl.gpus_per_node}")
        elif hpz > 1 and cl.layout == "separate" and cl.trainer_gpus % hpz:
            p.append(f"{section}.zero_hpz_partition_size = {hpz} must divide the trainer ranks (cluster.trainer_gpus = "
                     f"{cl.trainer_gpus}); set cluster.trainer_gpus to a multiple of it, or {section}.zero_hpz_partition_size = 1")
    if cfg.rl.max_staleness and ro.release_memory_during_training:
        p.append(f"rl.max_staleness = {cfg.rl.max_staleness} keeps the engines rolling out while the trainer steps, "
                 "so they cannot release their memory to it: set rollout.release_memory_during_training = false "
                 "or rl.max_staleness = 0")
    if ws == "checkpoint" and cfg.rl.checkpoint_every != 1:
        p.append(f"rollout.weight_sync = \"checkpoint\" reloads the checkpoint each step publishes, but "
                 f"rl.checkpoint_every = {cfg.rl.checkpoint_every}: set rl.checkpoint_every = 1")
    if ro.kv_capacity_tokens:
        budgets = {f"rl.stages.{i}.max_response_tokens": st.max_response_tokens for i, st in enumerate(cfg.rl.stages)}
        budgets["eval.max_tokens"] = cfg.eval.max_tokens
        if cfg.data.label_check.enabled:
            budgets["data.label_check.max_response_tokens"] = (cfg.data.label_check.max_response_tokens
                                                               or cfg.eval.max_tokens)
        name, longest = max(budgets.items(), key=lambda kv: kv[1])
        if ro.kv_capacity_tokens <= longest:
            p.append(f"rollout.kv_capacity_tokens = {ro.kv_capacity_tokens} cannot hold one sequence of {name} = "
                     f"{longest} response tokens and its prompt: raise it above that (an engine's sequences are "
                     "prompt + response), or set 0 to size the cache from rollout.max_batch_size")
    if cl.logical_gpus and not cl.gpus_per_node:
        p.append("cluster.logical_gpus = true needs cluster.gpus_per_node > 0 (the logical GPUs each node offers); "
                 "set it, or cluster.logical_gpus = false")
    if not cl.use_ray and cl.resources:
        p.append(f"cluster.resources sets per-task Ray reservations ({', '.join(sorted(cl.resources))}), but "
                 "cluster.use_ray = false runs every task as a thread of the flow process, where nothing reserves "
                 "or limits them: set cluster.use_ray = true, or drop them with the override cluster.resources={}")
    if cl.runtime == "local":
        p += _local_problems(cfg, ws)
    else:
        p += _ray_problems(cfg, ws)
    return p


def _local_problems(cfg: Any, ws: str) -> list[str]:
    cl, p = cfg.cluster, []
    if ws in ("object_store", "nccl", "ipc"):
        p.append(f"rollout.weight_sync = \"{ws}\" needs cluster.runtime = \"ray\"; the local runtime copies "
                 "weights in process (\"state_dict\") or reloads a checkpoint (\"checkpoint\")")
    if cl.trainer_ranks > 1:
        p.append(f"cluster.trainer_ranks = {cl.trainer_ranks}: the local runtime trains in one process; set "
                 "cluster.runtime = \"ray\" for several ranks, or cluster.trainer_ranks = 0")
    if cl.layout == "separate" or cl.trainer_gpus:
        p.append("cluster.layout = \"separate\" / cluster.trainer_gpus place actors on a cluster; the local runtime "
                 "has none: set cluster.runtime = \"ray\" or remove them")
    if cfg.rollout.release_memory_during_training:
        p.append("rollout.release_memory_during_training applies to colocated engine actors (cluster.runtime = "
                 "\"ray\", cluster.layout = \"colocated\"); set it to false")
    if cfg.sandbox.ray_actors_per_node and cfg.sandbox.backend != "ray":
        p.append("sandbox.ray_actors_per_node applies to sandbox.backend = \"ray\"; remove it or set the backend")
    return p


def _ray_problems(cfg: Any, ws: str) -> list[str]:
    cl, ro, p = cfg.cluster, cfg.rollout, []
    for section in ("rl", "sft"):
        backend = getattr(cfg, section).backend
        if backend != "deepspeed":
            p.append(f"{section}.backend = \"{backend}\": the Ray runtime's trainer shards are DeepSpeed ZeRO ranks; "
                     f"set {section}.backend = \"deepspeed\" (zero_stage 2 or 3), or cluster.runtime = \"local\"")
    if ws == "state_dict":
        p.append("rollout.weight_sync = \"state_dict\" is the local runtime's in-process copy; on Ray use "
                 "\"object_store\", \"checkpoint\", or for vLLM \"nccl\"/\"ipc\" (or \"auto\")")
    if ws == "ipc" and cl.layout != "colocated":
        p.append("rollout.weight_sync = \"ipc\" hands CUDA-IPC handles to an engine on the same GPU: it needs "
                 "cluster.layout = \"colocated\"; use \"nccl\" for the separate layout")
    if ws == "nccl" and cl.layout == "colocated":
        p.append("rollout.weight_sync = \"nccl\" cannot broadcast between a trainer rank and an engine worker on the "
                 "same GPU (one NCCL rank per device): use \"ipc\" with cluster.layout = \"colocated\"")
    if cfg.sandbox.ray_actors_per_node and cfg.sandbox.backend != "ray":
        p.append(f"sandbox.ray_actors_per_node applies to sandbox.backend = \"ray\" (the actor pool), not "
                 f"\"{cfg.sandbox.backend}\"; remove it or set the backend")
    if cfg.sandbox.backend == "local":
        p.append("sandbox.backend = \"local\": the Ray runtime runs the sandbox as actors on the layout's CPU bundles "
                 "(\"ray\") or calls the tool service on CPU nodes of its own (\"service\"); set one of them")
    if ro.release_memory_during_training and (ro.engine != "vllm" or cl.layout != "colocated"):
        p.append("rollout.release_memory_during_training needs vLLM engines in cluster.layout = \"colocated\"")
    if ro.release_memory_during_training and not computes_on_gpu(cl):
        p.append("rollout.release_memory_during_training is vLLM's sleep mode, which exists on CUDA and ROCm only: a "
                 "CPU-only cluster (cluster.gpus_per_node = 0 or cluster.logical_gpus) has none; set it to false")
    if not computes_on_gpu(cl) and cfg.model.attention_kernel == "flex":
        p.append("model.attention_kernel = \"flex\" on a CPU-only cluster (cluster.gpus_per_node = 0 or "
                 "cluster.logical_gpus): torch's FlexAttention has no backward on the CPU; set "
                 "model.attention_kernel = \"auto\" or \"segments\"")
    if computes_on_gpu(cl) and cfg.model.dtype == "float32":
        p.append("model.dtype = \"float32\" on GPU nodes: the Ray runtime's ZeRO ranks train in bf16 there (what the "
                 "memory plan sizes); set model.dtype = \"bfloat16\"")
    if not computes_on_gpu(cl) and cfg.model.dtype != "float32":
        p.append(f"model.dtype = \"{cfg.model.dtype}\" on a CPU-only cluster (cluster.gpus_per_node = 0 or "
                 "cluster.logical_gpus): DeepSpeed trains bf16/fp16 only on GPUs; set model.dtype = \"float32\"")
    if cl.logical_gpus and ro.tensor_parallel_size != 1:
        p.append(f"rollout.tensor_parallel_size = {ro.tensor_parallel_size} with cluster.logical_gpus: an engine on "
                 "logical GPUs computes on the CPU in one process; set rollout.tensor_parallel_size = 1")
    if cl.nodes > 1 and is_node_local(cfg.storage.root) and not cfg.storage.shared_filesystem:
        p.append(f"storage.root = {cfg.storage.root or '(default file://<state dir>/artifacts)'} on a {cl.nodes}-node "
                 "Ray runtime (cluster.nodes): trainer ranks on other nodes write checkpoint shards there, and a "
                 "node-local disk leaves the driver an incomplete checkpoint; use an s3:// storage.root, or set "
                 "storage.shared_filesystem = true when every node mounts it at the same path")
    if cl.gpus_per_node and cl.trainer_ranks:
        want = cl.nodes * cl.gpus_per_node if cl.layout == "colocated" else cl.trainer_gpus
        if cl.trainer_ranks != want:
            p.append(f"cluster.trainer_ranks = {cl.trainer_ranks} but the {cl.layout} layout has {want} trainer GPUs; "
                     "set cluster.trainer_ranks = 0 (one rank per trainer GPU)")
    for kind in runtime_tasks(cfg):
        r = cl.resources.get(kind)
        if r is not None and r.num_gpus:
            p.append(f"cluster.resources.{kind}.num_gpus = {r.num_gpus:g}: with cluster.runtime = \"ray\" the {kind} "
                     "task only drives its actors, which get their GPUs from the layout's placement groups; a GPU "
                     f"held by the task would sit idle and starve the layout: set cluster.resources.{kind}.num_gpus = 0")
    return p
