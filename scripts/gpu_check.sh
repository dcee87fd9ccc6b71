#!/usr/bin/env bash
# GPU check of the inference layer (not part of CI; needs a CUDA GPU and `pip install -e .[vllm]`).
#
#   1. builds tiny Llama and GPT-2 folders with build_tiny_lm (no downloads);
#   2. VLLMPolicy: samples, compares vLLM's token log-probs with transformers' teacher-forced
#      log-probs on the same tokens, loads new weights and compares again;
#   3. `vllm serve` + OpenAIPolicy: the same comparison over HTTP, and load_weights refusing a
#      non-asyncvec server with a clear error.
#
# Prints PASS/FAIL/SKIP lines, writes everything to $OUT/gpu_check.log when $OUT is set, and
# exits 1 if anything failed. Environment: PYTHON (default .venv/bin/python or python3),
# GPU_CHECK_TIMEOUT (seconds per step, default 600), LOGP_TOL (default 2e-3).
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
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill "$SERVER_PID" 2>/dev/null
        for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -9 "$SERVER_PID" 2>/dev/null
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

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

# ---------------------------------------------------------------- shared Python helpers
cat > "$WORK/common.py" <<'EOF'
import os
import sys

import torch
import transformers

TOL = float(os.environ["LOGP_TOL"])
PROMPTS = ["3+4=", "12+30=", "Hello, world! 7+2=", "9+9="]
FAILS = []


def report(ok, name, detail):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILS.append(name)


def teacher_forced(folder, prompt, token_ids):
    """Transformers' float32 log-probs of token_ids after prompt (temperature 1)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt_ids = tokenizer(prompt).input_ids
    ids = torch.tensor([prompt_ids + list(token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0].tolist()


def compare(name, folder, prompts, outputs):
    worst = 0.0
    for prompt, out in zip(prompts, outputs):
        if not out.token_ids:
            report(False, name, f"no token ids for {prompt!r}: {out}")
            return
        expected = teacher_forced(folder, prompt, out.token_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(out.token_logps, expected)))
    report(worst <= TOL, name, f"max |logp_vllm - logp_hf| = {worst:.2e} (tolerance {TOL:g})")


def parse_digit(text):
    return int(text.strip()[0])


def finish():
    sys.exit(1 if FAILS else 0)
EOF

# --------------------------------------------------------------------- 1. tiny models
if timeout "$STEP_TIMEOUT" "$PY" - "$WORK" <<'EOF'
import sys
from asyncvec.inference import build_tiny_lm

work = sys.argv[1]
for arch in ("llama", "gpt2"):
    # head size 64: supported by vLLM's attention kernels
    build_tiny_lm(f"{work}/{arch}", arch=arch, n_layer=2, n_embd=128, n_head=2, seed=0)
    build_tiny_lm(f"{work}/weights/{arch}-v1", arch=arch, n_layer=2, n_embd=128, n_head=2, seed=1)
print("PASS build_tiny_lm: llama and gpt2 folders (v0 and v1)")
EOF
then :; else fail "build_tiny_lm: exit $?"; exit 1; fi

# ------------------------------------------------------------------- 2. VLLMPolicy
for ARCH in llama gpt2; do
    if timeout "$STEP_TIMEOUT" "$PY" - "$WORK" "$ARCH" <<'EOF'
import sys

sys.path.insert(0, sys.argv[1])
import gymnasium as gym
from common import PROMPTS, compare, finish, parse_digit, report

from asyncvec.inference import VLLMPolicy

work, arch = sys.argv[1], sys.argv[2]
folder, new_folder = f"{work}/{arch}", f"{work}/weights/{arch}-v1"
engine = {"dtype": "float32", "gpu_memory_utilization": 0.3, "enforce_eager": True, "seed": 0}
try:
    policy = VLLMPolicy(folder, parse_digit, action_space=gym.spaces.Discrete(10), max_new_tokens=8,
                        max_batch_size=len(PROMPTS), max_wait_ms=200, engine_kwargs=engine)
except Exception as exc:
    report(False, f"VLLMPolicy[{arch}] start", repr(exc))
    finish()
with policy:
    outputs = policy.act(PROMPTS, timeout=300)
    report(all(out.policy_version == 0 for out in outputs), f"VLLMPolicy[{arch}] sample",
           f"{len(outputs)} answers, fallbacks={sum(o.fallback for o in outputs)}, texts={[o.text for o in outputs]}")
    compare(f"VLLMPolicy[{arch}] logprobs vs transformers", folder, PROMPTS, outputs)
    try:
        policy.load_weights(new_folder, 1)
        after = policy.act(PROMPTS, timeout=300)
        report(all(out.policy_version == 1 for out in after), f"VLLMPolicy[{arch}] load_weights", "answers report version 1")
        compare(f"VLLMPolicy[{arch}] logprobs after update vs transformers(v1)", new_folder, PROMPTS, after)
    except Exception as exc:
        report(False, f"VLLMPolicy[{arch}] load_weights", repr(exc))
finish()
EOF
    then :; else fail "VLLMPolicy[$ARCH]: step exited $?"; fi
done

# ------------------------------------------------------ 3. vllm serve + OpenAIPolicy
PORT=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1]); s.close()")
"$PY" -m vllm.entrypoints.openai.api_server --model "$WORK/llama" --served-model-name tiny --host 127.0.0.1 \
    --port "$PORT" --dtype float32 --gpu-memory-utilization 0.3 --enforce-eager > "$WORK/vllm_serve.log" 2>&1 &
SERVER_PID=$!
READY=0
for _ in $(seq 1 "$STEP_TIMEOUT"); do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then break; fi
    if "$PY" -c "import httpx, sys; sys.exit(0 if httpx.get('http://127.0.0.1:$PORT/health', timeout=2).status_code == 200 else 1)" 2>/dev/null; then
        READY=1
        break
    fi
    sleep 1
done
if [ "$READY" = 1 ]; then
    echo "PASS vllm serve: healthy on port $PORT"
    if timeout "$STEP_TIMEOUT" "$PY" - "$WORK" "$PORT" <<'EOF'
import sys

sys.path.insert(0, sys.argv[1])
import gymnasium as gym
from common import PROMPTS, compare, finish, parse_digit, report

from asyncvec.inference import OpenAIPolicy

work, port = sys.argv[1], sys.argv[2]
with OpenAIPolicy(f"http://127.0.0.1:{port}", "tiny", parse_digit, action_space=gym.spaces.Discrete(10),
                  max_new_tokens=8, request_timeout_s=120) as policy:
    try:
        outputs = policy.act(PROMPTS, timeout=300)
        report(True, "OpenAIPolicy vs vllm serve", f"texts={[o.text for o in outputs]}")
        compare("OpenAIPolicy(vllm serve) logprobs vs transformers", f"{work}/llama", PROMPTS, outputs)
    except Exception as exc:
        report(False, "OpenAIPolicy vs vllm serve", repr(exc))
    try:
        policy.load_weights(f"{work}/weights/llama-v1", 1)
        report(False, "OpenAIPolicy.load_weights on vllm serve", "expected a 'not an asyncvec server' error")
    except Exception as exc:
        report("not an asyncvec server" in str(exc), "OpenAIPolicy.load_weights on vllm serve", f"refused: {exc}")
finish()
EOF
    then :; else fail "OpenAIPolicy vs vllm serve: step exited $?"; fi
else
    fail "vllm serve: not healthy; last log lines:"
    tail -n 30 "$WORK/vllm_serve.log"
fi

# One RLOO iteration on vLLM: generation, a learner update, a weight push, the new version.
if "$PY" scripts/gpu_rloo.py; then :; else fail "gpu_rloo.py: exited $?"; fi

echo "gpu_check: $FAILS failure(s)"
[ "$FAILS" = 0 ]
