"""TorchRL: ``make_env`` (and ``wrap``), a TorchRL ``GymWrapper`` over an ``AsyncLLMVectorEnv``.

TorchRL's ``GymWrapper`` takes a gymnasium ``VectorEnv`` whose autoreset mode is ``DISABLED``
(which TorchRL prefers: its collectors reset finished envs through ``options["reset_mask"]``)
or ``SAME_STEP``; ``make_env`` builds the vector env in ``DISABLED`` mode. TorchRL steps every
env at once, so there are no partial batches; ``max_restarts`` and ``step_timeout`` work
(a restarted env ends its episode truncated).

Example:
    >>> from torchrl.envs.utils import check_env_specs
    >>> from asyncvec.integrations.torchrl import make_env
    >>> env = make_env("CartPole-v1", num_envs=2, categorical_action_encoding=True)
    >>> env.batch_size
    torch.Size([2])
    >>> check_env_specs(env)
    >>> env.close()
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
from gymnasium import spaces
from gymnasium.envs.registration import EnvSpec
from gymnasium.vector import AutoresetMode

from asyncvec.integrations._common import ARRAY_SPACES, check_space, require
from asyncvec.integrations.gymnasium import make_env_fns
from asyncvec.vector.async_llm_vector_env import AsyncLLMVectorEnv

# Importing torchrl makes "spawn" the start method of the whole process; TorchRL's own parallel
# envs and collectors pick spawn through their own context anyway, so put the process default
# back: asyncvec's workers (and everyone else's) keep the platform's method.
_start_method = multiprocessing.get_start_method(allow_none=True)
require("torchrl", "TorchRL", "torchrl")
if _start_method is None:
    multiprocessing.set_start_method(None, force=True)

from torchrl.envs import EnvBase, GymWrapper  # noqa: E402  (after require: a missing library names its extra)

__all__ = ["make_env", "wrap"]

_LIBRARY = "TorchRL"
_TORCHRL_MODES = (AutoresetMode.DISABLED, AutoresetMode.SAME_STEP)


def wrap(vector_env: AsyncLLMVectorEnv, **wrapper_kwargs: Any) -> EnvBase:
    """TorchRL's ``GymWrapper`` around an existing vector env built with a mode TorchRL takes.

    Args:
        vector_env: an ``AsyncLLMVectorEnv`` with ``autoreset_mode`` DISABLED or SAME_STEP.
        **wrapper_kwargs: ``GymWrapper`` arguments (``categorical_action_encoding``, ``device``...).
    """
    if vector_env.autoreset_mode not in _TORCHRL_MODES:
        raise ValueError(
            f"TorchRL's GymWrapper takes a vector env whose autoreset_mode is DISABLED or SAME_STEP, got "
            f"{vector_env.autoreset_mode}: build it with AsyncLLMVectorEnv(..., autoreset_mode='Disabled') "
            f"or use asyncvec.integrations.torchrl.make_env"
        )
    check_space(
        _LIBRARY, "observation", vector_env.single_observation_space, (*ARRAY_SPACES, spaces.Dict, spaces.Tuple)
    )
    check_space(_LIBRARY, "action", vector_env.single_action_space, ARRAY_SPACES)
    return GymWrapper(vector_env, **wrapper_kwargs)


def make_env(
    env: str | EnvSpec | Sequence[Callable[[], gym.Env]],
    num_envs: int | None = None,
    *,
    env_kwargs: dict[str, Any] | None = None,
    vector_kwargs: dict[str, Any] | None = None,
    **wrapper_kwargs: Any,
) -> EnvBase:
    """A TorchRL env (batch size ``[num_envs]``) whose sub-envs run in asyncvec's workers.

    Args:
        env: a registered env id or spec (then ``num_envs`` is required), or env functions.
        num_envs: number of copies of ``env`` when it is an id.
        env_kwargs: arguments of each sub-env (with an id).
        vector_kwargs: ``AsyncLLMVectorEnv`` arguments (``max_restarts``, ``step_timeout``...);
            ``autoreset_mode`` defaults to DISABLED, ``context`` to ``"forkserver"`` when the
            process's start method is spawn (as after ``import torchrl``).
        **wrapper_kwargs: ``GymWrapper`` arguments (``categorical_action_encoding``, ``device``...).
    """
    if isinstance(env, (str, EnvSpec)):
        if num_envs is None:
            raise TypeError("make_env(env_id, num_envs): num_envs is required with an env id")
        env_fns = make_env_fns(env, num_envs, **(env_kwargs or {}))
    else:
        if env_kwargs:
            raise TypeError("env_kwargs go with an env id; bind them into the env functions instead")
        env_fns = list(env)
        if num_envs is not None and num_envs != len(env_fns):
            raise ValueError(f"num_envs={num_envs} but {len(env_fns)} env functions were given")
    vector_kwargs = {"autoreset_mode": AutoresetMode.DISABLED, **(vector_kwargs or {})}
    if "context" not in vector_kwargs and multiprocessing.get_start_method(allow_none=True) == "spawn":
        # torchrl imported first made spawn the default: each worker would import the main module
        # (torch, torchrl) again. A fork server imports it once and forks clean workers from it.
        vector_kwargs["context"] = "forkserver"
    vector_env = AsyncLLMVectorEnv(env_fns, **vector_kwargs)
    try:
        return wrap(vector_env, **wrapper_kwargs)
    except BaseException:
        vector_env.close()
        raise
