# One-command entry points; each creates .venv and installs the CPU torch pin first, because a
# bare torch requirement on a fresh machine resolves to a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test lint docs docs-gen bench bench-attention bench-context-parallel clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

setup: $(BIN)/python
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_PIN)
	$(BIN)/pip install --quiet -e '.[dev,images,hf,hub,wandb,lmeval,docs]'

demo: setup
	$(BIN)/ecp demo --out runs/demo

lint: setup
	$(BIN)/ruff check src tests benchmarks

# The suite in TEST_WORKERS processes of one thread each (pytest-xdist; two on a 2-core machine):
# two one-thread jobs keep both cores busy without OpenMP's threads spinning against each other.
TEST_WORKERS ?= 2

test: lint
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q \
		-n $(TEST_WORKERS) --dist worksteal --durations=30

# The documentation site, built strictly (a broken link or a docstring warning fails) into site/.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The generated reference pages (command line, configuration, API), the mask pictures, the
# results page and the landing pages' results block (their prose in the leading study's
# results.md.in and landing.md.in, their numbers from its committed report).
docs-gen: setup
	$(BIN)/python -m ecp_lm.docsgen

bench: setup
	$(BIN)/ecp bench --decode --json benchmarks/results/bench_cpu.json --plot benchmarks/results/bench_cpu.png

bench-attention: setup
	$(BIN)/python benchmarks/attention.py --json benchmarks/results/attention.json

bench-context-parallel: setup
	$(BIN)/python benchmarks/context_parallel.py --json benchmarks/results/context_parallel_cpu.json

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache .ruff_cache
