"""infra/k8s/up.sh refuses a namespace.yaml with "<...>" placeholders left, applies the manifests in
infra/README.md's order, waits for each step before the next, and ends with `rstar2 tools deploy` and
`rstar2 deploy` in the Ray head's prefect-worker container; a failed wait stops it there. Run against a
recording stand-in for kubectl (no cluster here)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
UP = ROOT / "infra" / "k8s" / "up.sh"
FAKE = """#!/usr/bin/env bash
echo "$*" >> "$KUBECTL_LOG"
case "$*" in
  *"$KUBECTL_FAIL"*) exit 1 ;;
  *"get raycluster"*) echo "3 5" ;;
  *"get pod"*) echo "pod/rstar2-head-x" ;;
esac
"""


def filled(tmp_path: Path) -> Path:
    """namespace.yaml with every "<...>" placeholder filled, as an operator leaves it."""
    out = tmp_path / "namespace.yaml"
    out.write_text(re.sub(r'"<[^"]*>"', '"filled"', (UP.parent / "namespace.yaml").read_text()))
    return out


def _run(tmp_path: Path, fail: str = "never-matches", namespace: Path | None = None) -> tuple[int, list[str], str]:
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(FAKE)
    kubectl.chmod(0o755)
    log = tmp_path / "calls.log"
    log.touch()
    env = {**os.environ, "KUBECTL": str(kubectl), "KUBECTL_LOG": str(log), "KUBECTL_FAIL": fail,
           "RSTAR2_UP_TIMEOUT": "5s", "RSTAR2_NAMESPACE_YAML": str(namespace or filled(tmp_path))}
    r = subprocess.run(["bash", str(UP)], env=env, capture_output=True, text=True, timeout=60, check=False)
    return r.returncode, log.read_text().splitlines(), r.stderr


def test_up_applies_in_the_readme_order_with_waits_then_deploys(tmp_path):
    rc, calls, _ = _run(tmp_path)
    assert rc == 0, calls
    k8s = UP.parent
    assert calls == [
        f"apply -f {tmp_path}/namespace.yaml",
        f"apply -f {k8s}/postgres.yaml",
        "-n rstar2 rollout status statefulset/postgres --timeout=5s",
        f"apply -f {k8s}/mlflow.yaml -f {k8s}/prefect-server.yaml",
        "-n rstar2 rollout status deployment/mlflow --timeout=5s",
        "-n rstar2 rollout status deployment/prefect-server --timeout=5s",
        f"apply -f {k8s}/raycluster.yaml",
        "-n rstar2 get raycluster rstar2 -o jsonpath={.spec.workerGroupSpecs[*].replicas}",
        "-n rstar2 wait raycluster/rstar2 --for=jsonpath={.status.readyWorkerReplicas}=8 --timeout=5s",
        "-n rstar2 get pod -l ray.io/cluster=rstar2,ray.io/node-type=head -o name",
        "-n rstar2 wait pod/rstar2-head-x --for=condition=Ready --timeout=5s",
        "-n rstar2 exec pod/rstar2-head-x -c prefect-worker -- rstar2 tools deploy --profile qwen3-14b-mi300x",
        "-n rstar2 exec pod/rstar2-head-x -c prefect-worker -- rstar2 deploy",
    ]
    readme = (ROOT / "infra" / "README.md").read_text()
    by_hand = [line.replace("kubectl ", "", 1).replace("infra/k8s", str(k8s)) for line in readme.splitlines()
               if line.startswith("kubectl apply -f infra/k8s/")]
    applied = [c.replace(str(tmp_path), str(k8s)) for c in calls if c.startswith("apply")]
    assert by_hand == applied                                               # README's order, manifest by manifest
    assert "infra/k8s/up.sh" in readme and "rstar2 deploy" in readme


def test_a_failed_wait_stops_the_bring_up(tmp_path):
    rc, calls, _ = _run(tmp_path, fail="rollout status deployment/prefect-server")
    assert rc != 0
    assert calls[-1].endswith("rollout status deployment/prefect-server --timeout=5s")
    assert not any("raycluster.yaml" in c or "rstar2 deploy" in c for c in calls)


def test_placeholders_left_in_namespace_yaml_stop_it_before_anything_is_applied(tmp_path):
    """The repository's namespace.yaml as shipped: its Secrets and RCCL ConfigMap still hold "<...>" values,
    which would reach the pods as keys, a password and RCCL's interface; up.sh names each and applies nothing."""
    rc, calls, err = _run(tmp_path, namespace=UP.parent / "namespace.yaml")
    assert rc == 2 and calls == [], calls
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "POSTGRES_PASSWORD", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"):
        assert name in err, (name, err)
    assert "infra/README.md step 2" in err and "nothing was applied" in err
