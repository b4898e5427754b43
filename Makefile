# `make demo` and `make test` each set up a fresh machine first (scripts/setup.sh is idempotent).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench clean

setup:
	bash scripts/setup.sh

# The study's point on any machine: on an emulated NVMe-oF device (a twin: per-read network round
# trips), serial and parallel reads part; three repetitions in ABBA blocks give every ratio an
# interval across runs. About 13 min on the 2-core VMs. `DEMO_ARGS=` runs every profile on the
# real disk instead.
DEMO_ARGS ?= --device twin:nvmeof-tcp-x4 --profiles kvscope,kvscope-serial,stock \
	--model qwen2.5-7b --requests 8 --concurrency 1,8 --repeats 3

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
