# One-command entry points; each creates .venv and installs the CPU torch pin first, because a
# bare torch requirement on a fresh machine resolves to a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test lint bench bench-attention bench-context-parallel clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

setup: $(BIN)/python
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_PIN)
	$(BIN)/pip install --quiet -e '.[dev,images,hf,hub,wandb,lmeval]'

demo: setup
	$(BIN)/ecp demo --out runs/demo

lint: setup
	$(BIN)/ruff check src tests benchmarks

test: lint
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python -m pytest -q

bench: setup
	$(BIN)/ecp bench --decode --json benchmarks/results/bench_cpu.json --plot benchmarks/results/bench_cpu.png

bench-attention: setup
	$(BIN)/python benchmarks/attention.py --json benchmarks/results/attention.json

bench-context-parallel: setup
	$(BIN)/python benchmarks/context_parallel.py --json benchmarks/results/context_parallel_cpu.json

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
