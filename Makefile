# `make train` and `make test` each build the virtual environment on first use (python3 -m venv + pip, the
# installer's output kept in .venv/install.log and shown only when it fails), then run the main job or the CPU
# test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train topology test test-gpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.cfg
	@echo "setting up $(VENV) (python3 -m venv, pip install -e \".[test]\"; log in $(VENV)/install.log)"
	@$(PYTHON) -m venv $(VENV)
	@{ $(BIN)/python -m pip install --upgrade pip && $(BIN)/python -m pip install -e ".[test]"; } \
		> $(VENV)/install.log 2>&1 || { tail -n 40 $(VENV)/install.log; exit 1; }
	@touch $(STAMP)

train: $(STAMP)
	$(BIN)/starscream train --run-dir runs/train-$$(date +%Y%m%d-%H%M%S)

topology: $(STAMP)
	$(BIN)/starscream topology --preset mi300x-cpx-nps1 --gpus 8 --simulate

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -q

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m gpu -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
