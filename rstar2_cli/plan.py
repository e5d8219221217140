"""`rstar2 plan --profile qwen3-14b-mi300x`: the production dry run, without GPUs or a cluster.

    rstar2 plan --profile qwen3-14b-mi300x            # human-readable; exit 0 when no problem
    rstar2 plan --profile tiny --json                 # one JSON object
    rstar2 plan --profile qwen3-14b-mi300x --strict   # exit 1 when a problem is found
    rstar2 plan --address 127.0.0.1:6379 ...          # and whether the layout fits that live cluster

Validates the profile, the RL actor layout, the RL driver's reservation and, with `cluster.image`, that
infra/ describes the same cluster; a config that does not validate exits 2 with the field to change.
Invariant: the DAG mirrors flows/full_recipe.py (same task kinds and run names; tests/unit/infra/test_plan.py).
See docs/production.md, "Dry run: `rstar2 plan`".
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rstar2_cli.common import add_profile_args, load
from rstar2_cli.plan_infra import INFRA, WORK_POOL, infra_problems

__all__ = ["INFRA", "WORK_POOL", "build_plan", "infra_problems", "recipe_dag", "register"]


@dataclass(frozen=True)
class PlanTask:
    name: str
    kind: str          # key of cfg.cluster.resources (tasks/runners.py TASK_KINDS)
    label: str         # the Prefect task run name
    deps: tuple[str, ...]
    num_cpus: float
    num_gpus: float
    runtime_slot: bool = False   # asks for the cluster's one `rstar2_runtime` unit (cluster.runtime = "ray")


def recipe_dag(cfg: Any) -> list[PlanTask]:
    """The full recipe's tasks in submission order, with dependencies and Ray resources."""
    out: list[PlanTask] = []

    from rstar2_core.config.runtime_rules import runtime_tasks

    def add(name: str, kind: str, label: str, *deps: str) -> str:
        r = cfg.cluster.resources.get(kind)
        out.append(PlanTask(name, kind, label, tuple(deps), float(r.num_cpus) if r else 1.0,
                            float(r.num_gpus) if r else 0.0, cfg.cluster.runtime == "ray" and kind in runtime_tasks(cfg)))
        return name

    from tasks.context import stage_label

    eval_stages = cfg.pipeline.eval_stages
    curated = add("curate", "curate", "curate")
    sft_data = add("sft-data", "sft_data", "sft-data")
    base = add("base-model", "base_model", f"base-model ({cfg.model.kind})")
    policy = add("sft", "sft", f"sft ({cfg.sft.epochs:g} epochs)", base, sft_data)
    evals = [add("eval-sft", "eval", "eval sft", policy)]  # always: the promotion baseline
    last = len(cfg.rl.stages) - 1
    for i, st in enumerate(cfg.rl.stages):
        data = curated
        if st.dataset == "hard_subset":
            data = add(f"{st.name}-hard-subset", "hard_subset", f"{st.name} hard subset (k={st.hard_subset_k})",
                       policy, curated)
        policy = add(st.name, "rl", stage_label(cfg, i), policy, data)
        if eval_stages != "last" or i == last:
            evals.append(add(f"eval-{st.name}", "eval", f"eval {st.name}", policy))
    add("register", "register", "register best", *evals)
    return out


# ------------------------------------------------------------------------------------------- output
def cluster_fit(cfg: Any, layout: Any, nodes: list) -> tuple[list[str], list[str]]:
    """(lines, problems) of the layout against a live cluster's nodes: whether its placement groups fit the
    nodes' resources (and fit what is free now), and, for the Ray runtime, whether a node offers the
    `rstar2_runtime` unit with the CPUs of the task that drives the RL stage."""
    from rstar2_core.runtime.layout import describe_nodes, fit_layout
    from rstar2_core.runtime.ray.connect import RUNTIME_RESOURCE

    fit, now = fit_layout(layout, nodes), fit_layout(layout, nodes, free_only=True)
    lines = [f"live cluster: {len(nodes)} node(s)"] + [f"  {x}" for x in describe_nodes(nodes)]
    problems = list(fit.problems)
    if fit.fits:
        lines.append("  the layout fits: " + ", ".join(f"{k} -> {v}" for k, v in fit.placement.items()))
        lines.append("  and fits what is free now" if now.fits else
                     "  but not what is free now (another job holds resources): " + " ".join(now.problems))
    else:
        lines.append("  the layout does NOT fit this cluster")
    if cfg.cluster.runtime == "ray":
        driver = cfg.cluster.resources.get("rl")
        cpus = float(driver.num_cpus) if driver is not None else 1.0
        slot = [n for n in nodes if n.total.get(RUNTIME_RESOURCE, 0) >= 1]
        if not slot:
            problems.append(f"no live node offers the {RUNTIME_RESOURCE} resource the stage tasks ask for: start the "
                            f"head with --resources='{{\"{RUNTIME_RESOURCE}\": 1}}'")
        elif not any(n.total.get("CPU", 0) >= cpus for n in slot):
            problems.append(f"the node with {RUNTIME_RESOURCE} has fewer than the {cpus:g} CPUs of the RL task "
                            "(cluster.resources.rl.num_cpus)")
    return lines, problems


ASSUMED_DECODE_TOKENS_PER_S_PER_GPU = 1500.0
"""Generated tokens per second per engine GPU that the label check's time estimate assumes: an assumption,
not a measurement of this project (peers report ~1.1-2.2K tokens/s/GPU for whole RL steps of 8B models on
H100s; a figure from outside the repo, not checked here); the estimate is an upper bound on tokens and a
rough guide to hours."""


def label_check_cost(cfg: Any) -> dict | None:
    """The label check's budget as `rstar2 plan` prints it: problems (None: every curated one), samples,
    tokens and turns per sample, the generated-token upper bound and hours at the assumed rate on the
    runtime's engine GPUs; None when the check is off."""
    lc = cfg.data.label_check
    if not lc.enabled:
        return None
    tokens, turns = lc.max_response_tokens or cfg.eval.max_tokens, lc.max_turns or cfg.eval.max_turns
    gpus = max(1, cfg.rollout.num_engines * cfg.rollout.tensor_parallel_size)
    total = lc.max_problems * lc.k * tokens if lc.max_problems else None
    hours = total / (ASSUMED_DECODE_TOKENS_PER_S_PER_GPU * gpus) / 3600 if total else None
    return {"problems": lc.max_problems, "k": lc.k, "max_response_tokens": tokens, "max_turns": turns,
            "max_generated_tokens": total, "engine_gpus": gpus, "hours_at_assumed_rate": hours}


RESULTS = INFRA.parent / "bench" / "results"
"""Where the committed benchmark JSONs are: the newest `*weight_sync*.json` gives `weight_push` its rates."""


def _model_config(cfg: Any, read_model: bool, model_config: str | None = None) -> tuple[dict | None, str]:
    """(the policy's config.json, where it came from or why it was not read); `model_config`: a local
    config.json given in its place (`--model-config`)."""
    from rstar2_core import storage
    from rstar2_core.config.runtime_rules import is_node_local

    if model_config:
        return json.loads(Path(model_config).read_text()), f"{model_config} (--model-config)"
    if cfg.model.kind != "hf":
        return None, f"model.kind = \"{cfg.model.kind}\" is built by the base-model task: its size is known then"
    url = storage.join(cfg.model.name_or_path, "config.json")
    if not (read_model or is_node_local(cfg.model.name_or_path)):
        return None, (f"not read: `rstar2 plan --read-model` reads {url} from the store, `--model-config FILE` "
                      "sizes it from a local config.json")
    try:
        return storage.read_json(url), url
    except Exception as e:  # noqa: BLE001 - any failure to read is reported, not fatal to the plan
        return None, f"{url} could not be read ({type(e).__name__}: {str(e)[:160]})"


def weight_push(cfg: Any, hf: dict | None, source: str) -> dict:
    """Bytes of one trainer -> engine weight push (the policy's parameters in model.dtype, from its
    config.json) and, per transport, the seconds one push would take at the rate the newest committed
    bench/weight_sync.py result measured (CPU rates: a GPU cluster's differ; nccl and ipc are unmeasured)."""
    from rstar2_core.config.runtime_rules import resolved_weight_sync
    from rstar2_core.models.param_count import param_bytes, param_count

    out: dict = {"weight_sync": resolved_weight_sync(cfg), "params": None, "bytes": None, "rates_from": None,
                 "seconds_at_measured_rate": {}, "source": source}
    if hf is not None:
        try:
            out["params"], out["bytes"] = param_count(hf), param_bytes(hf, cfg.model.dtype)
        except Exception as e:  # noqa: BLE001 - a config the count cannot read is reported, not fatal to the plan
            out["source"] += f"; its size is not computed here ({type(e).__name__}: {e})"
    found = sorted(RESULTS.glob("*weight_sync*.json"))
    if found and out["bytes"]:
        out["rates_from"] = str(found[-1].relative_to(INFRA.parent))
        for transport, r in json.loads(found[-1].read_text())["transports"].items():
            out["seconds_at_measured_rate"][transport] = out["bytes"] / (r["gb_per_s"] * 1e9)
    return out


def object_store_problems(push: dict, nodes: list) -> list[str]:
    """`object_store` puts one whole state dict in Ray's object store: a node whose store is smaller than
    a push cannot hold it (Ray spills to disk or fails the put)."""
    if push["weight_sync"] != "object_store" or not push["bytes"]:
        return []
    small = [n for n in nodes if 0 < n.total.get("object_store_memory", 0) < push["bytes"]]
    return [f"rollout.weight_sync = \"object_store\": a push is {push['bytes'] / 1e9:.1f} GB but {n.label}'s object "
            f"store holds {n.total['object_store_memory'] / 1e9:.1f} GB; use \"checkpoint\", or for vLLM \"nccl\"/"
            "\"ipc\"" for n in small]


def tool_service_plan(cfg: Any, nodes: list | None, address: str | None) -> tuple[dict, list[str] | None]:
    """Where the sandbox runs and what it holds (`tool_service` of the plan), and the problems of its
    checklist item (None: not checked). For `sandbox.backend = "service"`: replicas x CPUs on the nodes
    declaring `node_resource`; with a live cluster (`nodes`), those nodes exist, hold no GPU and have the
    CPUs; with `address`, the service answers its health check at `sandbox.service.url`."""
    sb, sc = cfg.sandbox, cfg.sandbox.service
    if sb.backend != "service":
        return {"backend": sb.backend, "on_gpu_nodes": sb.backend == "ray" and cfg.cluster.gpus_per_node > 0}, None
    workers = sb.workers or max(2, int(2 * sc.cpus_per_replica))
    top = max(sc.replicas, sc.max_replicas)
    out = {"backend": "service", "on_gpu_nodes": False, "app_name": sc.app_name, "url": sc.url,
           "replicas": sc.replicas, "max_replicas": top, "cpus_per_replica": sc.cpus_per_replica,
           "workers_per_replica": workers, "cpus": [sc.replicas * sc.cpus_per_replica, top * sc.cpus_per_replica],
           "concurrent_calls": [sc.replicas * workers, top * workers], "node_resource": sc.node_resource or None}
    if nodes is None:
        return out, None
    problems: list[str] = []
    if sc.node_resource:
        tools = [n for n in nodes if n.total.get(sc.node_resource, 0) >= 1]
        gpu_tools = [n.label for n in tools if n.total.get("GPU", 0) > 0]
        if not tools:
            problems.append(f"no live node declares sandbox.service.node_resource = {sc.node_resource!r}: the tool "
                            "service's replicas would stay pending; start the tool nodes with `ray start --resources "
                            f"'{{\"{sc.node_resource}\": 100}}'` (infra/k8s/raycluster.yaml, group tools)")
        if gpu_tools:
            problems.append(f"GPU node(s) {', '.join(gpu_tools)} declare {sc.node_resource!r}: tool service replicas "
                            "may land beside the GPUs; declare it on the CPU tool nodes only")
    else:
        tools = [n for n in nodes if n.total.get("GPU", 0) == 0] or list(nodes)
    cpus = sum(n.total.get("CPU", 0) for n in tools)
    if tools and cpus < sc.replicas * sc.cpus_per_replica:
        problems.append(f"the tool nodes hold {cpus:g} CPUs but sandbox.service.replicas = {sc.replicas} x "
                        f"cpus_per_replica = {sc.cpus_per_replica:g} need {sc.replicas * sc.cpus_per_replica:g}")
    out["tool_nodes"] = [n.label for n in tools]
    if address is not None and sc.url:      # its health over HTTP: no Ray connection of this process needed
        import urllib.request

        try:
            with urllib.request.urlopen(sc.url.rstrip("/") + "/health", timeout=10) as r:
                out["health"] = json.loads(r.read())
        except (OSError, ValueError) as e:
            problems.append(f"the tool service at sandbox.service.url = {sc.url} does not answer its health check "
                            f"({e}); deploy it with `rstar2 tools deploy` (docs/sandbox.md) or fix the URL")
    return out, problems


def build_plan(cfg: Any, nodes: list | None = None, read_model: bool = False, address: str | None = None,
               model_config: str | None = None) -> dict:
    """Everything `rstar2 plan` prints, as a JSON-able dict; `nodes`: a live cluster's nodes to fit the
    layout to (`--address`; with its `address`, also its devices); `model_config`: a local config.json sizing
    the policy (`--model-config`). Raises ConfigError when the layout cannot fit the config's cluster."""
    from rstar2_core.config import ConfigError
    from rstar2_core.runtime.cluster_plan import gpu_plan
    from rstar2_core.runtime.layout import LayoutError, compute_layout, driver_conflicts
    from rstar2_core.runtime.specs import gpu_plan_sections

    try:
        layout = compute_layout(cfg.cluster, cfg.rollout, cfg.sandbox)
    except LayoutError as e:
        raise ConfigError(f"actor layout of profile {cfg.profile}: {e}") from None
    checks: dict[str, list[str] | None] = {k: None for k in CHECKLIST}
    reasons: dict[str, str] = {}
    checks["layout"] = driver_conflicts(layout, cfg.cluster.resources.get("rl")) if cfg.cluster.runtime == "ray" else []
    if cfg.cluster.image:
        checks["infra"] = infra_problems(cfg)
    live: list[str] = []
    hf, source = _model_config(cfg, read_model, model_config)
    push = weight_push(cfg, hf, source)
    gpu = gpu_plan(**gpu_plan_sections(cfg), hf=hf, source=source)
    if "skipped" not in gpu["gpu_memory"]:
        checks["gpu_memory"] = gpu["problems"]
        checks["collectives"] = [] if gpu["collectives"]["update_seconds"] is not None else None
    if nodes is not None:
        live, fit = cluster_fit(cfg, layout, nodes)
        checks["live_cluster"] = fit + object_store_problems(push, nodes)
    tools, checks["tool_service"] = tool_service_plan(cfg, nodes, address)
    if tools["on_gpu_nodes"]:
        reasons["tool_service"] = ("sandbox.backend = \"ray\" runs the sandbox on the GPU nodes, whose pods then need "
                                   "its security context (docs/sandbox.md, \"The tool service\")")
    elif tools["backend"] != "service":
        reasons["tool_service"] = f"sandbox.backend = \"{tools['backend']}\": no tool service"
    if address is not None:
        from rstar2_core.runtime.ray.device_check import live_device_check

        more_lines, checks["devices"] = live_device_check(address, layout, nodes or [],
                                                          planned_gib=cfg.cluster.gpu_memory_gb)
        live += [f"  {x}" for x in more_lines]
        skipped = [x for x in more_lines if x.startswith("device check skipped")]
        if skipped and not checks["devices"]:
            checks["devices"], reasons["devices"] = None, skipped[0].split(": ", 1)[-1]
    return {"profile": cfg.profile, "image": cfg.cluster.image, "ray_address": cfg.cluster.ray_address,
            "tracking_uri": cfg.resolved_tracking_uri(), "storage_root": cfg.resolved_storage_root(),
            "dag": [asdict(t) for t in recipe_dag(cfg)], "layout": layout.to_json(),
            "layout_summary": layout.describe(), "live_cluster": live, "label_check": label_check_cost(cfg),
            "weight_push": push, "tool_service": tools, "gpu_memory": gpu["gpu_memory"], "collectives": gpu["collectives"],
            "checklist": checklist(checks, gpu, reasons), "problems": [p for v in checks.values() for p in v or []]}


CHECKLIST = {
    "layout": "the profile validates; the RL layout fits its cluster and the stage tasks' reservations",
    "gpu_memory": "every GPU's rollout, update and SFT peak fits cluster.gpu_memory_gb",
    "collectives": "each rank's collective traffic per RL update and SFT step is priced at the link speeds",
    "infra": "infra/ describes the profile's cluster (image, counts, URLs, runtime slot, RCCL's fabric, pull step)",
    "live_cluster": "the live Ray cluster holds the layout's placement groups (--address)",
    "devices": "every GPU actor binds a distinct device by identity on every node (--address)",
    "tool_service": "the tool service's replicas fit CPU nodes of their own, off the GPU nodes (--address: and it answers)",
}
"""The first cluster run's checklist as `rstar2 plan` checks it item by item (docs/first-cluster-run.md)."""


def checklist(checks: dict[str, list[str] | None], gpu: dict, reasons: dict[str, str]) -> list[dict]:
    """Each CHECKLIST item with its status: `ok`, `problem` (its problems listed) or `not checked` and why."""
    why = {"gpu_memory": gpu["gpu_memory"].get("skipped"),
           "collectives": gpu["collectives"].get("skipped") or "no cluster.inter_node_gb_per_s",
           "infra": "the profile has no cluster.image (local processes)",
           "live_cluster": "no --address", "devices": "no --address", "tool_service": "no --address", **reasons}
    out = []
    for key, what in CHECKLIST.items():
        found = checks[key]
        status = "not checked" if found is None else "problem" if found else "ok"
        out.append({"item": key, "what": what, "status": status, "problems": found or [],
                    "why_not_checked": why.get(key) if found is None else None})
    return out


def _fmt_res(t: dict) -> str:
    return (f"{t['num_cpus']:g} CPU" + (f", {t['num_gpus']:g} GPU" if t["num_gpus"] else "")
            + (", runtime slot" if t.get("runtime_slot") else ""))


def render(plan: dict, cfg: Any) -> str:
    lines = [f"profile {plan['profile']}: config valid",
             (f"  image {plan['image'] or '(local processes)'}; ray {plan['ray_address'] or '(local Ray)'}; "
              f"tracking {plan['tracking_uri']}; storage {plan['storage_root']}"),
             "", "recipe DAG (task run name  [Ray resources]  <- depends on):"]
    for t in plan["dag"]:
        deps = f"  <- {', '.join(t['deps'])}" if t["deps"] else ""
        lines.append(f"  {t['label']:<34} [{_fmt_res(t)}]{deps}")
    lines += ["", "RL stage actor layout:"] + [f"  {s}" for s in plan["layout_summary"]]
    from rstar2_core.config.runtime_rules import resolved_weight_sync

    ro = cfg.rollout
    lines.append(f"  runtime {cfg.cluster.runtime}: {ro.num_engines} {ro.engine} engine(s), weight sync "
                 f"{resolved_weight_sync(cfg)}; trainer: {cfg.rl.backend}"
                 + (f" ZeRO-{cfg.rl.zero_stage}" if cfg.rl.backend == "deepspeed" else "")
                 + f"; sandbox: {cfg.sandbox.backend}")
    if cfg.cluster.runtime == "local":
        lines.append("  (runtime local: every stage runs in its task's process; the layout above is what "
                     "cluster.runtime = \"ray\" would place)")
    push = plan["weight_push"]
    if push["bytes"]:
        lines.append(f"  weight push ({push['weight_sync']}): {push['params'] / 1e9:.2f}B parameters in {cfg.model.dtype} "
                     f"= {push['bytes'] / 1e9:.2f} GB per push (from {push['source']})")
        if push["seconds_at_measured_rate"]:
            rates = ", ".join(f"{t} {s:.1f} s" for t, s in push["seconds_at_measured_rate"].items())
            lines.append(f"    at the CPU rates of {push['rates_from']}: {rates} per push (nccl, ipc: GPU, "
                         "not measured)")
    else:
        lines.append(f"  weight push ({push['weight_sync']}): size unknown: {push['source']}")
    ts = plan["tool_service"]
    if ts["backend"] == "service":
        lines.append(f"  tool service: {ts['replicas']}" + (f"-{ts['max_replicas']}" if ts["max_replicas"] > ts["replicas"] else "")
                     + f" replica(s) x {ts['cpus_per_replica']:g} CPU ({ts['workers_per_replica']} calls at once each) on "
                     + (f"the nodes declaring {ts['node_resource']!r}" if ts["node_resource"] else "any node")
                     + "; no sandbox CPUs on the GPU nodes" + (f"; HTTP {ts['url']}" if ts["url"] else ""))
    lines += render_gpu(plan["gpu_memory"], plan["collectives"])
    lc = plan.get("label_check")
    if lc:
        where = "holds the runtime slot" if cfg.cluster.runtime == "ray" else "in the curate task"
        per = (f"{lc['k']} samples x <= {lc['max_response_tokens']:,} tokens (<= {lc['max_turns']} turns)")
        if lc["problems"]:
            lines += ["", (f"label check (curate, {where}): <= {lc['problems']:,} problems x {per} = <= "
                           f"{lc['max_generated_tokens'] / 1e9:.2f}B generated tokens; at an assumed "
                           f"{ASSUMED_DECODE_TOKENS_PER_S_PER_GPU:,.0f} tokens/s per GPU on {lc['engine_gpus']} "
                           f"engine GPU(s): <= {lc['hours_at_assumed_rate']:.1f} h")]
        else:
            lines += ["", (f"label check (curate, {where}): every curated problem x {per}; no budget on "
                           "problems (data.label_check.max_problems): its cost grows with the sources")]
    if plan.get("live_cluster"):
        lines += [""] + plan["live_cluster"]
    lines += ["", "first cluster run checklist (docs/first-cluster-run.md):"]
    for i, c in enumerate(plan["checklist"], 1):
        mark = {"ok": "ok", "problem": "PROBLEM", "not checked": "--"}[c["status"]]
        lines.append(f"  [{mark:>7}] {i}. {c['what']}" + (f" (not checked: {c['why_not_checked']})"
                                                          if c["why_not_checked"] else ""))
    lines.append("")
    if plan["problems"]:
        lines.append(f"problems ({len(plan['problems'])}):")
        lines += [f"  - {x}" for x in plan["problems"]]
    else:
        lines.append("no problems found" + ("; infra/ matches the profile" if plan["image"] else ""))
    return "\n".join(lines)


def render_gpu(mem: dict, coll: dict) -> list[str]:
    """The GPU memory and collectives part of the human-readable plan."""
    if "skipped" in mem:
        return ["", f"GPU memory and collectives: not checked: {mem['skipped']}"]
    lines = ["", f"GPU memory per GPU, GiB (device {mem['device_gb']:g} GiB; model from {mem['source']}):"]
    for phase in ("rollout", "update", "sft"):
        parts = {k.split(".", 1)[1]: v for k, v in mem["parts"].items() if k.startswith(phase + ".")}
        lines.append(f"  {phase:<8} peak {mem[phase + '_peak_gb']:7.1f}  "
                     + ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v >= 0.05))
    a = mem["assumptions"]
    lines.append(f"  ({a['trainer_world']} trainer ranks; {a['rl_tokens_per_micro_batch']:,} RL / "
                 f"{a['sft_tokens_per_micro_batch']:,} SFT tokens per micro-batch; an engine's KV cache holds "
                 f"{a['engine_kv_capacity_tokens']:,} tokens, the longest sequence {a['longest_sequence_tokens']:,})")
    def _t(b: float, s: float | None) -> str:
        return f"{b / 1e12:.2f} TB" + (f" = {s:,.0f} s" if s is not None else " (no link speed: cluster.inter_node_gb_per_s)")
    lines.append(f"collectives per trainer rank ({coll['assumes']}):")
    lines.append(f"  RL update ({coll['update_stage']}): {_t(coll['update_bytes_per_rank'], coll['update_seconds'])}; "
                 f"SFT step: {_t(coll['sft_bytes_per_rank'], coll['sft_seconds'])}")
    for name, c in coll["hpz_compare"].items():
        lines.append(f"  {name:<5} (zero_hpz_partition_size {c['zero_hpz_partition_size']}): across nodes "
                     f"{c['inter_node_bytes'] / 1e12:.2f} TB, inside a node {c['intra_node_bytes'] / 1e12:.2f} TB"
                     + (f", {c['seconds']:,.0f} s" if c["seconds"] is not None else "")
                     + (f"; +{c['extra_memory_gb']:.1f} GiB per GPU" if c["extra_memory_gb"] else ""))
    return lines


def _plan(args: argparse.Namespace) -> int:
    cfg = load(args)
    nodes = None
    if args.address:
        from rstar2_core.runtime.ray.connect import probe_cluster

        nodes = probe_cluster(args.address)
    plan = build_plan(cfg, nodes, read_model=args.read_model, address=args.address, model_config=args.model_config)
    print(json.dumps(plan, indent=1) if args.json else render(plan, cfg))
    return 1 if args.strict and plan["problems"] else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="validate a profile and print the recipe DAG, resources and actor layout")
    add_profile_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--strict", action="store_true", help="exit 1 when a problem is found")
    p.add_argument("--address", default=None,
                   help="a live Ray cluster (host:port): also say whether the layout fits its nodes and, on "
                        "real GPUs, whether each GPU bundle binds its own device (probes placed for a moment)")
    p.add_argument("--read-model", action="store_true",
                   help="read the policy's config.json from the store (a remote model.name_or_path) to size the "
                        "weight push; a local checkpoint is always read")
    p.add_argument("--model-config", default=None, metavar="CONFIG_JSON",
                   help="a local config.json that sizes the policy in place of model.name_or_path's (e.g. "
                        "configs/models/Qwen3-14B-Base.config.json): GPU memory, collectives, weight push")
    p.set_defaults(func=_plan)
