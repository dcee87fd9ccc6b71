"""check_vector_env passes on good vector envs and explains what is wrong with broken ones."""

from __future__ import annotations

from functools import partial

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
from toy_envs import CounterEnv

from asyncvec import AsyncLLMVectorEnv, VectorEnvCheckError, check_vector_env

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_passes_on_gymnasium_sync_and_ours(mode):
    fns = [partial(CounterEnv, obs_kind="dict")] * 3
    sync = SyncVectorEnv(fns, autoreset_mode=mode)
    ours = AsyncLLMVectorEnv(fns, autoreset_mode=mode, batch_size=2)
    try:
        assert check_vector_env(sync, num_steps=40) is None
        assert check_vector_env(ours, num_steps=40) is None
    finally:
        sync.close()
        ours.close()


def test_passes_on_gymnasium_async_with_cartpole():
    envs = AsyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2)
    try:
        assert check_vector_env(envs, num_steps=60) is None
    finally:
        envs.close()


def test_passes_on_text_observations():
    envs = AsyncLLMVectorEnv([partial(CounterEnv, obs_kind="text")] * 2, batch_size=1)
    try:
        assert check_vector_env(envs, num_steps=30) is None
    finally:
        envs.close()


class RewardOnResetStep(SyncVectorEnv):
    """Broken: pays a reward on the NEXT_STEP reset step."""

    def step(self, actions):
        was_done = self._autoreset_envs.copy()
        obs, rewards, terminations, truncations, infos = super().step(actions)
        rewards[was_done] = 1.0
        return obs, rewards, terminations, truncations, infos


class NoInfoMasks(SyncVectorEnv):
    """Broken: drops the ``_key`` masks from infos."""

    def step(self, actions):
        obs, rewards, terminations, truncations, infos = super().step(actions)
        return obs, rewards, terminations, truncations, {k: v for k, v in infos.items() if not k.startswith("_")}


class BoolRewards(SyncVectorEnv):
    """Broken: rewards of the wrong dtype and observations outside the space."""

    def step(self, actions):
        obs, rewards, terminations, truncations, infos = super().step(actions)
        return obs + 1000.0, rewards > 0, terminations, truncations, infos


class RepeatsEnvIds(AsyncLLMVectorEnv):
    """Broken partial batches: a batch of two claims its first env twice (whichever envs arrived first)."""

    def recv(self, timeout=None):
        obs, rewards, terminations, truncations, info = super().recv(timeout)
        info["env_id"] = np.full_like(info["env_id"], info["env_id"][0])
        return obs, rewards, terminations, truncations, info


class NotDeterministic(SyncVectorEnv):
    def reset(self, *, seed=None, options=None):
        return super().reset(seed=None if seed is None else seed + 1, options=options)


@pytest.mark.parametrize(
    "broken, message",
    [
        (RewardOnResetStep, r"NEXT_STEP autoreset: env \d ended its episode on the previous step"),
        (NoInfoMasks, r"info\['t'\] has no mask info\['_t'\]"),
        (BoolRewards, r"rewards has dtype bool, expected float"),
        (NotDeterministic, r"not reproducible by SyncVectorEnv\(env_fns\) with the same seed"),
    ],
)
def test_fails_readably_on_broken_envs(broken, message):
    envs = broken([partial(CounterEnv)] * 2)
    with pytest.raises(VectorEnvCheckError, match=message) as err:
        check_vector_env(envs, num_steps=40)
    assert f"{broken.__name__} fails the vector env contract" in str(err.value)
    envs.close()


def test_observations_outside_the_space_are_reported():
    envs = BoolRewards([partial(CounterEnv)] * 2)
    with pytest.raises(VectorEnvCheckError, match="observations are not in observation_space"):
        check_vector_env(envs)


def test_fails_on_repeated_env_ids_in_partial_batches():
    envs = RepeatsEnvIds([partial(CounterEnv)] * 3, batch_size=2)
    try:
        with pytest.raises(VectorEnvCheckError, match=r"recv 0: env \d returned without a send in flight"):
            check_vector_env(envs, num_steps=10)
    finally:
        envs.close()


def test_same_step_final_obs_checked():
    class ForgetsFinalObs(SyncVectorEnv):
        def step(self, actions):
            out = super().step(actions)
            out[4].pop("final_obs", None)
            out[4].pop("_final_obs", None)
            return out

    envs = ForgetsFinalObs([partial(CounterEnv)] * 2, autoreset_mode=AutoresetMode.SAME_STEP)
    with pytest.raises(VectorEnvCheckError, match=r"SAME_STEP autoreset: env \d ended but info\['_final_obs'\]"):
        check_vector_env(envs, num_steps=40)


def test_unpicklable_env_fns_reported():
    import threading

    lock = threading.Lock()

    def make():
        lock  # closes over something cloudpickle cannot pickle
        return CounterEnv()

    envs = SyncVectorEnv([make])
    with pytest.raises(VectorEnvCheckError, match=r"env_fns\[0\] cannot be pickled"):
        check_vector_env(envs)
