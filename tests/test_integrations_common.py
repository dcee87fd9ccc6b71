"""What the adapters share: missing-library errors, space checks, info rows, lazy imports."""

from __future__ import annotations

import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest

from asyncvec.integrations._common import check_action_batch, check_space, info_rows


@pytest.mark.parametrize(
    ("adapter", "blocked", "library", "extra"),
    [
        ("sb3", "stable_baselines3", "stable-baselines3", "sb3"),
        ("tianshou", "tianshou", "tianshou", "tianshou"),
        ("torchrl", "torchrl", "TorchRL", "torchrl"),
        ("rllib", "ray", "RLlib", "rllib"),
    ],
)
def test_a_missing_library_names_itself_and_the_extra(adapter, blocked, library, extra):
    # In a fresh interpreter where the library cannot be imported (sys.modules[name] = None).
    code = (
        f"import sys; sys.modules[{blocked!r}] = None\n"
        f"try:\n    import asyncvec.integrations.{adapter}\n"
        f"except ImportError as error:\n    print(error)\nelse:\n    print('imported')\n"
    )
    message = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"asyncvec.integrations.{extra} needs {library}" in message
    assert f"pip install 'asyncvec[{extra}]'" in message


def test_importing_asyncvec_imports_no_adapter_library():
    code = (
        "import sys, asyncvec, gymnasium\n"
        "envs = asyncvec.make_vec('CartPole-v1', 1); envs.close()\n"
        "print(sorted(m for m in ('stable_baselines3', 'tianshou', 'torchrl', 'ray', 'torch') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


def test_check_space_names_the_library_and_what_it_takes():
    check_space("X", "observation", gym.spaces.Box(0, 1, (3,)), (gym.spaces.Box,))
    check_space("X", "observation", gym.spaces.Dict({"a": gym.spaces.Discrete(2)}), (gym.spaces.Dict,))
    with pytest.raises(TypeError, match=r"X cannot take the observation space Text\(.*it takes Box, Dict spaces"):
        check_space("X", "observation", gym.spaces.Text(5), (gym.spaces.Box, gym.spaces.Dict))
    with pytest.raises(TypeError, match="cannot take the action space Dict"):
        check_space("X", "action", gym.spaces.Dict({"t": gym.spaces.Text(3)}), (gym.spaces.Dict,))
    with pytest.raises(ValueError, match=r"X passed actions of shape \(3,\); expected \(3, 2\)"):
        check_action_batch("X", np.zeros(3), gym.spaces.Box(0, 1, (2,)), 3)


def test_info_rows_split_a_vector_info_like_gymnasium():
    infos = {
        "x": np.array([1, 2, 3]),
        "_x": np.array([True, False, True]),
        "episode": {"r": np.array([0.0, 5.0, 0.0]), "_r": np.array([False, True, False])},
        "_episode": np.array([False, True, False]),
    }
    assert info_rows(infos, 3) == [{"x": 1}, {"episode": {"r": 5.0}}, {"x": 3}]
