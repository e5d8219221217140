# rstar2: `make demo` runs the whole tiny recipe (it learns: RL beats SFT); `make demo-quick` runs the same DAG at
# sizes that learn nothing (a machinery check); `make demo-fault` rehearses a failure and the UI's Retry;
# `make rehearsal` runs the production profile scaled down through the production service stack;
# `make test` lints, then runs the tests; `make test-all` adds the production rehearsal's full run. All set up .venv.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
ENV := source scripts/env.sh &&

.PHONY: setup lint test test-all test-fast demo demo-quick demo-fault rehearsal stop bench clean

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

lint: setup
	$(VENV)/bin/ruff check .

test: lint
	$(ENV) $(PY) -m pytest -q -m "not rehearsal_run"

# make test and the rehearsal's full run (~35 min more on 2 cores; docs/rehearsal.md)
test-all: lint
	$(ENV) $(PY) -m pytest -q

test-fast: lint
	$(ENV) $(PY) -m pytest -q -m "not slow"

# the demo's wall time starts before set-up (scripts/demo.sh reports it)
DEMO_T0 = export RSTAR2_DEMO_T0=$$(date +%s.%N) && $(MAKE) --no-print-directory setup &&
FAULT ?= rl-stage-1:step=2

demo:
	@$(DEMO_T0) $(ENV) bash scripts/demo.sh

demo-quick:
	@$(DEMO_T0) $(ENV) bash scripts/demo.sh --quick

demo-fault:
	@$(DEMO_T0) $(ENV) bash scripts/demo.sh --quick --fault $(FAULT)

# the production profile scaled down, through the production service stack (docs/rehearsal.md)
rehearsal: setup
	$(ENV) $(VENV)/bin/rstar2 rehearsal

stop:
	$(ENV) bash scripts/stop.sh

clean: stop
	rm -rf .rstar2
