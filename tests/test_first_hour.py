"""A new user's first hour, as they meet it: the installed commands (``asyncvec-ppo``, ``python -m
asyncvec.agents.ppo``) run from a folder that holds the user's own env module, with no PYTHONPATH and
no clone in sight; errors are one line naming the fix, not a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
AGENTS = ["ppo", "sac", "ppo_chunks", "sac_chunks", "rloo", "reinforce_pp", "grpo"]

SEEK_ENV = '''
"""A user's env module: importing it registers {env_id}."""
import gymnasium as gym
import numpy as np


class Seek(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {{}}

    def step(self, action):
        self.t += 1
        return np.full(2, self.t / 10, np.float32), float(action), self.t >= 10, False, {{}}


gym.register("{env_id}", entry_point=Seek)
'''

LETTER_GAME = '''
class LetterGame:
    """A text game with plain strings and no gymnasium spaces."""

    def reset(self):
        return "say a"

    def step(self, text):
        return "", float(text == "a"), True
'''


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    """A user's project folder: ``seekenv.py`` and an ``envs/`` package of their own."""
    folder = tmp_path_factory.mktemp("my_project")
    (folder / "seekenv.py").write_text(textwrap.dedent(SEEK_ENV.format(env_id="Seek-v0")))
    (folder / "envs").mkdir()
    (folder / "envs" / "__init__.py").write_text("")
    (folder / "envs" / "seek.py").write_text(textwrap.dedent(SEEK_ENV.format(env_id="SeekPkg-v0")))
    (folder / "letter_game.py").write_text(textwrap.dedent(LETTER_GAME))
    return folder


def run(command: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """``command`` from ``cwd`` as a user runs it: no PYTHONPATH, the venv's commands on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ASYNCVEC_TRACEBACK")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def short_ppo(env_id: str) -> list[str]:
    return ["--env", env_id, "--num-envs", "2", "--num-steps", "16", "--total-timesteps", "64", "--no-progress"]


def test_own_env_module_from_its_folder(user_folder):
    done = run(["asyncvec-ppo", *short_ppo("seekenv:Seek-v0")], user_folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[1].startswith("PPO 64 steps"), done.stdout  # after the line saying where logs go


def test_help_says_how_to_name_an_own_env(user_folder):
    done = run(["asyncvec-ppo", "--help"], user_folder, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "module:EnvId for your own env" in " ".join(done.stdout.replace("│", " ").split())


def test_a_users_envs_package_is_not_hidden_by_asyncvec(user_folder):
    """asyncvec installs its example envs and agents inside the package, not as top-level ``envs``/``agents``."""
    done = run([sys.executable, "-m", "asyncvec.agents.ppo", *short_ppo("envs.seek:SeekPkg-v0")], user_folder)
    assert done.returncode == 0, done.stderr[-3000:]
    empty = user_folder / "empty"
    empty.mkdir(exist_ok=True)
    code = "import importlib.util as u, asyncvec; print(u.find_spec('agents'), u.find_spec('envs'))"
    done = run([sys.executable, "-c", code], empty, timeout=120)
    assert done.stdout.split() == ["None", "None"], done.stdout + done.stderr[-3000:]


@pytest.mark.parametrize("agent", AGENTS)
def test_every_agent_runs_the_installed_way(agent, tmp_path):
    """From an empty folder: the console script and ``python -m asyncvec.agents.<agent>`` both answer ``--help``."""
    script = "asyncvec-" + agent.replace("_", "-")
    assert shutil.which(script, path=str(BIN)), f"{script} is not installed in {BIN}"
    for command in ([script, "--help"], [sys.executable, "-m", f"asyncvec.agents.{agent}", "--help"]):
        done = run(command, tmp_path, timeout=180)
        assert done.returncode == 0 and "--env" in done.stdout, (command, done.stderr[-3000:])


@pytest.mark.parametrize(
    "command, message",
    [
        (
            ["asyncvec-ppo", "--env", "CartPol-v1"],
            "PPO: error: unknown env id 'CartPol-v1'; did you mean CartPole-v1",
        ),
        (
            ["asyncvec-ppo", "--env", "nomod:X-v0"],
            "PPO: error: env id 'nomod:X-v0': importing 'nomod' (which should register 'X-v0') failed: "
            "module 'nomod' was not found (looked in the current folder",
        ),
        (
            ["asyncvec-ppo", "--env", "asyncvec/GuessNumber-v0"],
            "PPO: error: asyncvec/GuessNumber-v0 is a text env (Text observations or actions), which PPO's MLP "
            "cannot take: train a language model on it with RLOO, REINFORCE++ or GRPO: asyncvec-rloo --env "
            "asyncvec/GuessNumber-v0 (or -reinforce-pp, -grpo)",
        ),
        (
            ["asyncvec-sac", "--env", "CartPole-v1"],
            "SAC: error: SAC needs a continuous (Box) action space; CartPole-v1 has Discrete(2). "
            "For discrete actions use PPO: asyncvec-ppo --env CartPole-v1 (agents/ppo.py).",
        ),
        (
            ["asyncvec-ppo-chunks", "--env", "CartPole-v1"],
            "PPO on chunks: error: CartPole-v1: gym.make(",
        ),
        (
            ["asyncvec-rloo", "--env", "NoSuchTextEnv-v0"],
            "RLOO: error: unknown env id 'NoSuchTextEnv-v0'",
        ),
    ],
    ids=["unknown-id", "missing-module", "text-env-to-ppo", "discrete-to-sac", "discrete-to-chunks", "rloo-unknown"],
)
def test_setup_errors_are_one_line_without_traceback(user_folder, command, message):
    done = run(command, user_folder, timeout=180)
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert message in " ".join(done.stderr.split()), done.stderr[-3000:]


def test_ppo_chunks_takes_env_like_the_other_agents():
    from asyncvec.agents import ppo, ppo_chunks, rloo, sac

    for agent in (ppo, ppo_chunks, rloo, sac):
        assert "env" in agent.Args.__dataclass_fields__, agent.__name__
    assert "env_id" not in ppo_chunks.Args.__dataclass_fields__


def test_a_text_game_without_spaces_names_the_wrapper(user_folder, monkeypatch):
    monkeypatch.syspath_prepend(str(user_folder))
    from letter_game import LetterGame

    from asyncvec import AsyncLLMVectorEnv
    from asyncvec.lm import StringEnv
    from asyncvec.lm.episodes import make_text_vector_env

    expected = (
        r"env_fns\[0\]\(\) returned a LetterGame, which is not a gymnasium env: it has no observation_space and no "
        r"action_space .* runs wrapped: lambda: asyncvec.lm.StringEnv\(LetterGame\(...\)\)"
    )
    with pytest.raises(TypeError, match=expected):
        make_text_vector_env(LetterGame, 2)
    # the envs after the first are checked where they are built (here: in their worker)
    fns = [lambda: StringEnv(LetterGame()), LetterGame]
    with pytest.raises(Exception, match=r"env_fns\[1\]\(\) returned a LetterGame, which is not a gymnasium env"):
        AsyncLLMVectorEnv(fns, envs_per_worker=1)
    vec = make_text_vector_env(lambda: StringEnv(LetterGame()), 2)  # the wrapper named in the error works
    try:
        observations, _ = vec.reset(seed=0)
        assert list(observations) == ["say a", "say a"]
    finally:
        vec.close()


def test_sac_progress_bar_reaches_the_end(tmp_path):
    done = run(
        [
            "asyncvec-sac",
            "--env",
            "Pendulum-v1",
            "--num-envs",
            "1",
            "--total-timesteps",
            "600",
            "--learning-starts",
            "64",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    bar = done.stderr.replace("\r", "\n").strip().splitlines()
    assert any("600/600" in line for line in bar), bar[-5:]
