# rstar2: `make demo` runs the whole tiny recipe; `make test` lints, then runs the tests. Both set up .venv first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
ENV := source scripts/env.sh &&

.PHONY: setup lint test test-fast demo stop bench clean

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

lint: setup
	$(VENV)/bin/ruff check .

test: lint
	$(ENV) $(PY) -m pytest -q

test-fast: lint
	$(ENV) $(PY) -m pytest -q -m "not slow"

demo: setup
	$(ENV) bash scripts/demo.sh

stop:
	$(ENV) bash scripts/stop.sh

clean: stop
	rm -rf .rstar2
