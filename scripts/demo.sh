#!/usr/bin/env bash
# `make demo`: start the local services (Prefect server + process worker + MLflow UI), deploy
# prefect.yaml, run `rstar2/full-recipe` on the tiny profile through the worker, show progress, then
# print the stage table, the registered model version and the UI URLs. Servers stay up for browsing;
# `make stop` stops them.
#
# RSTAR2_DEMO_PROFILE (default tiny) and RSTAR2_DEMO_OVERRIDES (space-separated dotted overrides;
# default DEMO_SHRINK below, set it to "" to run the profile as it is) change what runs;
# RSTAR2_FAULT_INJECT=rl-stage-1:step=2 shows a failure to Retry from the UI.
#
# DEMO_SHRINK keeps the same DAG (curate, SFT, 3 RL stages with the hard subset, 4 evaluations,
# registration) at sizes that finish in minutes on 2 CPU cores: the tiny profile as written trains
# SFT on 16,000 demonstrations (~12 minutes on such a machine) before RL and four evaluations.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export RSTAR2_REPO="$ROOT"
t0=$SECONDS
echo "[demo] starting services (state in $RSTAR2_HOME)"
scripts/services.sh up
source "$RSTAR2_HOME/services.env"
echo "[demo] deploying prefect.yaml"
.venv/bin/prefect --no-prompt deploy --all > "$RSTAR2_HOME/logs/deploy.log" 2>&1 || {
  tail -30 "$RSTAR2_HOME/logs/deploy.log"; exit 1; }
grep -o "Deployment '[^']*' successfully created[^.]*" "$RSTAR2_HOME/logs/deploy.log" | sed 's/^/[demo] /' || true
DEMO_SHRINK="data.synthetic.n_sft=16 data.synthetic.n_rl=16 data.synthetic.n_eval=8 sft.epochs=1 sft.batch_size=8
 sft.micro_batch_size=8 sft.max_seq_len=1024 rl.prompts_per_step=2 rl.grpo.group_size=2 rl.grpo.oversample=2
 rl.micro_batch_size=4 rl.stages.0.steps=3 rl.stages.1.steps=1 rl.stages.2.steps=1 rl.stages.2.hard_subset_k=2
 rl.stages.0.max_response_tokens=64 rl.stages.1.max_response_tokens=64 rl.stages.2.max_response_tokens=64
 eval.k=1 eval.max_tokens=64 eval.max_turns=2 eval.benchmarks.0.limit=4"
sets=()
for o in ${RSTAR2_DEMO_OVERRIDES-$DEMO_SHRINK}; do sets+=(--set "$o"); done
echo "[demo] running rstar2/full-recipe (profile ${RSTAR2_DEMO_PROFILE:-tiny}) through the worker"
rc=0
.venv/bin/python -m flows.client run rstar2/full-recipe --param "profile=\"${RSTAR2_DEMO_PROFILE:-tiny}\"" \
  "${sets[@]}" --id-file "$RSTAR2_HOME/last-flow-run" || rc=$?
elapsed=$(( SECONDS - t0 ))
scripts/services.sh wait >/dev/null || true
echo
echo "Prefect UI:  http://127.0.0.1:$PREFECT_PORT/runs/flow-run/$(cat "$RSTAR2_HOME/last-flow-run")"
[ -n "${MLFLOW_PORT:-}" ] && echo "MLflow UI:   http://127.0.0.1:$MLFLOW_PORT (experiment rstar2; Models -> rstar2-agent)"
echo "demo wall time: ${elapsed} s (services, deploy and the recipe run); servers left up, 'make stop' stops them"
echo "$(date -u +%FT%TZ) demo ${elapsed}s rc=$rc profile=${RSTAR2_DEMO_PROFILE:-tiny} overrides='${RSTAR2_DEMO_OVERRIDES-shrink}'" \
  >> "$RSTAR2_HOME/demo-timings.log"
if [ $rc -ne 0 ]; then
  echo "[demo] the run did not complete: retry it from the Prefect UI (flow run page -> Retry), or"
  echo "       .venv/bin/python -m flows.client retry $(cat "$RSTAR2_HOME/last-flow-run")"
fi
exit $rc
