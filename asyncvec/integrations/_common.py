"""What the adapters share: optional imports, space and action checks, addressing one sub-env."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from types import ModuleType
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.wrappers.vector import DictInfoToList

from asyncvec import extras

# Spaces every array-based RL library takes (observations and actions).
ARRAY_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def require(module: str, library: str, extra: str) -> ModuleType:
    """Imports an optional dependency, or raises an ImportError saying which extra installs it."""
    return extras.require(module, extra=extra, feature=f"asyncvec.integrations.{extra}", library=library)


def check_space(library: str, what: str, space: gym.Space, allowed: tuple[type[gym.Space], ...]) -> None:
    """Raises a TypeError naming the library when it cannot take ``space`` (Dict/Tuple: every leaf)."""
    if isinstance(space, spaces.Dict):
        leaves = list(space.spaces.values())
    elif isinstance(space, spaces.Tuple):
        leaves = list(space.spaces)
    else:
        leaves = [space]
    if not isinstance(space, allowed) or not all(isinstance(leaf, ARRAY_SPACES) for leaf in leaves):
        names = ", ".join(t.__name__ for t in allowed)
        raise TypeError(
            f"{library} cannot take the {what} space {space}: it takes {names} spaces "
            f"(with Box, Discrete, MultiDiscrete or MultiBinary inside a Dict or Tuple). Drive envs with other "
            f"spaces (e.g. Text) through AsyncLLMVectorEnv's own API (reset/step or send/recv)."
        )


def check_action_batch(library: str, actions: Any, space: gym.Space, count: int) -> np.ndarray:
    """The actions as one array of ``count`` rows of ``space``'s shape, or a ValueError saying what was expected."""
    actions = np.asarray(actions)
    expected = (count, *space.shape)
    if actions.shape != expected:
        raise ValueError(
            f"{library} passed actions of shape {actions.shape}; expected {expected}: one action of shape "
            f"{space.shape} from {space} for each of the {count} envs"
        )
    return actions


def info_rows(infos: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """Splits a gymnasium vector info dict (``key``/``_key`` arrays) into one dict per row.

    Example:
        >>> info_rows({"x": np.array([1, 2]), "_x": np.array([True, False])}, 2)
        [{'x': np.int64(1)}, {}]
    """
    return _InfoRows(count)._convert_info_to_list(infos)


class _InfoRows:
    """The two attributes gymnasium's own info splitter (``DictInfoToList``) reads, for any row count."""

    _convert_info_to_list = DictInfoToList._convert_info_to_list

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs


class AddressableEnv(gym.Wrapper):
    """Outermost wrapper of a sub-env, so that one env (not all) can be called by index.

    ``AsyncLLMVectorEnv.call`` reaches every sub-env; an adapter whose library asks for one env
    (``env_method(..., indices=[0])``, ``set_env_attr(key, value, id)``) sends the indices along
    and only those envs act.
    """

    def __init__(self, env: gym.Env, index: int) -> None:
        super().__init__(env)
        self.asyncvec_index = index

    def asyncvec_get(self, indices: Collection[int], name: str) -> Any:
        return self.env.get_wrapper_attr(name) if self.asyncvec_index in indices else None

    def asyncvec_call(self, indices: Collection[int], name: str, args: tuple, kwargs: dict) -> Any:
        if self.asyncvec_index not in indices:
            return None
        attr = self.env.get_wrapper_attr(name)
        return attr(*args, **kwargs) if callable(attr) else attr

    def asyncvec_set(self, indices: Collection[int], name: str, value: Any) -> None:
        if self.asyncvec_index in indices:
            self.env.set_wrapper_attr(name, value)

    def asyncvec_is_wrapped(self, indices: Collection[int], wrapper_class: type) -> bool | None:
        if self.asyncvec_index not in indices:
            return None
        env = self.env
        while isinstance(env, gym.Wrapper):
            if isinstance(env, wrapper_class):
                return True
            env = env.env
        return False


def _make_addressable(env_fn: Callable[[], gym.Env], index: int) -> gym.Env:
    return AddressableEnv(env_fn(), index)


def addressable(env_fns: Sequence[Callable[[], gym.Env]]) -> list[Callable[[], gym.Env]]:
    """The env functions, each wrapping its env in an :class:`AddressableEnv` that knows its index."""
    return [functools.partial(_make_addressable, fn, index) for index, fn in enumerate(env_fns)]
