"""RLlib (new API stack): ``register``, an RLlib env name whose creator builds an ``AsyncLLMVectorEnv``.

RLlib hands a user-built vector env to its ``EnvRunner`` when the config says
``env_runners(gym_env_vectorize_mode=gymnasium.VectorizeMode.VECTOR_ENTRY_POINT)``; the
creator gets ``num_envs`` (``num_envs_per_env_runner``) and the ``env_config``, whose entries
go to every sub-env. RLlib steps all envs together with NEXT_STEP autoreset (gymnasium's
default), so there are no partial batches; ``max_restarts`` and ``step_timeout`` work.

Example:
    >>> import gymnasium as gym
    >>> from ray.rllib.algorithms.ppo import PPOConfig
    >>> from asyncvec.integrations.rllib import register
    >>> name = register("asyncvec-cartpole", "CartPole-v1", max_restarts=2)
    >>> config = (PPOConfig().environment(name)
    ...           .env_runners(num_env_runners=0, num_envs_per_env_runner=4,
    ...                        gym_env_vectorize_mode=gym.VectorizeMode.VECTOR_ENTRY_POINT))
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import gymnasium as gym
from gymnasium import spaces
from gymnasium.envs.registration import EnvSpec
from gymnasium.vector import AutoresetMode

from asyncvec.integrations._common import ARRAY_SPACES, check_space, require
from asyncvec.integrations.gymnasium import make_vec
from asyncvec.vector.async_llm_vector_env import AsyncLLMVectorEnv

require("ray.rllib", "RLlib (ray[rllib])", "rllib")

from ray.tune.registry import register_env  # noqa: E402  (after require: a missing library names its extra)

__all__ = ["make_creator", "register"]

_LIBRARY = "RLlib"


def _create(
    env: str | EnvSpec | Callable[..., gym.Env], vector_kwargs: dict[str, Any], config: dict[str, Any]
) -> AsyncLLMVectorEnv:
    if "num_envs" not in config:
        raise ValueError(
            "RLlib asked the asyncvec creator for a single env: an AsyncLLMVectorEnv is a vector env, so set "
            "config.env_runners(gym_env_vectorize_mode=gymnasium.VectorizeMode.VECTOR_ENTRY_POINT)"
        )
    env_kwargs = {key: value for key, value in config.items() if key != "num_envs"}
    num_envs = int(config["num_envs"])
    if isinstance(env, (str, EnvSpec)):
        envs = make_vec(env, num_envs, vector_kwargs=vector_kwargs, **env_kwargs)
    else:
        envs = AsyncLLMVectorEnv([functools.partial(env, **env_kwargs)] * num_envs, **vector_kwargs)
    try:
        check_space(_LIBRARY, "observation", envs.single_observation_space, (*ARRAY_SPACES, spaces.Dict, spaces.Tuple))
        check_space(_LIBRARY, "action", envs.single_action_space, (*ARRAY_SPACES, spaces.Dict, spaces.Tuple))
    except TypeError:
        envs.close()
        raise
    return envs


def make_creator(
    env: str | EnvSpec | Callable[..., gym.Env], **vector_kwargs: Any
) -> Callable[[dict[str, Any]], AsyncLLMVectorEnv]:
    """An RLlib env creator ``creator(env_config) -> AsyncLLMVectorEnv`` (for ``register_env``).

    Args:
        env: a registered env id or spec, or a function ``f(**env_config) -> gym.Env``.
        **vector_kwargs: ``AsyncLLMVectorEnv`` arguments (``max_restarts``, ``step_timeout``...);
            ``autoreset_mode`` must stay NEXT_STEP, which RLlib's EnvRunner expects.
    """
    mode = vector_kwargs.get("autoreset_mode", AutoresetMode.NEXT_STEP)
    if AutoresetMode(mode) != AutoresetMode.NEXT_STEP or vector_kwargs.get("batch_size") is not None:
        raise ValueError(
            f"RLlib's EnvRunner steps every env at once with NEXT_STEP autoreset; got "
            f"autoreset_mode={mode}, batch_size={vector_kwargs.get('batch_size')} (leave both unset)"
        )
    if not isinstance(env, (str, EnvSpec)) and not callable(env):
        raise TypeError(f"env must be an env id, an EnvSpec or a function returning a gym.Env, got {env!r}")
    return functools.partial(_create, env, dict(vector_kwargs))


def register(name: str, env: str | EnvSpec | Callable[..., gym.Env], **vector_kwargs: Any) -> str:
    """Registers ``name`` with RLlib (``ray.tune.register_env``) and returns it.

    Use it with ``config.environment(name)`` and
    ``config.env_runners(gym_env_vectorize_mode=gymnasium.VectorizeMode.VECTOR_ENTRY_POINT)``.
    """
    register_env(name, make_creator(env, **vector_kwargs))
    return name
