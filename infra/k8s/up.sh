#!/usr/bin/env bash
# Brings the Kubernetes side up in infra/README.md's order, each step waited for, then `rstar2 tools deploy`
# (the tool service on the tools group) and `rstar2 deploy` in the
# Ray head's `prefect-worker` container (the image holds prefect.yaml and the pool's template; the worker
# there may already have created the pool: `rstar2 deploy` gives it our template either way).
# Safe to rerun: `kubectl apply` and `rstar2 deploy` change only what differs.
#
#   infra/k8s/up.sh              # fill namespace.yaml's "<...>" values first (infra/README.md step 2)
#
# KUBECTL (default kubectl), RSTAR2_UP_TIMEOUT (each wait, default 1800s: pulling the image on 9 nodes) and
# RSTAR2_NAMESPACE_YAML (the filled namespace.yaml, default the one here) can be set; it needs kubectl >= 1.23
# (`wait --for=jsonpath`). It refuses to start while namespace.yaml still holds a "<...>" placeholder.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
k="${KUBECTL:-kubectl}"
t="${RSTAR2_UP_TIMEOUT:-1800s}"
nsyaml="${RSTAR2_NAMESPACE_YAML:-$here/namespace.yaml}"
ns=rstar2
say() { echo "[up] $*" >&2; }

left="$(grep -nE '^[[:space:]]*[A-Z_]+: "<[^"]*>"' "$nsyaml" || true)"
if [ -n "$left" ]; then
  say "$nsyaml still has placeholders (the S3 keys, the DB password, RCCL's interface and RDMA devices):"
  echo "$left" >&2
  say "fill them for this cluster (infra/README.md step 2), then run up.sh again; nothing was applied"
  exit 2
fi
say "1/6 namespace and secrets"
$k apply -f "$nsyaml"
say "2/6 PostgreSQL"
$k apply -f "$here/postgres.yaml"
$k -n "$ns" rollout status statefulset/postgres --timeout="$t"
say "3/6 MLflow and the Prefect server"
$k apply -f "$here/mlflow.yaml" -f "$here/prefect-server.yaml"
$k -n "$ns" rollout status deployment/mlflow --timeout="$t"
$k -n "$ns" rollout status deployment/prefect-server --timeout="$t"
say "4/6 Ray cluster (head, GPU workers, tool nodes)"
$k apply -f "$here/raycluster.yaml"
workers=0
for n in $($k -n "$ns" get raycluster rstar2 -o jsonpath='{.spec.workerGroupSpecs[*].replicas}'); do
  workers=$((workers + n))
done
$k -n "$ns" wait raycluster/rstar2 --for=jsonpath='{.status.readyWorkerReplicas}'="$workers" --timeout="$t"
head="$($k -n "$ns" get pod -l ray.io/cluster=rstar2,ray.io/node-type=head -o name)"
$k -n "$ns" wait "$head" --for=condition=Ready --timeout="$t"
say "5/6 the tool service on the tools group (rstar2 tools deploy in $head; waits for every replica)"
$k -n "$ns" exec "$head" -c prefect-worker -- rstar2 tools deploy --profile qwen3-14b-mi300x
say "6/6 work pool rstar2-cluster and the deployments (rstar2 deploy in $head)"
$k -n "$ns" exec "$head" -c prefect-worker -- rstar2 deploy
say "up: next, infra/README.md step 4 (rstar2 plan --strict in the same container, then the run)"
