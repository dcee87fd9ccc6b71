#!/usr/bin/env bash
# GPU check of the inference layer (not part of CI; needs a CUDA GPU and `pip install -e .[vllm]`).
#
# The checks are the ones the CPU test suite runs (tests/test_vllm_policy.py,
# tests/test_vllm_server.py), from the same module, asyncvec/testing/checks.py, here on CUDA:
#   1. VLLMPolicy (tiny GPT-2 and Llama, head size 64): n completions per prompt, log-probs
#      against transformers' teacher-forced log-probs, a weight update under load with every
#      answer checked against the weights of the version it claims;
#   2. a vLLM OpenAI server (asyncvec.inference.VLLMServer) + OpenAIPolicy(server_kind="vllm"):
#      the same checks over HTTP, weights pushed through vLLM's pause/reload/version/resume routes;
#   3. one RLOO iteration on vLLM (scripts/gpu_rloo.py).
#
# Prints PASS/FAIL lines, writes everything to $OUT/gpu_check.log when $OUT is set, and exits 1
# if anything failed. Environment: PYTHON (default .venv/bin/python or python3),
# GPU_CHECK_TIMEOUT (seconds per step, default 600), LOGP_TOL (default 2e-3 on a GPU).
set -u
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
STEP_TIMEOUT=${GPU_CHECK_TIMEOUT:-600}
export LOGP_TOL=${LOGP_TOL:-2e-3}
LOG_DIR=${OUT:-}
if [ -n "$LOG_DIR" ]; then
    mkdir -p "$LOG_DIR"
    exec > >(tee -a "$LOG_DIR/gpu_check.log") 2>&1
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

FAILS=0
fail() { echo "FAIL $*"; FAILS=$((FAILS + 1)); }
echo "gpu_check: python=$PY work=$WORK $(date -u +%FT%TZ)"

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
else
    echo "SKIP nvidia-smi: not found"
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    fail "cuda: torch sees no GPU"
    exit 1
fi
if ! "$PY" -c "import vllm; print('vllm', vllm.__version__)"; then
    fail "vllm import: install it with pip install -e .[vllm]"
    exit 1
fi

for CHECK in vllm-policy vllm-server; do
    # the server check starts and stops its own server (VLLMServer: no process is left behind)
    if timeout "$STEP_TIMEOUT" "$PY" -m asyncvec.testing.checks "$CHECK" --work "$WORK/$CHECK" --device cuda; then
        :
    else
        fail "$CHECK: exited $?"
    fi
done

# One RLOO iteration on vLLM: generation, a learner update, a weight push, the new version.
if timeout "$STEP_TIMEOUT" "$PY" scripts/gpu_rloo.py; then :; else fail "gpu_rloo.py: exited $?"; fi

echo "gpu_check: $FAILS failure(s)"
[ "$FAILS" = 0 ]
