"""infra/k8s/up.sh applies the manifests in infra/README.md's order, waits for each step before the next,
and ends with `rstar2 deploy` in the Ray head's prefect-worker container; a failed wait stops it there.
Run against a recording stand-in for kubectl (no cluster here)."""

from __future__ import annotations

import os
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


def _run(tmp_path: Path, fail: str = "never-matches") -> tuple[int, list[str]]:
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(FAKE)
    kubectl.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "KUBECTL": str(kubectl), "KUBECTL_LOG": str(log), "KUBECTL_FAIL": fail,
           "RSTAR2_UP_TIMEOUT": "5s"}
    r = subprocess.run(["bash", str(UP)], env=env, capture_output=True, text=True, timeout=60, check=False)
    return r.returncode, log.read_text().splitlines()


def test_up_applies_in_the_readme_order_with_waits_then_deploys(tmp_path):
    rc, calls = _run(tmp_path)
    assert rc == 0, calls
    k8s = UP.parent
    assert calls == [
        f"apply -f {k8s}/namespace.yaml",
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
    assert by_hand == [c for c in calls if c.startswith("apply")]          # README's order, manifest by manifest
    assert "infra/k8s/up.sh" in readme and "rstar2 deploy" in readme


def test_a_failed_wait_stops_the_bring_up(tmp_path):
    rc, calls = _run(tmp_path, fail="rollout status deployment/prefect-server")
    assert rc != 0
    assert calls[-1].endswith("rollout status deployment/prefect-server --timeout=5s")
    assert not any("raycluster.yaml" in c or "rstar2 deploy" in c for c in calls)
