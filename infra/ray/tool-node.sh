#!/usr/bin/env bash
# Joins this CPU machine to the `ray up` cluster (infra/ray/cluster.yaml) as a tool-service node: the rstar2
# image with the security options the sandbox needs (mount, user, PID, network and IPC namespaces and
# pivot_root for every call: Docker's default AppArmor and seccomp profiles deny them, and unshare needs
# CAP_SYS_ADMIN), declaring the rstar2_tools resource so that only this kind of node takes tool-service
# replicas (sandbox.service.node_resource). Then, on the head: `rstar2 tools deploy --profile qwen3-14b-mi300x`.
#
#   RAY_HEAD_IP=10.0.0.1 infra/ray/tool-node.sh        # CPUS (default: all) and SLOTS (replicas, default 4)
set -euo pipefail
: "${RAY_HEAD_IP:?set RAY_HEAD_IP to the head's address}"
cpus="${CPUS:-$(nproc)}"
slots="${SLOTS:-4}"
image="${RSTAR2_IMAGE:-ghcr.io/rstar2/rstar2-rocm:0.1.0}"
docker rm -f rstar2-tools >/dev/null 2>&1 || true
exec docker run -d --name rstar2-tools --restart unless-stopped --network=host --shm-size=32g \
  --security-opt apparmor=unconfined --security-opt seccomp=unconfined --cap-add=SYS_ADMIN \
  --env-file /etc/rstar2/env "$image" \
  ray start --block --address="$RAY_HEAD_IP:6379" --num-cpus="$cpus" --num-gpus=0 \
  --resources="{\"rstar2_tools\": $slots}"
