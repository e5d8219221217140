# Sourced by every script and the Makefile's recipes: all local state lives under $RSTAR2_HOME
# (default <repo>/.rstar2), nothing under ~.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# an RSTAR2_HOME inherited from a shell that sourced another checkout's env.sh would run this checkout on
# that one's registry, runs and servers: say so once (an intended shared home is fine)
if [ -n "${RSTAR2_HOME:-}" ] && [ -z "${RSTAR2_HOME_NOTED:-}" ] && [[ "$RSTAR2_HOME" != "$ROOT"/* ]]; then
  echo "rstar2: RSTAR2_HOME=$RSTAR2_HOME comes from the environment and lies outside this checkout ($ROOT):" \
       "its state is used; unset RSTAR2_HOME to use $ROOT/.rstar2" >&2
  export RSTAR2_HOME_NOTED=1
fi
export RSTAR2_HOME="${RSTAR2_HOME:-$ROOT/.rstar2}"
export XDG_CACHE_HOME="$RSTAR2_HOME/cache"
export HF_HOME="$RSTAR2_HOME/cache/huggingface"
export HF_HUB_OFFLINE=1
export TORCH_EXTENSIONS_DIR="$RSTAR2_HOME/cache/torch_extensions"
export TRITON_CACHE_DIR="$RSTAR2_HOME/cache/triton"
export MPLCONFIGDIR="$RSTAR2_HOME/cache/matplotlib"
export PREFECT_HOME="$RSTAR2_HOME/prefect"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export MLFLOW_DISABLE_TELEMETRY=true
export DO_NOT_TRACK=1
export RAY_AUTH_MODE=disabled
export RAY_USAGE_STATS_ENABLED=0
export TOKENIZERS_PARALLELISM=false
# compiled bytecode of every process (site-packages included: uv installs none) cached under the state
# folder instead of beside the sources: a fresh interpreter then imports vLLM, transformers and Prefect
# from it instead of compiling them again (~20 -> ~13 s for those three), and the checkout stays clean
# (an inherited PYTHONDONTWRITEBYTECODE would make every interpreter compile them again: unset)
export PYTHONPYCACHEPREFIX="$RSTAR2_HOME/cache/pycache"
unset PYTHONDONTWRITEBYTECODE
mkdir -p "$RSTAR2_HOME/cache"
