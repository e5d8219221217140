#!/usr/bin/env bash
# `make demo`: start the local services (Prefect server + process worker + MLflow UI), deploy
# prefect.yaml, run `rstar2/full-recipe` through the worker with a progress line per task, then print the
# summary (stage table with pass@1 and seconds per stage, the promotion decision with its numbers, the
# registered version, where the time went, the PNG of the run's curves), the UI URLs and the wall time
# with the machine's load. Servers stay up for browsing; `make stop` stops them.
#
#   scripts/demo.sh                  the tiny profile as written: SFT, then RL that beats it (make demo)
#   scripts/demo.sh --quick          the same DAG at sizes that learn nothing, in ~2 minutes: a machinery
#                                    check, every pass@1 ~0 (make demo-quick; scripts/demo-quick.overrides)
#   scripts/demo.sh --fault SPEC     inject a fault (RSTAR2_FAULT_INJECT syntax, e.g. rl-stage-1:step=2) into
#                                    this run only, with task retries off, so that the flow run fails there
#                                    and the UI's Retry resumes it (make demo-fault: --quick --fault
#                                    rl-stage-1:step=2). The fault fires once per run: every new run fails.
#
# RSTAR2_DEMO_PROFILE (default tiny) picks the profile; RSTAR2_DEMO_OVERRIDES (space-separated dotted
# overrides) is added after the mode's own. Timings go to $RSTAR2_HOME/demo-timings.jsonl
# (bench/demo_profile.py reads them with the run's stage timings).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export RSTAR2_REPO="$ROOT"

quick=0 fault=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --fault) fault="${2:?--fault needs a spec such as rl-stage-1:step=2}"; shift ;;
    --fault=*) fault="${1#--fault=}" ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "[demo] unknown argument '$1' (use --quick, --fault SPEC, --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$fault" ] && ! err=$(.venv/bin/python -c "import sys; from rstar2_core.faults import parse_fault_spec
parse_fault_spec(sys.argv[1])" "$fault" 2>&1); then  # a bad spec fails here, before any service starts
  echo "[demo] --fault: ${err##*$'\n'}" >&2; exit 2
fi

now() { date +%s.%N; }
t_start=${RSTAR2_DEMO_T0:-$(now)}   # the Makefile sets it before `make setup`
t_script=$(now)
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
loads="$RSTAR2_HOME/logs/demo-load.$$"
mkdir -p "$RSTAR2_HOME/logs"
(while sleep 15; do cut -d' ' -f1 /proc/loadavg; done) > "$loads" 2>/dev/null &
load_pid=$!
trap 'kill $load_pid 2>/dev/null || true; rm -f "$loads"' EXIT

profile=${RSTAR2_DEMO_PROFILE:-tiny}
overrides=()
mode="as written"
if [ $quick = 1 ]; then
  mode="QUICK (machinery only: learns nothing)"
  while read -r o; do overrides+=("$o"); done < <(grep -v '^\s*\(#\|$\)' scripts/demo-quick.overrides)
fi
envs=()
if [ -n "$fault" ]; then
  overrides+=("pipeline.task_retries=0")   # a retried task would absorb the fault: let the flow run fail
  envs+=(--env "RSTAR2_FAULT_INJECT=$fault")
  mode="$mode, fault $fault"
fi
for o in ${RSTAR2_DEMO_OVERRIDES:-}; do overrides+=("$o"); done
sets=()
for o in ${overrides[@]+"${overrides[@]}"}; do sets+=(--set "$o"); done

if [ $quick = 1 ]; then
  echo "[demo] QUICK MODE: the recipe's DAG at sizes far too small to learn anything (every pass@1 ~0, no alias)."
  echo "[demo]             It checks the machinery; 'make demo' runs the profile as written and shows learning."
fi
echo "[demo] starting services (state in $RSTAR2_HOME)"
scripts/services.sh up
source "$RSTAR2_HOME/services.env"
t_services=$(now)
echo "[demo] deploying prefect.yaml"
.venv/bin/prefect --no-prompt deploy --all > "$RSTAR2_HOME/logs/deploy.log" 2>&1 || {
  tail -30 "$RSTAR2_HOME/logs/deploy.log"; exit 1; }
grep -o "Deployment '[^']*' successfully created" "$RSTAR2_HOME/logs/deploy.log" | sed 's/^/[demo] /' || true
t_deploy=$(now)
echo "[demo] running rstar2/full-recipe (profile $profile, $mode) through the worker"
rc=0
.venv/bin/python -m flows.client run rstar2/full-recipe --param "profile=\"$profile\"" \
  ${sets[@]+"${sets[@]}"} ${envs[@]+"${envs[@]}"} --id-file "$RSTAR2_HOME/last-flow-run" || rc=$?
t_run=$(now)
fid=$(cat "$RSTAR2_HOME/last-flow-run" 2>/dev/null || echo "")
scripts/services.sh wait >/dev/null || true
load_end=$(cut -d' ' -f1-3 /proc/loadavg)
load_mean=$(awk '{s+=$1; n++} END {if (n) printf "%.2f", s/n; else print "n/a"}' "$loads")
total=$(awk -v a="$t_start" -v b="$t_run" 'BEGIN {printf "%.0f", b-a}')
phases=$(awk -v a="$t_start" -v s="$t_script" -v v="$t_services" -v d="$t_deploy" -v r="$t_run" \
  'BEGIN {printf "set-up %.0f s, services %.0f s, deploy %.0f s, flow run %.0f s", s-a, v-s, d-v, r-d}')
echo
echo "Prefect UI:  http://127.0.0.1:$PREFECT_PORT/v2/runs/flow-run/$fid (classic UI: http://127.0.0.1:$PREFECT_PORT/runs/flow-run/$fid)"
if [ -n "${MLFLOW_PORT:-}" ]; then
  exp=$(.venv/bin/python - "$profile" "$MLFLOW_PORT" <<'PYEOF' 2>/dev/null || true
import json, sys, urllib.parse, urllib.request
from rstar2_core.config import load_config
name = load_config(sys.argv[1]).tracking.experiment
q = urllib.parse.urlencode({"experiment_name": name})
url = f"http://127.0.0.1:{sys.argv[2]}/api/2.0/mlflow/experiments/get-by-name?{q}"
print(json.load(urllib.request.urlopen(url, timeout=10))["experiment"]["experiment_id"])
PYEOF
)
  echo "MLflow UI:   http://127.0.0.1:$MLFLOW_PORT/#/experiments/${exp:-0}/runs?workflowType=machine_learning" \
       "(experiment rstar2, runs table with the stage runs nested; Model registry -> rstar2-agent)"
fi
echo "demo wall time: $total s ($phases); load average at start $load_start, at end $load_end, mean of the" \
     "1-min load during the run $load_mean (2 cores); servers left up, 'make stop' stops them"
.venv/bin/python - "$RSTAR2_HOME/demo-timings.jsonl" ${overrides[@]+"${overrides[@]}"} <<PYEOF
import json, sys, time
rec = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "flow_run_id": "$fid", "rc": $rc,
       "profile": "$profile", "quick": bool($quick), "fault": "$fault", "overrides": sys.argv[2:],
       "t_start": $t_start, "t_script": $t_script, "t_services": $t_services, "t_deploy": $t_deploy, "t_run": $t_run,
       "load_start": "$load_start", "load_end": "$load_end", "load_mean": "$load_mean"}
open(sys.argv[1], "a").write(json.dumps(rec) + "\n")
PYEOF
if [ $rc -ne 0 ]; then
  echo "[demo] the run did not complete. Retry it from the Prefect UI: open http://127.0.0.1:$PREFECT_PORT, Runs,"
  echo "       click the failed 'full-recipe $profile' run, then the run's menu (the ⋮ button at the top right) ->"
  echo "       Retry -> confirm; the worker resumes it (finished stages are reused). Or, the same from a shell:"
  echo "       .venv/bin/python -m flows.client retry $fid"
fi
exit $rc
