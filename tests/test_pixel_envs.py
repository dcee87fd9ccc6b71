"""Pixel envs (envs/pixels.py) and image + instruction observations through AsyncLLMVectorEnv.

The image travels through shared memory and only the instruction string over the pipe: the
bytes a worker pickles per step are measured here on a real EnvGroup.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import asyncvec.envs  # noqa: F401  (registers the ids)
from asyncvec import AsyncLLMVectorEnv, WorkerError
from asyncvec.control import HashedInstruction, hashed_words
from asyncvec.envs.pixels import TASKS, PixelReachEnv, make_pixel_env
from asyncvec.vector.split_obs import shared_subspace
from asyncvec.vector.worker import EnvGroup, dumps

PIXEL_IDS = ["asyncvec/PixelPendulum-v0", "asyncvec/PixelMountainCarContinuous-v0", "asyncvec/PixelCartPole-v0"]


@pytest.mark.parametrize("env_id", PIXEL_IDS)
def test_pixel_env_observations(env_id: str) -> None:
    env = gym.make(env_id)
    obs, _ = env.reset(seed=3)
    assert env.observation_space.contains(obs)
    assert obs["image"].shape == (64, 64, 3) and obs["image"].dtype == np.uint8
    task = next(name for name, spec in TASKS.items() if spec[0].split("-")[0] in env_id)
    assert obs["instruction"] in TASKS[task][2]
    assert isinstance(env.action_space, gym.spaces.Box) and env.action_space.shape == (1,)
    again, _ = gym.make(env_id).reset(seed=3)
    np.testing.assert_array_equal(again["image"], obs["image"])  # seeded: same scene
    assert again["instruction"] == obs["instruction"]
    first = obs["image"]
    changed = False
    for _ in range(15):
        obs, reward, terminated, truncated, _ = env.step(env.action_space.high)
        assert env.observation_space.contains(obs) and np.isfinite(reward)
        changed |= not np.array_equal(obs["image"], first)
        if terminated or truncated:
            break
    assert changed, "the image must follow the state"
    env.close()


def test_instructions_vary_across_episodes() -> None:
    env = make_pixel_env("pendulum", size=16)
    seen = {env.reset(seed=seed)[0]["instruction"] for seed in range(30)}
    assert len(seen) > 1


def test_pixel_env_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown pixel task 'walker'"):
        make_pixel_env("walker")
    with pytest.raises(ValueError, match="size must be an int >= 8"):
        make_pixel_env("pendulum", size=4)


def test_reach_env_rewards_the_named_square_only() -> None:
    env = gym.make("asyncvec/PixelReach-v0", size=16)
    obs, info = env.reset(seed=5)
    assert env.observation_space.contains(obs) and obs["image"].shape == (16, 16, 3)
    inner = env.unwrapped
    named = list(PixelReachEnv.COLORS)[info["target"]]
    assert named in obs["instruction"]
    color = np.array(PixelReachEnv.COLORS[named])
    assert (obs["image"].reshape(-1, 3) == color).all(axis=1).any(), "the named square is drawn"
    total, steps = 0.0, 0
    while True:  # heading for the named square ends on it; the reward is minus the distance to it
        heading = inner._squares[inner._target] - inner._dot
        obs, reward, terminated, truncated, _ = env.step(np.clip(heading / 0.1, -1, 1).astype(np.float32))
        total, steps = total + reward, steps + 1
        assert not terminated and reward <= 0.0
        if truncated:
            break
    assert steps == 40 and reward > -1e-6 and total > -5.0
    with pytest.raises(ValueError, match="size must be an int >= 8"):
        PixelReachEnv(size=4)


def test_hashed_instruction_feeds_a_network_the_words() -> None:
    env = HashedInstruction(gym.make("asyncvec/PixelReach-v0", size=16), buckets=64)
    first, _ = env.reset(seed=0)
    assert env.observation_space.contains(first)
    words = {tuple(env.reset(seed=seed)[0]["instruction"]) for seed in range(20)}
    assert len(words) > 3  # colours and phrasings differ: so do the features
    np.testing.assert_array_equal(hashed_words("Go to the RED square", 64), hashed_words("go to the red square", 64))
    with pytest.raises(ValueError, match="expected a Dict observation space with a Text 'instruction'"):
        HashedInstruction(gym.make("Pendulum-v1"))


def test_continuous_cartpole_pushes_both_ways() -> None:
    positions = []
    for force in (-1.0, 1.0):
        env = make_pixel_env("cartpole", size=16)
        env.reset(seed=0)
        for _ in range(5):
            env.step(np.array([force], dtype=np.float32))
        positions.append(float(env.unwrapped.state[0]))
    assert positions[0] < positions[1]


def _pendulum() -> gym.Env:
    return gym.make("asyncvec/PixelPendulum-v0")


@pytest.mark.parametrize(("shared_memory", "envs_per_worker"), [(True, 1), (True, 2), (False, 1)])
def test_vector_env_matches_sync_vector_env(shared_memory: bool, envs_per_worker: int) -> None:
    fns = [_pendulum] * 3
    sync = gym.vector.SyncVectorEnv(fns)
    with AsyncLLMVectorEnv(fns, shared_memory=shared_memory, envs_per_worker=envs_per_worker) as vector_env:
        assert vector_env.shared_memory is shared_memory
        obs, _ = vector_env.reset(seed=7)
        expected, _ = sync.reset(seed=7)
        actions = np.linspace(-2, 2, 3 * 12, dtype=np.float32).reshape(12, 3, 1)
        for step in range(12):
            np.testing.assert_array_equal(obs["image"], expected["image"])
            assert tuple(obs["instruction"]) == tuple(expected["instruction"])
            obs, reward, _, _, _ = vector_env.step(actions[step])
            expected, expected_reward, _, _, _ = sync.step(actions[step])
            np.testing.assert_allclose(reward, expected_reward)
    sync.close()


def test_partial_batches_carry_image_and_instruction() -> None:
    with AsyncLLMVectorEnv([_pendulum] * 4, batch_size=2) as vector_env:
        vector_env.async_reset(seed=0)
        seen = 0
        for _ in range(10):
            obs, _, _, _, info = vector_env.recv()
            assert obs["image"].shape == (2, 64, 64, 3) and len(obs["instruction"]) == 2
            for row, env_id in enumerate(info["env_id"]):
                assert isinstance(obs["instruction"][row], str) and obs["instruction"][row]
                assert obs["image"][row].any()
            seen += 2
            vector_env.send(np.zeros((2, 1), dtype=np.float32), info["env_id"])
        assert seen == 20


def test_image_goes_through_shared_memory_not_the_pipe() -> None:
    """Bytes a worker pickles per step: the instruction only, not the 12 KB image."""
    space = _pendulum().observation_space
    shared = shared_subspace(space)
    assert list(shared.keys()) == ["image"]
    from gymnasium.vector.utils import create_shared_memory

    sizes = {}
    for mode in ("shared", "pipe"):
        memory = (create_shared_memory(shared, n=1), 1) if mode == "shared" else None
        group = EnvGroup([_pendulum], [0], gym.vector.AutoresetMode.NEXT_STEP, memory)
        group.handle([(0, "reset", {"seed": 0, "options": None})])
        reply = group.handle([(0, "step", np.zeros(1, dtype=np.float32))])
        sizes[mode] = len(dumps((True, reply)))
        group.close()
    assert sizes["shared"] < 1_000, sizes
    assert sizes["pipe"] > 64 * 64 * 3, sizes


class _BadImage(gym.Wrapper):
    """Returns an image of the wrong shape or dtype from its second step on."""

    def __init__(self, env: gym.Env, kind: str) -> None:
        super().__init__(env)
        self.kind, self.steps = kind, 0

    def step(self, action):
        obs, *rest = self.env.step(action)
        self.steps += 1
        if self.steps >= 2:
            image = obs["image"]
            obs = {**obs, "image": image[:32] if self.kind == "shape" else image.astype(np.float64) / 255.0}
        return (obs, *rest)


@pytest.mark.parametrize("shared_memory", [True, False])
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("shape", r"observation\['image'\] of env 1 has shape \(32, 64, 3\), expected \(64, 64, 3\)"),
        ("dtype", r"observation\['image'\] of env 1 has dtype float64, expected uint8"),
    ],
)
def test_bad_image_names_field_and_env(kind: str, message: str, shared_memory: bool) -> None:
    """Checked in the worker while it writes shared memory, in the parent without it."""
    fns = [_pendulum, lambda: _BadImage(_pendulum(), kind)]
    with AsyncLLMVectorEnv(fns, shared_memory=shared_memory) as vector_env:
        assert vector_env.shared_memory is shared_memory
        vector_env.reset(seed=0)
        vector_env.step(np.zeros((2, 1), dtype=np.float32))
        with pytest.raises(WorkerError, match=message):
            vector_env.step(np.zeros((2, 1), dtype=np.float32))


class _Crashes(gym.Wrapper):
    """Raises on its third step (a simulator fault)."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("simulator crashed")
        return self.env.step(action)


def test_restart_keeps_image_and_instruction() -> None:
    """A rebuilt env's truncated step carries the last image and instruction the caller saw."""
    fns = [_pendulum, lambda: _Crashes(_pendulum())]
    with AsyncLLMVectorEnv(fns, max_restarts=1) as vector_env:
        obs, _ = vector_env.reset(seed=0)
        actions = np.zeros((2, 1), dtype=np.float32)
        for _ in range(2):
            last, *_ = vector_env.step(actions)
        obs, _, _, truncated, info = vector_env.step(actions)
        assert truncated.tolist() == [False, True] and info["env_restarted"][1]
        np.testing.assert_array_equal(obs["image"][1], last["image"][1])
        assert obs["instruction"][1] == last["instruction"][1]
        obs, *_ = vector_env.step(actions)  # the rebuilt env's new episode
        assert obs["image"][1].shape == (64, 64, 3) and isinstance(obs["instruction"][1], str)
