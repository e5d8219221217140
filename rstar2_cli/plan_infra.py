"""`rstar2 plan`'s infra check: where infra/ (KubeRay and `ray up` manifests, the pool's base job template, the
image) disagrees with the profile's cluster, image, tracking URI or services, misses what RCCL needs between
nodes, or breaks the deployments' pull steps. Pure reading of the files (`infra_problems(cfg)` -> [] when
consistent); tests/unit/infra/ checks each rule on a broken copy. See docs/first-cluster-run.md, "Checklist".
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

INFRA = Path(__file__).resolve().parents[1] / "infra"
WORK_POOL = "rstar2-cluster"


def _yaml_docs(path: Path) -> list[dict]:
    import yaml

    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


def _host_port(url: str) -> tuple[str, int]:
    u = urlparse(url)
    return u.hostname or "", u.port or (443 if u.scheme == "https" else 80)


def _service(docs: list[dict], name: str) -> dict | None:
    return next((d for d in docs if d.get("kind") == "Service" and d["metadata"]["name"] == name), None)


def infra_problems(cfg: Any, infra: Path = INFRA, prefect_yaml: Path = INFRA.parent / "prefect.yaml") -> list[str]:
    """Where infra/ disagrees with the profile's cluster, image, tracking URI or services, or with the
    deployments' pull steps ([] = consistent)."""
    cl, p = cfg.cluster, []
    image, tracking = cl.image, cfg.tracking.tracking_uri

    def expect(what: str, got: Any, want: Any) -> None:
        if got != want:
            p.append(f"{what} is {got!r}, the profile says {want!r}")

    rc = _yaml_docs(infra / "k8s" / "raycluster.yaml")[0]
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    groups = [g for g in rc["spec"]["workerGroupSpecs"] if int(g["rayStartParams"].get("num-gpus", "0")) > 0]
    expect("infra/k8s/raycluster.yaml GPU worker replicas", sum(int(g["replicas"]) for g in groups), cl.nodes)
    prefect_url = None
    for g in groups:
        expect(f"raycluster.yaml {g['groupName']} num-gpus", int(g["rayStartParams"]["num-gpus"]), cl.gpus_per_node)
        expect(f"raycluster.yaml {g['groupName']} num-cpus", int(g["rayStartParams"]["num-cpus"]), cl.cpus_per_node)
        for c in g["template"]["spec"]["containers"]:
            lim = c["resources"]["limits"]
            gpus = lim.get("amd.com/gpu", lim.get("nvidia.com/gpu"))
            expect(f"raycluster.yaml {c['name']} GPU limit", gpus, cl.gpus_per_node)
    for c in head + [c for g in rc["spec"]["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]]:
        expect(f"raycluster.yaml container {c['name']} image", c["image"], image)
        env = _env(c)
        if tracking:
            expect(f"raycluster.yaml {c['name']} MLFLOW_TRACKING_URI", env.get("MLFLOW_TRACKING_URI"), tracking)
        if not env.get("PREFECT_API_URL"):
            p.append(f"raycluster.yaml {c['name']} sets no PREFECT_API_URL")
        prefect_url = prefect_url or env.get("PREFECT_API_URL")
    ports = {pt["containerPort"] for pt in head[0].get("ports", [])}
    if not {6379, 8265, 10001} <= ports:
        p.append(f"raycluster.yaml head ports {sorted(ports)} lack 6379/8265/10001 (GCS, dashboard, client)")
    worker = next((c for c in head if c["name"] == "prefect-worker"), None)
    if worker is None:
        p.append("raycluster.yaml head has no prefect-worker container")
    else:
        expect("raycluster.yaml prefect-worker RAY_ADDRESS", _env(worker).get("RAY_ADDRESS"), cl.ray_address)
        cmd = worker["command"]
        expect("raycluster.yaml prefect-worker pool", cmd[cmd.index("--pool") + 1], WORK_POOL)

    up = _yaml_docs(infra / "ray" / "cluster.yaml")[0]
    expect("infra/ray/cluster.yaml machines (head + worker_ips)", 1 + len(up["provider"]["worker_ips"]), cl.nodes)
    expect("infra/ray/cluster.yaml max_workers", up["max_workers"], cl.nodes - 1)
    expect("infra/ray/cluster.yaml docker.image", up["docker"]["image"], image)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        cmds = " ".join(up[key])
        for flag in (f"--num-gpus={cl.gpus_per_node}", f"--num-cpus={cl.cpus_per_node}"):
            if flag not in cmds:
                p.append(f"infra/ray/cluster.yaml {key} lack {flag}")
    if f"--pool {WORK_POOL}" not in " ".join(up["head_start_ray_commands"]):
        p.append(f"infra/ray/cluster.yaml head does not start a Prefect worker on pool {WORK_POOL}")

    tmpl = json.loads((infra / "prefect" / "base-job-template.json").read_text())
    env = tmpl["variables"]["properties"]["env"].get("default", {})
    if tracking:
        expect("infra/prefect/base-job-template.json MLFLOW_TRACKING_URI", env.get("MLFLOW_TRACKING_URI"), tracking)
    expect("base-job-template.json RAY_ADDRESS", env.get("RAY_ADDRESS"), cl.ray_address)
    expect("base-job-template.json PREFECT_API_URL", env.get("PREFECT_API_URL"), prefect_url)

    for fname, url, svc in (("mlflow.yaml", tracking, "mlflow"), ("prefect-server.yaml", prefect_url, "prefect-server")):
        if not url:
            continue
        s = _service(_yaml_docs(infra / "k8s" / fname), svc)
        host, port = _host_port(url)
        if s is None:
            p.append(f"infra/k8s/{fname} has no Service {svc}")
            continue
        expect(f"infra/k8s/{fname} Service host", f"{s['metadata']['name']}.{s['metadata']['namespace']}.svc", host)
        expect(f"infra/k8s/{fname} Service port", s["spec"]["ports"][0]["port"], port)

    p += rccl_problems(infra, groups, up)
    p += sandbox_placement_problems(cfg, rc)
    if cl.runtime == "ray":
        p += _runtime_slot_problems(cfg, rc, up)
    p += pull_step_problems(infra, env, prefect_yaml)
    tag = re.search(r"-t\s+(\S+)", (infra / "docker" / "Dockerfile.rocm").read_text())
    expect("infra/docker/Dockerfile.rocm build tag", tag.group(1) if tag else None, image)
    return p


RCCL_ENV = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA")
"""The interface settings RCCL needs between nodes, operator inputs (ConfigMap rstar2-rccl, /etc/rstar2/env)."""


SANDBOX_CONTEXT = {"appArmorProfile": "AppArmor (mount, pivot_root)", "seccompProfile": "seccomp (unshare, mount)"}


def _ray_resources(group: dict) -> dict:
    raw = group["rayStartParams"].get("resources")
    if not raw:
        return {}
    raw = raw.strip()
    return json.loads(json.loads(raw) if raw.startswith('"') else raw)   # KubeRay's quoted JSON


def _sandbox_context_problems(where: str, c: dict) -> list[str]:
    """What a container running the sandbox lacks: AppArmor and seccomp not the runtime's default, SYS_ADMIN."""
    sc, p = c.get("securityContext") or {}, []
    for key, what in SANDBOX_CONTEXT.items():
        if (sc.get(key) or {}).get("type") not in ("Unconfined", "Localhost"):
            p.append(f"{where} {c['name']} sets no securityContext.{key} (Unconfined or a Localhost profile): the "
                     f"runtime's default {what} refuses the sandbox")
    if "SYS_ADMIN" not in ((sc.get("capabilities") or {}).get("add") or []):
        p.append(f"{where} {c['name']} lacks the SYS_ADMIN capability (the sandbox's namespaces and mounts)")
    return p


def sandbox_placement_problems(cfg: Any, rc: dict) -> list[str]:
    """Where the KubeRay manifest puts the sandbox against the profile: with `sandbox.backend = "service"`, a
    CPU worker group declaring `sandbox.service.node_resource`, with the sandbox's security context and room for
    the replicas, no GPU group declaring it or keeping SYS_ADMIN, and the head exposing Serve's port; with
    `"ray"` on GPU nodes, the GPU groups need the sandbox's security context themselves."""
    sb, p = cfg.sandbox, []
    groups = rc["spec"]["workerGroupSpecs"]
    gpu = [g for g in groups if int(g["rayStartParams"].get("num-gpus", "0")) > 0]
    if sb.backend == "ray" and cfg.cluster.gpus_per_node > 0:
        for g in gpu:
            for c in g["template"]["spec"]["containers"]:
                p += _sandbox_context_problems(f"infra/k8s/raycluster.yaml {g['groupName']}", c)
        return p
    if sb.backend != "service":
        return p
    sc = sb.service
    if not sc.node_resource:
        return [(f"profile {cfg.profile}: sandbox.service.node_resource is empty, so tool service replicas may land "
                 "on GPU nodes; set it to the resource the tools group declares (infra/k8s/raycluster.yaml)")]
    tools = [g for g in groups if _ray_resources(g).get(sc.node_resource)]
    if not tools:
        return [(f"infra/k8s/raycluster.yaml has no worker group declaring {sc.node_resource!r} "
                 "(rayStartParams.resources): the tool service's replicas would stay pending")]
    slots = cpus = 0
    for g in tools:
        where = f"infra/k8s/raycluster.yaml {g['groupName']}"
        if g in gpu:
            p.append(f"{where} holds GPUs and declares {sc.node_resource!r}: tool service replicas would share the "
                     "GPU nodes; declare it on a CPU group only")
        n, per = int(g["replicas"]), int(g["rayStartParams"].get("num-cpus", "0"))
        slots += n * min(int(_ray_resources(g)[sc.node_resource]), int(per // sc.cpus_per_replica))
        cpus += n * per
        for c in g["template"]["spec"]["containers"]:
            p += _sandbox_context_problems(where, c)
    top = max(sc.replicas, sc.max_replicas)
    if slots < top:
        p.append(f"the tools group(s) hold {slots} replica slot(s) ({sc.node_resource} per node, num-cpus / "
                 f"sandbox.service.cpus_per_replica = {sc.cpus_per_replica:g}) but the profile scales to {top} "
                 "(sandbox.service.replicas / max_replicas)")
    for g in gpu:
        for c in g["template"]["spec"]["containers"]:
            if "SYS_ADMIN" in (((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []):
                p.append(f"infra/k8s/raycluster.yaml {g['groupName']} {c['name']} keeps SYS_ADMIN, which only the "
                         "sandbox needed: the tool service runs it on the tools group; drop it")
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    if sc.url:
        port = _host_port(sc.url)[1]
        if port not in {pt["containerPort"] for pt in head[0].get("ports", [])}:
            p.append(f"sandbox.service.url {sc.url} uses port {port}, which the Ray head does not expose "
                     "(headGroupSpec ports; Serve's HTTP proxy)")
    return p


def rccl_problems(infra: Path, gpu_groups: list[dict], up: dict) -> list[str]:
    """Whether the GPU workers give RCCL the node fabric: the host's network (not the pod network), RDMA devices,
    locked memory and the interface settings, in both the KubeRay manifest and the `ray up` config."""
    p = []
    maps = {d["metadata"]["name"]: d.get("data") or {} for d in _yaml_docs(infra / "k8s" / "namespace.yaml")
            if d.get("kind") == "ConfigMap"}
    for g in gpu_groups:
        spec, where = g["template"]["spec"], f"infra/k8s/raycluster.yaml {g['groupName']}"
        if not spec.get("hostNetwork"):
            p.append(f"{where} lacks hostNetwork: true: RCCL would cross nodes on the pod network")
        for c in spec["containers"]:
            if not any(k.startswith("rdma/") for k in c["resources"].get("limits", {})):
                p.append(f"{where} {c['name']} asks no rdma/* device (the RDMA device plugin's resource)")
            if "IPC_LOCK" not in ((c.get("securityContext") or {}).get("capabilities") or {}).get("add", []):
                p.append(f"{where} {c['name']} lacks the IPC_LOCK capability (RDMA registers locked memory)")
            env = set(_env(c)) | {k for ref in c.get("envFrom") or [] if "configMapRef" in ref
                                  for k in maps.get(ref["configMapRef"]["name"], {})}
            p += [f"{where} {c['name']} does not set {v} (ConfigMap rstar2-rccl in k8s/namespace.yaml)"
                  for v in RCCL_ENV if v not in env]
    opts = " ".join(up["docker"].get("run_options") or [])
    for flag in ("--network=host", "--device=/dev/infiniband", "--ulimit memlock=-1", "--cap-add=IPC_LOCK"):
        if flag not in opts:
            p.append(f"infra/ray/cluster.yaml docker.run_options lack {flag} (RCCL over the node fabric)")
    example = (infra / "ray" / "rstar2.env.example").read_text()
    p += [f"infra/ray/rstar2.env.example does not list {v}" for v in RCCL_ENV if f"\n{v}=" not in f"\n{example}"]
    return p


def pull_step_problems(infra: Path, job_env: dict, prefect_yaml: Path) -> list[str]:
    """prefect.yaml's pull steps run in the flow-run process the production worker starts: every
    environment variable they name (`{{ $NAME }}`) must reach it, from the pool's base job template
    (`job_env`) or the image (infra/docker/Dockerfile.rocm ENV), and a working directory must be the
    image's WORKDIR (where the code is). Otherwise the flow run dies before the flow starts."""
    import yaml

    dockerfile = (infra / "docker" / "Dockerfile.rocm").read_text()
    env_blocks = re.findall(r"^ENV\s+((?:.*\\\n)*.*)$", dockerfile, flags=re.MULTILINE)   # ENV and its continuations
    image_env = dict(re.findall(r"([A-Z][A-Z0-9_]*)=(\S+)", " ".join(env_blocks).replace("\\\n", " ")))
    workdir = (re.search(r"^WORKDIR\s+(\S+)", dockerfile, flags=re.MULTILINE) or [None, None])[1]
    pull = yaml.safe_load(prefect_yaml.read_text()).get("pull") or []
    p = []
    for step in pull:
        for name, args in step.items():
            for value in (args or {}).values():
                if not isinstance(value, str):
                    continue
                for var in re.findall(r"\{\{\s*\$([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", value):
                    got = job_env.get(var) or image_env.get(var)
                    if got is None:
                        p.append(f"prefect.yaml pull step {name} needs ${var}, which neither "
                                 "infra/prefect/base-job-template.json's env nor the image (Dockerfile ENV) sets: "
                                 "the production worker's flow runs would fail before the flow starts")
                    elif name.endswith("set_working_directory") and got != workdir:
                        p.append(f"prefect.yaml pull step {name} changes into ${var} = {got!r}, but the image's "
                                 f"code is in WORKDIR {workdir!r}")
    return p


def _runtime_slot_problems(cfg: Any, rc: dict, up: dict) -> list[str]:
    """With cluster.runtime = "ray", the head must offer the one `rstar2_runtime` unit the stage tasks ask
    for (rstar2_core/runtime/ray/connect.py) and CPUs for the largest of them (they run there)."""
    from rstar2_core.config.runtime_rules import runtime_tasks
    from rstar2_core.runtime.ray.connect import RUNTIME_RESOURCE

    p = []
    head = rc["spec"]["headGroupSpec"]["rayStartParams"]
    raw = str(head.get("resources", "")).strip().strip('"').replace('\\"', '"')
    try:
        res = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        res = {}
    if res.get(RUNTIME_RESOURCE) != 1:
        p.append(f"infra/k8s/raycluster.yaml head rayStartParams.resources lacks {{\"{RUNTIME_RESOURCE}\": 1}}: "
                 "stage tasks of the Ray runtime would never be scheduled")
    need = max((cfg.cluster.resources[k].num_cpus for k in runtime_tasks(cfg) if k in cfg.cluster.resources),
               default=1.0)
    if float(head.get("num-cpus", 0)) < need:
        p.append(f"infra/k8s/raycluster.yaml head num-cpus = {head.get('num-cpus')} is below the {need:g} CPUs a "
                 "stage task asks for (cluster.resources.*.num_cpus); they run on the head")
    if f'"{RUNTIME_RESOURCE}": 1' not in " ".join(up["head_start_ray_commands"]):
        p.append(f"infra/ray/cluster.yaml head_start_ray_commands lack --resources='{{\"{RUNTIME_RESOURCE}\": 1}}'")
    return p
