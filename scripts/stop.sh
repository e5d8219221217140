#!/usr/bin/env bash
# `make stop`: stop every service `make demo` started (Prefect server, worker, MLflow UI), by PID.
set -euo pipefail
exec "$(dirname "$0")/services.sh" down
