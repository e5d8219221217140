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
import json
import os
import subprocess
from pathlib import Path
from typing import Any
from unittest.mock import patch

from rstar2_cli.common import read_overrides_file

OVERLAY = Path(__file__).resolve().parents[1] / "configs" / "production-rehearsal.overrides"

ALLOWED: dict[str, str] = {
    "model.name_or_path": ("SmolLM2-135M-Instruct (what a package ships here) taught the recipe's answer format "
                           "(rehearsal_model.py) for Qwen3-14B-Base"),
    "model.dtype": "float32: vLLM's CPU build and CPU training",
    "cluster.nodes": "a local multi-node Ray cluster of 2 worker nodes for 8 machines",
    "cluster.gpus_per_node": "1 logical GPU per node for 8 MI300X",
    "cluster.logical_gpus": "the GPUs are logical: every actor computes on the CPU",
    "cluster.cpus_per_node": "a 2-core machine's share per node",
    "cluster.cpus_per_gpu": "a 2-core machine's share per GPU bundle",
    "cluster.ray_address": "the local cluster's address (endpoint)",
    "cluster.resources.*.num_cpus": "the stage tasks' CPU reservations on a small head",
    "rollout.num_engines": ("one engine (on node 0) for 32: with two, the engines, their vLLM processes and a weight "
                            "push do not fit beside two trainer ranks in 24 GB (measured: Ray OOM-killed them)"),
    "rollout.tensor_parallel_size": "one device per engine",
    "rollout.gpu_memory_utilization": "GPUs only (vLLM on CPU refuses it)",
    "rollout.kv_capacity_tokens": "the KV budget of a CPU engine",
    "rollout.max_batch_size": "requests per engine on 2 cores",
    "rollout.weight_sync": "object_store: CUDA IPC needs GPUs",
    "sandbox.workers": "tool processes on 2 cores",
    "sandbox.service.replicas": "two tool-service replicas on one tool node for 16-32 on eight",
    "sandbox.service.max_replicas": "no autoscaling: the tool node holds the two",
    "sandbox.service.cpus_per_replica": "a 2-core machine's share per replica",
    "sandbox.service.url": "the local tool service's HTTP address (endpoint)",
    "data.label_check.k": "samples per problem",
    "data.label_check.min_agree": "agreement needed of k = 2",
    "data.label_check.max_problems": "problems checked",
    "data.label_check.max_response_tokens": "sample length",
    "data.label_check.max_turns": "turns per sample",
    "sft.batch_size": "rows per optimizer step",
    "sft.max_tokens_per_micro_batch": "tokens per micro-batch (one row of the smaller max_seq_len)",
    "sft.max_seq_len": "row length",
    "sft.epochs": "passes",
    "sft.max_steps": "steps",
    "rl.prompts_per_step": "prompts per step",
    "rl.grpo.group_size": "rollouts kept per prompt (the oversampling factor stays)",
    "rl.max_tokens_per_micro_batch": "tokens per micro-batch (the shorter responses)",
    "rl.zero_hpz_partition_size": "a node of 1 logical GPU has no partition inside it (hpZ needs the node's GPUs)",
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
    return read_overrides_file(path)


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


REPLICA_KILL = "rl-stage-2:step=1:kill-sandbox"
"""The fault a rehearsal of a profile whose sandbox is the tool service injects (`RSTAR2_FAULT_INJECT` of
the flow run): one service replica SIGKILLed as RL stage 2's first step begins. Serve starts a replacement;
the calls the replica held are sent again (sandbox/remote.py), so the stage goes on and the run completes."""


def tool_service(cfg: Any) -> tuple[Any, list[str]] | None:
    """What the stack deploys the tool service from (ServiceStack's `tool_service`): the rehearsed `sandbox`
    section and the overlay, when the profile's sandbox is the tool service."""
    return (cfg.sandbox, overlay_overrides()) if cfg.sandbox.backend == "service" else None


def run_rehearsal(root: Path, timeout_s: float = 5400, log=print) -> dict:
    """The whole rehearsal: the production service stack (rehearsal_stack.py) started, `rehearse` on it,
    the stack stopped. Returns what `rehearse` returns, with the services' start-up seconds."""
    import time

    from rstar2_cli.rehearsal_stack import ServiceStack
    from rstar2_core.config import load_config

    cfg = load_config("qwen3-14b-mi300x", overlay_overrides())
    t0 = time.monotonic()
    with ServiceStack(root, cfg.cluster, tool_service=tool_service(cfg)) as stack:
        up = time.monotonic() - t0
        log(f"[rehearsal] services up in {up:.0f} s: Prefect {stack.prefect_api} (PostgreSQL), "
            f"MLflow {stack.tracking_uri} (PostgreSQL, artifacts on S3), S3 {stack.s3_endpoint}, Ray "
            f"{stack.cluster.address} ({cfg.cluster.nodes} worker nodes); logs in {stack.logs}")
        out = rehearse(stack, timeout_s, log)
    out["seconds"] = {"services": up, **out["seconds"], "total": time.monotonic() - t0}
    return out


def rehearse(stack: Any, timeout_s: float = 5400, log=print, deploy: bool = True) -> dict:
    """On a running `ServiceStack`: fill the stores (rehearsal_data.py), create the deployments on the
    `rstar2-cluster` pool (unless `deploy=False`: done already), run `rstar2/full-recipe` with profile
    qwen3-14b-mi300x, this overlay and the stack's endpoints, and watch it to its end; with the tool service,
    the run loses one replica (`REPLICA_KILL`). Returns the flow run's id, state and message, seconds per
    phase and per task run, the registered versions, the count of artifacts the MLflow server wrote to S3,
    the fault markers that fired, the tool service's replica actors before and after, the eval settings and
    the recipe's summary (the eval table), also written to `$RSTAR2_HOME/rehearsal/<flow run id>.json`."""
    import asyncio
    import time

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.client import start_run, watch
    from rstar2_cli.rehearsal_data import fill
    from rstar2_core import storage
    from rstar2_core.config import load_config
    from rstar2_core.config.root import resolve_state_dir

    overrides = [*overlay_overrides(), *stack.endpoint_overrides()]
    run_cfg = load_config("qwen3-14b-mi300x", overrides)
    times: dict[str, float] = {}
    t = time.monotonic()
    with patch.dict(os.environ, stack.s3_env()):   # the stores' credentials, restored after
        fill(run_cfg)
    storage.configure_s3()                      # the driver's S3 settings back to the environment's
    times["fill"] = time.monotonic() - t
    t = time.monotonic()
    deployed = stack.deploy() if deploy else []
    times["deploy"] = time.monotonic() - t
    log(f"[rehearsal] stores filled ({times['fill']:.0f} s), deployed {deployed} on the rstar2-cluster pool")
    service = stack.tool_service is not None
    before = stack.tools_status() if service else None
    env = {"RSTAR2_FAULT_INJECT": REPLICA_KILL} if service else None
    with temporary_settings({PREFECT_API_URL: stack.prefect_api}):
        t = time.monotonic()
        fid = asyncio.run(start_run("rstar2/full-recipe", {"profile": "qwen3-14b-mi300x", "overrides": overrides},
                                    env=env))
        log(f"[rehearsal] flow run {fid}: prefect deployment run rstar2/full-recipe -p profile=qwen3-14b-mi300x "
            f"(+ {len(overrides)} overrides{'; fault ' + REPLICA_KILL if env else ''}); the UI is at "
            f"{stack.prefect_api[:-4]}")
        state = asyncio.run(watch(fid, timeout_s=timeout_s))
        times["flow_run"] = time.monotonic() - t
        message, tasks = asyncio.run(_flow_run(fid))
    out = {"flow_run_id": str(fid), "state": state, "seconds": times, "task_seconds": tasks, "message": message}
    if service:
        try:
            after = stack.tools_status()
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:     # the run's report is written anyway
            after = {"status": f"unknown: {e}"}
        out["tool_service"] = {"fault": REPLICA_KILL, "replicas_before": before.get("replica_actors", []),
                               "replicas_after": after.get("replica_actors", []), "status_after": after["status"]}
    with patch.dict(os.environ, stack.s3_env()):   # the stores' credentials, restored after
        out.update(_results(run_cfg, str(fid), stack))
    storage.configure_s3()
    report = resolve_state_dir(None) / "rehearsal" / f"{fid}.json"     # kept after the stack stops
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(out, indent=2, default=str))
    log(f"[rehearsal] report: {report}")
    return out


async def _flow_run(fid: Any) -> tuple[str, dict[str, float]]:
    """The flow run's state message and the seconds of each task run of it and of its subflows (by name)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    async with get_client() as c:
        run = await c.read_flow_run(fid)
        subflows = await c.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[fid])))     # the recipe's stages subflow
        ids = [fid, *(r.id for r in subflows)]
        tasks = await c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
    seconds = {t.name: round(t.total_run_time.total_seconds(), 1) for t in
               sorted(tasks, key=lambda t: t.start_time or t.expected_start_time)}
    return run.state.message or "", seconds


def _results(cfg: Any, fid: str, stack: Any) -> dict:
    """The registered versions of this run, the artifacts the MLflow server wrote to S3, the summary."""
    import boto3
    from mlflow import MlflowClient

    from rstar2_core import storage
    from tasks.context import apply_storage_settings
    from tasks.run_store import RunStore

    client = MlflowClient(stack.tracking_uri)
    versions = [v for v in client.search_model_versions(f"name='{cfg.tracking.registered_model}'")
                if v.tags.get("rstar2.recipe_run_id") == fid]
    s3 = boto3.client("s3", endpoint_url=stack.s3_endpoint, **{k.lower(): v for k, v in stack.s3_env().items()
                                                               if k.startswith("AWS_") and "REGION" not in k},
                      region_name=cfg.storage.s3_region)
    listed = s3.list_objects_v2(Bucket="rstar2-mlflow", Prefix="artifacts/")
    apply_storage_settings(cfg)
    store = RunStore.for_run(cfg.resolved_storage_root(), fid)
    summary = store.load("summary")
    fs, path = storage.fs_for(store.root)
    return {"model_versions": [v.version for v in versions], "mlflow_artifacts_on_s3": listed.get("KeyCount", 0),
            "faults_fired": sorted(p.rsplit("/", 1)[1] for p in fs.glob(f"{path}/**/faults/*.fired")),
            "eval": {"benchmarks": {b.name: b.limit for b in cfg.eval.benchmarks}, "k": cfg.eval.k,
                     "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p},
            "summary": (summary or {}).get("markdown")}


def register(sub: Any) -> None:
    p = sub.add_parser("rehearsal", help="run the production profile, scaled down, through the production stack")
    p.add_argument("--root", default=None, help="state folder (default: a new /tmp/rstar2-reh-*; Ray's socket "
                                                "paths must stay short)")
    p.add_argument("--timeout-s", type=float, default=5400)
    p.set_defaults(func=_cli)


def _cli(args: Any) -> int:
    import json
    import signal
    import tempfile

    def interrupt(signum: int, frame: Any) -> None:     # Ctrl-C or a kill: unwind, so that the stack stops
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, interrupt)     # asyncio.run then leaves SIGINT to this handler
    signal.signal(signal.SIGTERM, interrupt)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="rstar2-reh-", dir="/tmp"))
    res = run_rehearsal(root, args.timeout_s)
    if res.get("summary"):
        print(res["summary"])
    print(json.dumps({k: v for k, v in res.items() if k != "summary"}, default=str))
    return 0 if res["state"] == "Completed" else 1
