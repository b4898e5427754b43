# `make demo` and `make test` each set up a fresh machine first (scripts/setup.sh is idempotent).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/kvscope demo $(DEMO_ARGS)

test: setup
	$(PY) -m pytest --durations=30 $(PYTEST_ARGS)

bench: setup
	$(PY) bench/live_stack.py

clean:
	rm -rf $(VENV) runs .pytest_cache
