"""infra/: every manifest parses, has the structure its tool needs, and agrees with the production
profile (node count, GPUs/CPUs per node, image names, service URLs, work pool, env vars)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from rstar2_cli.plan import INFRA, WORK_POOL, infra_problems
from rstar2_core.config import load_config

ROOT = INFRA.parent


def _docs(rel: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((INFRA / rel).read_text()) if d]


@pytest.fixture(scope="module")
def prod():
    return load_config("qwen3-14b-mi300x")


def test_every_yaml_and_json_parses():
    files = sorted(INFRA.rglob("*.yaml")) + sorted(INFRA.rglob("*.json"))
    assert len(files) >= 8
    for f in files:
        if f.suffix == ".json":
            json.loads(f.read_text())
        else:
            assert [d for d in yaml.safe_load_all(f.read_text()) if d], f"{f} is empty"


def test_infra_agrees_with_the_production_profile(prod):
    assert prod.cluster.image and infra_problems(prod) == []


@pytest.mark.parametrize("override, needle", [
    ("cluster.nodes=4", "GPU worker replicas is 8, the profile says 4"),
    ("cluster.gpus_per_node=4 rl.zero_hpz_partition_size=4", "num-gpus is 8"),
    ("cluster.cpus_per_node=96", "num-cpus is 128"),
    ("cluster.image=\"ghcr.io/other/img:1\"", "image is 'ghcr.io/rstar2/rstar2-rocm:0.1.0'"),
    ("tracking.tracking_uri=\"http://mlflow.other.svc:5001\"", "MLFLOW_TRACKING_URI"),
    ("cluster.ray_address=\"ray://head:10001\"", "RAY_ADDRESS"),
])
def test_infra_check_catches_each_mismatch(override, needle):
    cfg = load_config("qwen3-14b-mi300x", [*override.split(" "), "rollout.num_engines=8"])
    problems = infra_problems(cfg)
    assert any(needle in p for p in problems), problems


def _k8s_objects() -> list[tuple[str, dict]]:
    return [(f.name, d) for f in sorted((INFRA / "k8s").glob("*.yaml")) for d in _docs(f"k8s/{f.name}")]


def test_k8s_objects_are_well_formed_and_wired():
    objs = _k8s_objects()
    secrets = {d["metadata"]["name"]: d for _, d in objs if d["kind"] == "Secret"}
    workloads = [d for _, d in objs if d["kind"] in ("Deployment", "StatefulSet")]
    for name, d in objs:
        assert {"apiVersion", "kind", "metadata"} <= set(d), name
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "rstar2", (name, d["metadata"]["name"])
    for w in workloads:
        spec = w["spec"]
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
        for c in spec["template"]["spec"]["containers"]:
            for ref in c.get("envFrom", []):
                assert ref["secretRef"]["name"] in secrets, ref
    for _, s in ((n, d) for n, d in objs if d["kind"] == "Service"):
        target = next(w for w in workloads if s["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items())
        ports = {p["containerPort"] for c in target["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in s["spec"]["ports"]} <= ports, s["metadata"]["name"]
    # MLflow: PostgreSQL store + S3 artifacts; Prefect server on PostgreSQL
    mlflow = next(w for w in workloads if w["metadata"]["name"] == "mlflow")
    args = " ".join(mlflow["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--backend-store-uri \"postgresql://" in args and "--artifacts-destination s3://" in args
    prefect = next(w for w in workloads if w["metadata"]["name"] == "prefect-server")
    assert "postgresql+asyncpg://" in " ".join(prefect["spec"]["template"]["spec"]["containers"][0]["args"])
    init = next(d for _, d in objs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "postgres-init")
    assert "CREATE DATABASE prefect" in "".join(init["data"].values())
    assert (INFRA / "services" / "postgres-init.sql").read_text().strip() == "CREATE DATABASE prefect;"


def test_raycluster_structure(prod):
    rc = _docs("k8s/raycluster.yaml")[0]
    assert (rc["apiVersion"], rc["kind"]) == ("ray.io/v1", "RayCluster")
    import ray

    assert rc["spec"]["rayVersion"] == ray.__version__  # the image installs the same Ray as the driver
    head = rc["spec"]["headGroupSpec"]
    for params in [head["rayStartParams"]] + [g["rayStartParams"] for g in rc["spec"]["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in params.values()), "KubeRay wants rayStartParams as strings"
    assert head["rayStartParams"]["num-gpus"] == "0"
    vols = {v["name"] for v in head["template"]["spec"]["volumes"]}
    for c in head["template"]["spec"]["containers"]:
        assert {"name": "ray-tmp", "mountPath": "/tmp/ray"} in c["volumeMounts"]  # worker finds the head
        assert {m["name"] for m in c["volumeMounts"]} <= vols
    g = rc["spec"]["workerGroupSpecs"][0]
    assert g["minReplicas"] == g["maxReplicas"] == g["replicas"] == prod.cluster.nodes
    wspec = g["template"]["spec"]
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in wspec["volumes"])  # /dev/shm
    c = wspec["containers"][0]
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert set(_env_names(c)) >= {"MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RSTAR2_HOME"}


def _env_names(c: dict) -> list[str]:
    return [e["name"] for e in c.get("env", [])]


def test_ray_up_yaml_and_env_file(prod):
    up = _docs("ray/cluster.yaml")[0]
    assert up["provider"]["type"] == "local" and up["cluster_name"] == "rstar2"
    assert len(set(up["provider"]["worker_ips"] + [up["provider"]["head_ip"]])) == prod.cluster.nodes
    opts = " ".join(up["docker"]["run_options"])
    for flag in ("--device=/dev/kfd", "--device=/dev/dri", "--env-file /etc/rstar2/env", "--shm-size"):
        assert flag in opts
    assert "--port=6379" in " ".join(up["head_start_ray_commands"])
    assert "$RAY_HEAD_IP:6379" in " ".join(up["worker_start_ray_commands"])
    env = dict(line.split("=", 1) for line in (INFRA / "ray" / "rstar2.env.example").read_text().splitlines()
               if line and not line.startswith("#"))
    assert {"MLFLOW_TRACKING_URI", "PREFECT_API_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
            "RSTAR2_HOME"} <= set(env)


def test_compose_services():
    c = _docs("services/docker-compose.yaml")[0]
    s = c["services"]
    assert set(s) == {"postgres", "mlflow", "prefect-server"}
    assert "5000:5000" in s["mlflow"]["ports"] and "4200:4200" in s["prefect-server"]["ports"]
    assert "postgresql://" in " ".join(s["mlflow"]["command"]) and "s3://" in " ".join(s["mlflow"]["command"])
    for name in ("mlflow", "prefect-server"):
        assert s[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for vol in s["postgres"]["volumes"]:
        src = vol.split(":")[0]
        if src.startswith("./"):
            assert (INFRA / "services" / src).exists(), src


def test_prefect_base_job_template_matches_the_process_worker():
    from prefect.workers.process import ProcessWorker

    ours = json.loads((INFRA / "prefect" / "base-job-template.json").read_text())
    default = ProcessWorker.get_default_base_job_template()
    assert ours["job_configuration"] == default["job_configuration"]
    assert set(ours["variables"]["properties"]) == set(default["variables"]["properties"])
    env = ours["variables"]["properties"]["env"]["default"]
    assert {"RAY_ADDRESS", "MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RSTAR2_HOME"} <= set(env)
    assert ours["variables"]["properties"]["working_dir"]["default"] == "/opt/rstar2"


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "")
            for ln in (x.strip() for x in text.splitlines()) if ln and not ln.startswith("#")]


@pytest.mark.parametrize("name, check", [("Dockerfile.rocm", "torch.version.hip"),
                                         ("Dockerfile.cuda", "torch.version.cuda")])
def test_dockerfiles(name, check):
    ins = _instructions(INFRA / "docker" / name)
    kinds = [k for k, _ in ins]
    assert kinds[0] == "ARG" and kinds[1] == "FROM" and "${BASE_IMAGE}" in ins[1][1]
    env = " ".join(v for k, v in ins if k == "ENV")
    assert "RSTAR2_HOME=/var/lib/rstar2" in env and "DS_BUILD_OPS=0" in env
    exposed = {int(p) for k, v in ins if k == "EXPOSE" for p in v.split()}
    assert exposed == {6379, 8265, 10001}
    for k, v in ins:
        if k == "COPY":
            src = v.split()[0]
            assert (ROOT / src).exists(), f"{name} copies {src}, which is not in the repository"
    run = " ".join(v for k, v in ins if k == "RUN")
    assert check in run and 'pip install --no-cache-dir -e ".[deepspeed]"' in run
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "deepspeed" in extras
    assert ("ENTRYPOINT", "[]") in ins


def test_readme_takes_the_operator_to_the_deployment_run():
    text = (INFRA / "README.md").read_text()
    assert "prefect deployment run rstar2/full-recipe --param profile=qwen3-14b-mi300x" in text
    assert "infra/k8s/up.sh" in text and "-c prefect-worker -- rstar2 deploy" in text    # step 3: rstar2_cli/bringup.py
    assert "docker build -f infra/docker/Dockerfile.rocm -t ghcr.io/rstar2/rstar2-rocm:0.1.0 ." in text
    for ref in set(re.findall(r"(?<![\w./-])infra/[\w./-]+\.(?:yaml|json|rocm|cuda|example|gz|py|md)\b", text)):
        assert (ROOT / ref).exists(), f"infra/README.md names {ref}, which does not exist"
    for rel in ("k8s/namespace.yaml", "k8s/postgres.yaml", "k8s/mlflow.yaml", "k8s/prefect-server.yaml",
                "k8s/raycluster.yaml", "ray/cluster.yaml", "services/docker-compose.yaml"):
        assert f"infra/{rel}" in text, rel


def _flags(cmd: str | list[str]) -> dict[str, str]:
    """`--key=value` / `--key value` flags of a `ray start` command line (quotes stripped)."""
    import shlex

    words = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    out: dict[str, str] = {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            key, eq, val = w[2:].partition("=")
            out[key] = val if eq else (words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else "")
    return out


def test_the_local_cluster_starts_its_nodes_as_the_manifests_do(prod):
    """The local multi-node cluster (`rstar2 cluster up`, rstar2_core/runtime/ray/rehearsal/local_cluster.py) and the
    cluster manifests start Ray nodes with the same resource flags: the head offers the one
    `rstar2_runtime` unit and (on KubeRay and locally) no GPU; every GPU node declares its GPUs and CPUs,
    the manifests with the production profile's numbers, the local cluster with the rehearsal's."""
    from rstar2_cli.cluster import rehearsal_overrides
    from rstar2_core.runtime.ray.connect import RUNTIME_RESOURCE
    from rstar2_core.runtime.ray.rehearsal.local_cluster import node_command

    reh = load_config("tiny", rehearsal_overrides()).cluster
    local_head = _flags(node_command("head", port=1, num_cpus=3, temp_dir="/tmp/x"))
    local_worker = _flags(node_command("worker", port=1, num_cpus=reh.cpus_per_node, num_gpus=reh.gpus_per_node,
                                       temp_dir="/tmp/x"))
    rc = next(yaml.safe_load_all((INFRA / "k8s" / "raycluster.yaml").read_text()))
    kube_head = {k: str(v) for k, v in rc["spec"]["headGroupSpec"]["rayStartParams"].items()}
    kube_workers = [{k: str(v) for k, v in g["rayStartParams"].items()} for g in rc["spec"]["workerGroupSpecs"]]
    up = yaml.safe_load((INFRA / "ray" / "cluster.yaml").read_text())
    up_head = _flags(next(c for c in up["head_start_ray_commands"] if "ray start" in c))
    up_worker = _flags(next(c for c in up["worker_start_ray_commands"] if "ray start" in c))

    def resources(flags: dict) -> dict:
        raw = flags.get("resources", "").strip().strip('"').replace('\\"', '"')
        return json.loads(raw) if raw else {}

    for name, head in (("local", local_head), ("raycluster.yaml", kube_head), ("cluster.yaml", up_head)):
        assert resources(head) == {RUNTIME_RESOURCE: 1}, name
        assert {"num-cpus", "num-gpus"} <= set(head), name
    assert local_head["num-gpus"] == kube_head["num-gpus"] == "0"       # a CPU head, GPU workers
    assert (local_worker["num-gpus"], local_worker["num-cpus"]) == (str(reh.gpus_per_node), str(reh.cpus_per_node))
    gpu_groups = [w for w in kube_workers if w.get("num-gpus", "0") != "0"]
    cl = prod.cluster
    for flags in [*gpu_groups, up_worker]:
        assert (flags["num-gpus"], flags["num-cpus"]) == (str(cl.gpus_per_node), str(cl.cpus_per_node))
        assert resources(flags) == {}                                # only the head has the runtime unit
    assert resources(local_worker) == {}


@pytest.mark.parametrize("path, old, new, needle", [
    ("k8s/raycluster.yaml", "          hostNetwork: true\n", "", "lacks hostNetwork: true"),
    ("k8s/raycluster.yaml", ', "IPC_LOCK"]', "]", "lacks the IPC_LOCK capability"),
    ("k8s/raycluster.yaml", "                - configMapRef: {name: rstar2-rccl}\n", "", "does not set NCCL_SOCKET_IFNAME"),
    ("k8s/raycluster.yaml", ", rdma/hca_shared_devices_a: 1}", "}", "asks no rdma/* device"),
    ("k8s/namespace.yaml", "  NCCL_IB_HCA:", "  NCCL_IB_HCA_UNUSED:", "does not set NCCL_IB_HCA"),
    ("ray/cluster.yaml", "    - --network=host\n", "", "lack --network=host"),
    ("ray/rstar2.env.example", "NCCL_SOCKET_IFNAME=", "#", "does not list NCCL_SOCKET_IFNAME"),
])
def test_rccl_gets_the_node_fabric_in_both_cluster_descriptions(prod, tmp_path, path, old, new, needle):
    """Each thing RCCL needs between nodes (host network, RDMA devices, memlock, interface settings), removed
    from a copy of infra/, is a problem naming it; infra/ as committed has none."""
    import shutil

    copy = tmp_path / "infra"
    shutil.copytree(INFRA, copy)
    f = copy / path
    assert old in f.read_text(), (path, old)
    f.write_text(f.read_text().replace(old, new))
    problems = infra_problems(prod, infra=copy, prefect_yaml=INFRA.parent / "prefect.yaml")
    assert [p for p in problems if needle in p], problems
    assert not [p for p in infra_problems(prod) if "RCCL" in p or "rdma" in p or "NCCL" in p or "IPC_LOCK" in p]


@pytest.mark.parametrize("old, new, needle", [
    ("                appArmorProfile: {type: Unconfined}\n", "", "sets no securityContext.appArmorProfile"),
    ("                seccompProfile: {type: Unconfined}\n", "", "sets no securityContext.seccompProfile"),
    ('                capabilities: {add: ["SYS_ADMIN"]}\n', "", "lacks the SYS_ADMIN capability"),
    ('resources: \'"{\\"rstar2_tools\\": 4}"\'', 'resources: \'"{\\"rstar2_tools\\": 2}"\'', "replica slot(s)"),
    ('resources: \'"{\\"rstar2_tools\\": 4}"\'', 'resources: \'"{\\"other\\": 4}"\'', "no worker group declaring"),
    ('capabilities: {add: ["SYS_PTRACE", "IPC_LOCK"]}', 'capabilities: {add: ["SYS_PTRACE", "SYS_ADMIN", "IPC_LOCK"]}',
     "keeps SYS_ADMIN, which only the sandbox needed"),
    ("              - containerPort: 8000\n", "              - containerPort: 8001\n", "which the Ray head does not expose"),
])
def test_the_tool_service_runs_off_the_gpu_nodes_with_the_sandboxs_security_context(prod, tmp_path, old, new, needle):
    """The production profile's tool service (sandbox.backend = "service"): a CPU worker group declaring
    sandbox.service.node_resource with AppArmor and seccomp unconfined and SYS_ADMIN, room for max_replicas,
    GPU pods without SYS_ADMIN, Serve's port on the head. Each broken in a copy of infra/ is a problem naming
    it; infra/ as committed has none."""
    import shutil

    copy = tmp_path / "infra"
    shutil.copytree(INFRA, copy)
    f = copy / "k8s" / "raycluster.yaml"
    assert old in f.read_text(), old
    f.write_text(f.read_text().replace(old, new))
    problems = infra_problems(prod, infra=copy, prefect_yaml=INFRA.parent / "prefect.yaml")
    assert [p for p in problems if needle in p], problems
    assert infra_problems(prod) == []


def test_the_sandbox_pool_on_gpu_nodes_needs_their_pods_to_carry_its_security_context():
    """sandbox.backend = "ray" on GPU nodes: the GPU pods (which no longer carry it) are named."""
    cfg = load_config("qwen3-14b-mi300x", ['sandbox.backend="ray"', "sandbox.service={}"])
    problems = infra_problems(cfg)
    assert any("mi300x ray-worker sets no securityContext.appArmorProfile" in p for p in problems), problems
    assert any("mi300x ray-worker lacks the SYS_ADMIN capability" in p for p in problems), problems


def test_the_workers_create_the_pool_with_our_template():
    """A worker that starts before `rstar2 deploy` creates the pool on its first poll: both worker commands
    hand it infra's template as the image holds it (relative paths from the container's working dir)."""
    import shlex

    rc = _docs("k8s/raycluster.yaml")[0]
    side = next(c for c in rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"] if c["name"] == "prefect-worker")
    up = _docs("ray/cluster.yaml")[0]
    up_cmd = shlex.split(next(c for c in up["head_start_ray_commands"] if "worker start" in c))
    dockerfile = (INFRA / "docker" / "Dockerfile.rocm").read_text()
    workdir = re.search(r"^WORKDIR\s+(\S+)", dockerfile, re.MULTILINE).group(1)
    for name, cmd, cwd in (("raycluster.yaml", side["command"], side["workingDir"]),
                           ("cluster.yaml", up_cmd, workdir)):
        assert cmd[cmd.index("--pool") + 1] == WORK_POOL, name
        path = Path(cwd) / cmd[cmd.index("--base-job-template") + 1]
        assert path == Path(workdir) / "infra" / "prefect" / "base-job-template.json", (name, path)
