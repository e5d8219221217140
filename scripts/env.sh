# Sourced by every script and the Makefile's recipes: all local state lives under $RSTAR2_HOME
# (default <repo>/.rstar2), nothing under ~.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# an RSTAR2_HOME inherited from a shell that sourced another checkout's env.sh would run this checkout on
# that one's registry, runs and servers: refused when it is another checkout's state folder (unless
# RSTAR2_SHARED_HOME=1 says it is meant), named once otherwise (a home chosen elsewhere on purpose is fine)
if [ -n "${RSTAR2_HOME:-}" ] && [[ "$RSTAR2_HOME" != "$ROOT"/* ]]; then
  _other="$(dirname "$RSTAR2_HOME")"
  if [ "$(basename "$RSTAR2_HOME")" = ".rstar2" ] && [ -f "$_other/scripts/env.sh" ] && [ -z "${RSTAR2_SHARED_HOME:-}" ]; then
    echo "rstar2: RSTAR2_HOME=$RSTAR2_HOME is the state of another checkout ($_other), inherited from the" \
         "environment: refused. unset RSTAR2_HOME to use $ROOT/.rstar2, or set RSTAR2_SHARED_HOME=1 to share it" >&2
    unset _other
    return 1 2>/dev/null || exit 1
  fi
  unset _other
  if [ -z "${RSTAR2_HOME_NOTED:-}" ]; then
    echo "rstar2: RSTAR2_HOME=$RSTAR2_HOME comes from the environment and lies outside this checkout ($ROOT):" \
         "its state is used; unset RSTAR2_HOME to use $ROOT/.rstar2" >&2
    export RSTAR2_HOME_NOTED=1
  fi
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
