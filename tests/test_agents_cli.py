"""The agents' command lines as a user runs them: a user's own env package named as gymnasium's
``module:EnvId`` and a reward plugin as ``module:name`` (a tiny package on PYTHONPATH, never
imported by this test process), and the errors when the module or the name is missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

USER_PACKAGE = '''
"""A user's package: importing it registers its envs; my_reward is a reward function."""
import gymnasium as gym
from gymnasium import spaces


class OneStepSum(gym.Env):
    """A one-step text task: the prompt is a sum, the episode ends after one completion."""

    metadata = {"multi_turn": False}  # one prompt, one completion: scored by --reward
    observation_space = spaces.Text(16)
    action_space = spaces.Text(16)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return f"{self.np_random.integers(10)}+1=", {}

    def step(self, action):
        return "", 0.0, True, False, {}


def my_reward(prompt, completion, **info):
    return 1.0 if completion.strip()[:1].isdigit() else 0.0


gym.register("MyTask-v0", entry_point=OneStepSum)
gym.register("MyCartPole-v0", entry_point="gymnasium.envs.classic_control:CartPoleEnv", max_episode_steps=50)
gym.register("MyPendulum-v0", entry_point="gymnasium.envs.classic_control:PendulumEnv", max_episode_steps=50)
'''


@pytest.fixture(scope="module")
def user_pythonpath(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("user_code")
    (folder / "mypkg").mkdir()
    (folder / "mypkg" / "__init__.py").write_text(textwrap.dedent(USER_PACKAGE))
    return os.pathsep.join([str(folder), str(ROOT)])


def run_agent(pythonpath: str, script: str, *options: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, f"agents/{script}", *options],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def flat(text: str) -> str:
    """``text`` on one line: tyro prints argument errors in a box, wrapped."""
    return " ".join(text.replace("│", " ").split())


def test_rloo_trains_on_a_user_env_with_a_user_reward(user_pythonpath, tmp_path):
    done = run_agent(
        user_pythonpath,
        "rloo.py",
        "--env",
        "mypkg:MyTask-v0",
        "--reward",
        "mypkg:my_reward",
        "--total-prompts",
        "4",
        "--prompts-per-update",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "2",
        "--eval-prompts",
        "0",
        "--no-progress",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RLOO: 2 updates" in done.stdout
    # --eval-prompts 0 skips the evaluation: the summary says so instead of "nan -> nan"
    assert "nan" not in done.stdout
    assert "eval reward: not measured" in done.stdout


@pytest.mark.parametrize(
    "script, env_id, options",
    [
        ("ppo.py", "mypkg:MyCartPole-v0", ["--num-envs", "2", "--num-steps", "16", "--total-timesteps", "64"]),
        ("sac.py", "mypkg:MyPendulum-v0", ["--num-envs", "1", "--total-timesteps", "64", "--learning-starts", "32"]),
    ],
)
def test_ppo_and_sac_train_on_a_user_env(user_pythonpath, script, env_id, options):
    done = run_agent(user_pythonpath, script, "--env", env_id, *options, "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize(
    "options, message",
    [
        (
            ["--env", "mypkg:NoSuchTask-v0"],
            r"env id 'mypkg:NoSuchTask-v0': imported 'mypkg', but it did not register 'NoSuchTask-v0'; did you mean MyTask-v0",
        ),
        (
            ["--env", "mypkg:MyTask-v0", "--reward", "mypkg:no_reward"],
            r"--reward 'mypkg:no_reward': imported 'mypkg', but it has no attribute 'no_reward' and registered no reward plugin 'no_reward'",
        ),
    ],
    ids=["env-not-registered", "reward-missing"],
)
def test_missing_module_or_name_is_named(user_pythonpath, options, message):
    done = run_agent(user_pythonpath, "rloo.py", *options, "--total-prompts", "2", "--eval-prompts", "0", timeout=120)
    assert done.returncode != 0
    assert re.search(message, flat(done.stderr)), done.stderr[-3000:]


def test_ppo_names_the_missing_env_module(user_pythonpath):
    done = run_agent(
        user_pythonpath, "ppo.py", "--env", "notapkg:MyCartPole-v0", "--total-timesteps", "64", timeout=120
    )
    assert done.returncode != 0
    assert "importing 'notapkg' (which should register 'MyCartPole-v0') failed: module 'notapkg' was not found" in flat(
        done.stderr
    )


def test_a_reward_module_that_is_missing_is_named():
    from asyncvec.lm.options import LMArgs

    with pytest.raises(
        ValueError,
        match=r"--reward 'notapkg.rewards:score': importing 'notapkg.rewards' failed: module 'notapkg' was not found",
    ):
        LMArgs(reward="notapkg.rewards:score")
    with pytest.raises(ValueError, match=r"--reward 'json:__name__': json.__name__ is a str, not a reward function"):
        LMArgs(reward="json:__name__")
