"""The gymnasium way to get an ``AsyncLLMVectorEnv``: ``asyncvec.make_vec`` and ``gymnasium.make_vec``.

``make_vec`` mirrors :func:`gymnasium.make_vec`: keyword arguments go to every sub-env,
``vector_kwargs`` to the vector env. ``import asyncvec`` also registers the id
``asyncvec/AsyncLLMVectorEnv-v0``, so gymnasium's own ``make_vec`` builds one (all arguments are
keywords there, as gymnasium's vector entry points take no ``vector_kwargs``):

Example:
    >>> import gymnasium as gym
    >>> import asyncvec
    >>> envs = asyncvec.make_vec("CartPole-v1", num_envs=4, vector_kwargs={"batch_size": 2})
    >>> envs.spec.id, envs.num_envs, envs.batch_size
    ('CartPole-v1', 4, 2)
    >>> envs.close()
    >>> envs = gym.make_vec("asyncvec/AsyncLLMVectorEnv-v0", num_envs=2, env_id="Pendulum-v1",
    ...                     env_kwargs={"g": 9.81}, max_restarts=1)
    >>> type(envs).__name__, envs.restarts
    ('AsyncLLMVectorEnv', [0, 0])
    >>> envs.close()
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import EnvSpec

from asyncvec.vector.async_llm_vector_env import AsyncLLMVectorEnv

__all__ = ["VECTOR_ENV_ID", "make_env_fns", "make_vec", "vector_entry_point"]

VECTOR_ENV_ID = "asyncvec/AsyncLLMVectorEnv-v0"


def _find_spec(id: str | EnvSpec) -> EnvSpec:
    """The registered spec of ``id``; ``"module:Env-v0"`` imports ``module`` first, as in gymnasium."""
    if isinstance(id, EnvSpec):
        return id
    if not isinstance(id, str):
        raise TypeError(f"env id must be a str or an EnvSpec, got {type(id).__name__}")
    module, _, name = id.rpartition(":")
    if module:
        importlib.import_module(module)
    return gym.spec(name)


def _make_env(spec: EnvSpec, kwargs: dict[str, Any], wrappers: Sequence[Callable[[gym.Env], gym.Env]]) -> gym.Env:
    env = gym.make(spec, **kwargs)
    for wrapper in wrappers:
        env = wrapper(env)
    return env


def make_env_fns(
    id: str | EnvSpec, num_envs: int, wrappers: Sequence[Callable[[gym.Env], gym.Env]] | None = None, **kwargs: Any
) -> list[Callable[[], gym.Env]]:
    """``num_envs`` picklable functions, each making ``id`` with ``kwargs`` and applying ``wrappers``."""
    if not isinstance(num_envs, int) or num_envs < 1:
        raise ValueError(f"num_envs must be a positive int, got {num_envs!r}")
    fn = functools.partial(_make_env, _find_spec(id), dict(kwargs), list(wrappers or []))
    return [fn] * num_envs


def _check_vector_kwargs(vector_kwargs: dict[str, Any]) -> None:
    known = [
        name for name in inspect.signature(AsyncLLMVectorEnv.__init__).parameters if name not in ("self", "env_fns")
    ]
    unknown = sorted(set(vector_kwargs) - set(known))
    if unknown:
        raise TypeError(f"AsyncLLMVectorEnv has no argument(s) {unknown}; its arguments are {known}")


def make_vec(
    id: str | EnvSpec,
    num_envs: int = 1,
    vector_kwargs: dict[str, Any] | None = None,
    wrappers: Sequence[Callable[[gym.Env], gym.Env]] | None = None,
    **kwargs: Any,
) -> AsyncLLMVectorEnv:
    """Creates an :class:`AsyncLLMVectorEnv` of ``num_envs`` copies of a registered env.

    Args:
        id: a registered env id (``"module:Env-v0"`` imports ``module`` first) or an ``EnvSpec``.
        num_envs: number of sub-environments.
        vector_kwargs: arguments of ``AsyncLLMVectorEnv`` (``batch_size``, ``autoreset_mode``,
            ``max_restarts``, ``step_timeout``, ...).
        wrappers: wrapper functions applied to each sub-env, in order, inside its worker.
        **kwargs: arguments of every sub-env (passed to ``gymnasium.make``).

    Returns:
        The vector env; its ``spec`` is the sub-env's spec with ``kwargs`` and ``num_envs``.
    """
    vector_kwargs = dict(vector_kwargs or {})
    _check_vector_kwargs(vector_kwargs)
    env_fns = make_env_fns(id, num_envs, wrappers, **kwargs)
    envs = AsyncLLMVectorEnv(env_fns, **vector_kwargs)
    spec = copy.deepcopy(env_fns[0].args[0])
    spec.kwargs = {**spec.kwargs, **kwargs, "num_envs": num_envs}
    envs.spec = spec
    return envs


def vector_entry_point(
    num_envs: int = 1,
    *,
    env_id: str | EnvSpec | None = None,
    env_kwargs: dict[str, Any] | None = None,
    **vector_kwargs: Any,
) -> AsyncLLMVectorEnv:
    """What ``gymnasium.make_vec("asyncvec/AsyncLLMVectorEnv-v0", num_envs, env_id=..., **vector_kwargs)`` calls."""
    if env_id is None:
        raise TypeError(
            f"gymnasium.make_vec({VECTOR_ENV_ID!r}, ...) needs env_id=<a registered env id>, e.g. "
            f"gymnasium.make_vec({VECTOR_ENV_ID!r}, num_envs=4, env_id='CartPole-v1', batch_size=2); "
            f"sub-env arguments go in env_kwargs={{...}}"
        )
    return make_vec(env_id, num_envs, vector_kwargs=vector_kwargs, **(env_kwargs or {}))
