#!/usr/bin/env bash
# Local services of the pipeline, started once and left up: a Prefect server (SQLite under
# $RSTAR2_HOME/prefect, 127.0.0.1), the process work pool `rstar2-local` with one worker polling every
# second (flow runs start as `python -m flows.flow_process`, docs/faults.md), and the MLflow UI (127.0.0.1, the
# same SQLite DB the flows log to).
#
# Idle cost (bench/services_idle.py; figures in docs/demo.md): ~5% of one core in all, most of it the
# Prefect server's own task loop. The MLflow server runs without its GenAI job runner (LLM judges, prompt
# optimisation: 8 Huey consumer processes that cost ~23 CPU-seconds in the first minute, while the demo's
# run starts, and 0.008 CPU-s/s idle). Turning off Prefect server services the pipeline does not use
# (late runs, pause expiry, repossessor, triggers, foreman) and polling every 5 s instead of 1 s saved
# nothing measurable, so the server runs its defaults and the worker polls every second.
#
#   scripts/services.sh up      start what is not running; writes $RSTAR2_HOME/services.env
#   scripts/services.sh down    stop what `up` started (by the PIDs in $RSTAR2_HOME/pids/)
#   scripts/services.sh status
#   scripts/services.sh wait    wait until the Prefect server and the MLflow UI answer
#
# Ports: RSTAR2_PREFECT_PORT (default 4200), RSTAR2_MLFLOW_PORT (default 5000); a busy port is
# replaced by a free one. RSTAR2_NO_MLFLOW_UI=1 skips the MLflow UI (tests).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export RSTAR2_REPO="$ROOT"
PY="$ROOT/.venv/bin/python"
BIN="$ROOT/.venv/bin"
PIDS="$RSTAR2_HOME/pids"
LOGS="$RSTAR2_HOME/logs"
ENVF="$RSTAR2_HOME/services.env"
mkdir -p "$PIDS" "$LOGS" "$PREFECT_HOME"

alive() { [ -f "$PIDS/$1.pid" ] && kill -0 "$(cat "$PIDS/$1.pid")" 2>/dev/null; }

free_port() {  # $1 = preferred port; prints it if free, else a free one
  "$PY" - "$1" <<'PYEOF'
import socket, sys
want = int(sys.argv[1])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port we just freed may sit in TIME_WAIT
try:
    s.bind(("127.0.0.1", want))
except OSError:
    s.close(); s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1]); s.close()
PYEOF
}

start() {  # $1 = name, rest = command; own session so that `down` can stop its whole process group
  local name=$1; shift
  setsid "$@" >"$LOGS/$name.log" 2>&1 < /dev/null &
  echo $! > "$PIDS/$name.pid"
}

wait_http() {  # $1 = url, $2 = what, $3 = timeout s
  local t0=$SECONDS
  until "$PY" -c "import sys,urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; do
    if (( SECONDS - t0 > $3 )); then echo "[services] $2 did not answer at $1 within $3 s; see $LOGS" >&2; return 1; fi
    sleep 1
  done
  echo "[services] $2 up at $1 ($(( SECONDS - t0 )) s)"
}

up() {
  [ -f "$ENVF" ] && source "$ENVF"
  if ! alive prefect-server; then
    PREFECT_PORT=$(free_port "${RSTAR2_PREFECT_PORT:-4200}")
    start prefect-server env PREFECT_SERVER_API_HOST=127.0.0.1 PREFECT_UI_API_URL="http://127.0.0.1:$PREFECT_PORT/api" \
      "$BIN/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT"
  fi
  local db_pid=""
  if [ -z "${RSTAR2_NO_MLFLOW_UI:-}" ] && ! alive mlflow-ui; then
    # create/migrate the DB once, before the MLflow server starts, so that the server and the flows never
    # migrate it concurrently; meanwhile the Prefect server starts
    mkdir -p "$RSTAR2_HOME/mlartifacts"
    "$PY" -c "import sys; from mlflow.tracking import MlflowClient; MlflowClient(sys.argv[1]).search_experiments()" \
      "sqlite:///$RSTAR2_HOME/mlflow.db" > "$LOGS/mlflow-db.log" 2>&1 &
    db_pid=$!
  fi
  export PREFECT_API_URL="http://127.0.0.1:$PREFECT_PORT/api"
  wait_http "$PREFECT_API_URL/health" "Prefect server" 240
  # the pool's flow-run command is flows/flow_process.py (Prefect's engine; a run whose final state the API
  # accepted exits 0, so the worker does not mark it Crashed over a Retry), and its processes start in the
  # repository, not in a temporary directory the worker deletes when it thinks the process ended (a retry's
  # process, started while the failed attempt's was still ending, lost its directory): set on every `up`
  "$PY" - "$PREFECT_HOME/rstar2-local-template.json" "$RSTAR2_REPO" <<'PYEOF'
import json, sys
from prefect.workers.process import ProcessWorker
t = ProcessWorker.get_default_base_job_template()
t["variables"]["properties"]["command"]["default"] = f"{sys.executable} -m flows.flow_process"
t["variables"]["properties"]["working_dir"]["default"] = sys.argv[2]
open(sys.argv[1], "w").write(json.dumps(t))
PYEOF
  "$BIN/prefect" work-pool create rstar2-local --type process --overwrite \
    --base-job-template "$PREFECT_HOME/rstar2-local-template.json" >/dev/null
  if ! alive prefect-worker; then
    start prefect-worker env PREFECT_API_URL="$PREFECT_API_URL" PREFECT_WORKER_QUERY_SECONDS=1 \
      PREFECT_WORKER_PREFETCH_SECONDS=5 RSTAR2_REPO="$RSTAR2_REPO" \
      "$BIN/prefect" worker start --pool rstar2-local --type process --name "rstar2-local-worker"
  fi
  if [ -n "$db_pid" ]; then
    if ! wait "$db_pid"; then
      echo "[services] creating the MLflow DB $RSTAR2_HOME/mlflow.db failed:" >&2; tail -5 "$LOGS/mlflow-db.log" >&2
      return 1
    fi
    MLFLOW_PORT=$(free_port "${RSTAR2_MLFLOW_PORT:-5000}")
    start mlflow-ui env MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false "$BIN/mlflow" server --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 \
      --backend-store-uri "sqlite:///$RSTAR2_HOME/mlflow.db" --default-artifact-root "$RSTAR2_HOME/mlartifacts"
  fi
  cat > "$ENVF" <<ENVEOF
PREFECT_PORT=$PREFECT_PORT
MLFLOW_PORT=${MLFLOW_PORT:-}
export PREFECT_API_URL=$PREFECT_API_URL
ENVEOF
  if alive mlflow-ui; then echo "[services] MLflow UI starting at http://127.0.0.1:$MLFLOW_PORT ('$0 wait' waits for it)"; fi
}

wait_all() {
  source "$ENVF"
  wait_http "$PREFECT_API_URL/health" "Prefect server" 240
  if alive mlflow-ui; then wait_http "http://127.0.0.1:$MLFLOW_PORT/health" "MLflow UI" 300; fi
}

descendants() {  # every process below $1 (flow runs the worker started live in sessions of their own)
  local c
  for c in $(pgrep -P "$1" 2>/dev/null); do echo "$c"; descendants "$c"; done
}

down() {
  # Flow-run processes first (a worker's children run in their own sessions, so stopping the worker's
  # process group would orphan them), then the worker, the server and the MLflow UI.
  if alive prefect-worker; then
    local runs; runs=$(descendants "$(cat "$PIDS/prefect-worker.pid")")
    for r in $runs; do kill -TERM -- "-$r" 2>/dev/null || kill -TERM "$r" 2>/dev/null || true; done
    sleep 1
    for r in $runs; do kill -KILL -- "-$r" 2>/dev/null || kill -KILL "$r" 2>/dev/null || true; done
    [ -n "$runs" ] && echo "[services] stopped flow-run processes: $(echo $runs)"
  fi
  for f in "$PIDS"/prefect-worker.pid "$PIDS"/*.pid; do
    [ -e "$f" ] || continue
    local pid name; pid=$(cat "$f"); name=$(basename "$f" .pid)
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -KILL -- "-$pid" 2>/dev/null || true
      echo "[services] stopped $name (pid $pid)"
    fi
    rm -f "$f"
  done
  rm -f "$ENVF"
}

status() {
  for f in "$PIDS"/*.pid; do
    [ -e "$f" ] || { echo "[services] nothing started"; return 0; }
    local name; name=$(basename "$f" .pid)
    if alive "$name"; then echo "$name: running (pid $(cat "$f"))"; else echo "$name: not running"; fi
  done
  [ -f "$ENVF" ] && cat "$ENVF"
}

case "${1:-}" in
  up) up ;;
  wait) wait_all ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status|wait" >&2; exit 2 ;;
esac
