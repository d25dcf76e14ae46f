# Two entry points, each of which sets itself up on a fresh machine:
#   make plan   plans llama-3-70b on 64 H100s and prints the plan
#   make test   runs the whole test suite
# torch is pinned to 2.13.0, the CPU build on this project's machines (see README).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# setuptools prints a notice on every editable install, whatever its mode (lenient, strict or
	# compat); it is about the install mode, not the project, and is silenced here alone.
	PYTHONWARNINGS=ignore::UserWarning $(BIN)/pip install --quiet -e '.[test]'
	# torchtitan's config classes alone, for the export tests' parser (its package needs triton and a
	# training stack to import whole); a folder of their own, so pip's checks never see the missing extras.
	$(BIN)/pip install --quiet --no-deps --target $(VENV)/torchtitan-parser torchtitan==0.3.0 spmd_types==0.2.3
	touch $@

.PHONY: plan test lint benchmarks
plan: $(VENV)/.installed
	$(BIN)/parallax plan llama-3-70b --hw 64xh100-sxm --global-batch 1024 --seq-len 8192

# two xdist workers, one per core of the CI machine (a third gains nothing: two keep both cores busy);
# each test file runs on one worker, so a module's fixture is built once
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: $(VENV)/.installed
	$(BIN)/ruff check .

benchmarks: $(VENV)/.installed
	$(BIN)/python benchmarks/published_runs.py
	$(BIN)/python benchmarks/plan_speed.py
