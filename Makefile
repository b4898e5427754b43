# `make demo` and `make test` each set up a fresh machine first (scripts/setup.sh is idempotent).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/kvscope demo $(DEMO_ARGS)

# Two workers, a test file each at a time: most of a live test is vLLM starting up (one core
# importing), so two files side by side take about the time of one on the 2-core machines.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=30 $(PYTEST_ARGS)

bench: setup
	$(PY) bench/live_stack.py

clean:
	rm -rf $(VENV) runs .pytest_cache
