"""Gymnasium's vector wrappers, keeping asyncvec's partial batches (``async_reset``/``send``/``recv``).

A gymnasium vector wrapper only knows ``reset`` and ``step`` over all envs: around an
``AsyncLLMVectorEnv`` it has no ``send``/``recv``. Each wrapper here *is* the gymnasium wrapper
(``reset`` and ``step`` are gymnasium's own code, results identical) and adds the EnvPool API:
``recv`` runs the wrapper's own ``step`` (or, for rows that answer ``async_reset``, its ``reset``)
on just the rows that arrived, with the wrapper's per-env state (returns, lengths, discounted
returns) read and written at those rows' env ids; ``send`` transforms the actions of the envs
it sends to. Stack them in any order; every layer keeps ``send``/``recv``.

Partial batches need NEXT_STEP or DISABLED autoreset (as gymnasium's ``NormalizeObservation``
does): with SAME_STEP a row can hold the end of one episode and the start of the next.

Example:
    >>> import gymnasium as gym
    >>> import numpy as np
    >>> from asyncvec import AsyncLLMVectorEnv
    >>> from asyncvec.vector import wrappers
    >>> envs = AsyncLLMVectorEnv([lambda: gym.make("CartPole-v1")] * 4, batch_size=2)
    >>> envs = wrappers.RecordEpisodeStatistics(wrappers.NormalizeObservation(envs))
    >>> envs.async_reset(seed=0)
    >>> for _ in range(200):
    ...     obs, rew, term, trunc, info = envs.recv()
    ...     envs.send(np.zeros(len(info["env_id"]), dtype=np.int64), info["env_id"])
    >>> int(envs.episode_count) > 0, obs.shape
    (True, (2, 4))
    >>> envs.close()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium import Space
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, create_empty_array
from gymnasium.wrappers import vector as gym_wrappers
from gymnasium.wrappers.vector import DictInfoToList

__all__ = [
    "ClipAction",
    "NormalizeObservation",
    "NormalizeReward",
    "RecordEpisodeStatistics",
    "RescaleAction",
    "TransformObservation",
    "TransformReward",
]


class _Rows(VectorEnv[Any, Any, Any]):
    """Stands in for the wrapped env while a wrapper's own ``step``/``reset`` runs on some rows."""

    _convert_info_to_list = DictInfoToList._convert_info_to_list  # splits infos of ``num_envs`` rows

    def __init__(self, env: VectorEnv[Any, Any, Any], count: int, result: tuple[Any, ...] = ()) -> None:
        self.num_envs = count
        self.metadata = env.metadata
        self.single_observation_space = env.single_observation_space
        self.single_action_space = env.single_action_space
        self.observation_space = batch_space(env.single_observation_space, count)
        self.action_space = batch_space(env.single_action_space, count)
        self.result = result

    def reset(self, *, seed: Any = None, options: Any = None) -> tuple[Any, ...]:
        return self.result

    def step(self, actions: Any) -> tuple[Any, ...]:
        return self.result


def _take(batch: Any, rows: np.ndarray) -> Any:
    if isinstance(batch, dict):
        return {key: _take(value, rows) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_take(value, rows) for value in batch)
    return np.asarray(batch)[rows]


def _concatenate(first: Any, second: Any) -> Any:
    if isinstance(first, dict):
        return {key: _concatenate(first[key], second[key]) for key in first}
    if isinstance(first, tuple):
        return tuple(_concatenate(a, b) for a, b in zip(first, second))
    return np.concatenate([first, second])


class _PartialBatches:
    """The EnvPool API on top of a gymnasium vector wrapper (mixed in before it)."""

    env: VectorEnv[Any, Any, Any]
    num_envs: int
    #: attributes holding one entry per env, read and written at the rows' env ids
    _per_env_state: tuple[str, ...] = ()

    def _inner(self, name: str) -> Any:
        method = getattr(self.env, name, None)
        if method is None:
            raise AttributeError(
                f"{type(self.env).__name__} has no {name}(): partial batches (async_reset/send/recv) pass only "
                f"through asyncvec's vector envs and the wrappers of asyncvec.vector.wrappers; wrap with "
                f"asyncvec.vector.wrappers.{type(self.env).__name__} (if it exists) instead of gymnasium's"
            )
        return method

    def _check_autoreset(self) -> None:
        if self.env.metadata.get("autoreset_mode") == AutoresetMode.SAME_STEP:
            raise ValueError(
                f"{type(self).__name__}: partial batches need NEXT_STEP or DISABLED autoreset, the vector env "
                f"uses SAME_STEP (a row would hold the end of one episode and the start of the next)"
            )

    @property
    def _awaiting_reset(self) -> np.ndarray:
        """Envs whose ``async_reset`` answer has not come out of ``recv`` yet."""
        if "_asyncvec_awaiting_reset" not in self.__dict__:
            self.__dict__["_asyncvec_awaiting_reset"] = np.zeros(self.num_envs, dtype=bool)
        awaiting: np.ndarray = self.__dict__["_asyncvec_awaiting_reset"]
        return awaiting

    def async_reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> None:
        """Resets every env without waiting; the reset rows come out of :meth:`recv`."""
        self._check_autoreset()
        self._inner("async_reset")(seed=seed, options=options)
        self._awaiting_reset[:] = True

    def send(self, actions: Any, env_ids: Any = None) -> None:
        """Sends the (transformed) actions of ``env_ids`` (default: all envs)."""
        self._check_autoreset()
        ids = np.arange(self.num_envs) if env_ids is None else np.asarray(env_ids, dtype=np.int64).reshape(-1)
        self._inner("send")(self._send_actions(actions, ids), env_ids)

    def recv(self, timeout: float | None = None, *, at_least: int | None = None) -> tuple[Any, ...]:
        """The next partial batch from the wrapped env, transformed as this wrapper's ``step`` would."""
        recv = self._inner("recv")
        batch = recv(timeout=timeout) if at_least is None else recv(timeout=timeout, at_least=at_least)
        ids = np.asarray(batch[4]["env_id"], dtype=np.int64)
        resets = self._awaiting_reset[ids]
        self._awaiting_reset[ids] = False
        return self._recv_rows(batch, ids, resets)

    def _send_actions(self, actions: Any, ids: np.ndarray) -> Any:
        return actions

    def _recv_rows(self, batch: tuple[Any, ...], ids: np.ndarray, resets: np.ndarray) -> tuple[Any, ...]:
        return batch

    @contextmanager
    def _as_rows(self, ids: np.ndarray, result: tuple[Any, ...] = ()) -> Iterator[None]:
        """While inside, this wrapper sees a vector env of just ``ids`` that answers ``result``."""
        env = self.env
        state = {name: getattr(self, name) for name in self._per_env_state if hasattr(self, name)}
        self.env = _Rows(env, len(ids), result)
        for name, value in state.items():
            setattr(self, name, value[ids])
        try:
            yield
        finally:
            self.env = env
            for name, value in state.items():
                rows = np.asarray(getattr(self, name))
                if rows.dtype != value.dtype:  # the wrapper's arithmetic promoted it, as it would in step()
                    value = value.astype(np.result_type(value, rows))
                value[ids] = rows
                setattr(self, name, value)


class _TransformsResults(_PartialBatches):
    """A wrapper of observations, rewards or statistics: ``recv`` runs its ``step``/``reset`` on the rows."""

    if TYPE_CHECKING:  # the gymnasium wrapper this is mixed into has them

        def step(self, actions: Any) -> tuple[Any, ...]: ...
        def reset(self, seed: Any = None, options: Any = None) -> tuple[Any, ...]: ...

    def _recv_rows(self, batch: tuple[Any, ...], ids: np.ndarray, resets: np.ndarray) -> tuple[Any, ...]:
        if not resets.any():
            return self._step_rows(batch, ids)
        if resets.all():
            return self._reset_rows(batch, ids)
        first = self._reset_rows(tuple(_take(part, resets) for part in batch), ids[resets])
        second = self._step_rows(tuple(_take(part, ~resets) for part in batch), ids[~resets])
        # one batch again, reset rows first: gymnasium's own info splitter and merger, row by row
        counts = (int(resets.sum()), int((~resets).sum()))
        joined = _Rows(self.env, len(ids))
        infos: dict[str, Any] = {}
        for offset, part, count in ((0, first, counts[0]), (counts[0], second, counts[1])):
            # gymnasium's own info splitter, on a stand-in with the rows' count (its self is duck-typed)
            rows = DictInfoToList._convert_info_to_list(_Rows(self.env, count), part[4])  # type: ignore[arg-type]
            for k, row in enumerate(rows):
                row.pop("env_id", None)
                infos = joined._add_info(infos, row, offset + k)
        infos["env_id"] = np.concatenate([ids[resets], ids[~resets]])
        return (*(_concatenate(a, b) for a, b in zip(first[:4], second[:4])), infos)

    def _step_rows(self, batch: tuple[Any, ...], ids: np.ndarray) -> tuple[Any, ...]:
        with self._as_rows(ids, batch):
            return self.step(None)

    def _reset_rows(self, batch: tuple[Any, ...], ids: np.ndarray) -> tuple[Any, ...]:
        observations, rewards, terminations, truncations, infos = batch
        with self._as_rows(ids, (observations, infos)):
            observations, infos = self.reset()
        return observations, rewards, terminations, truncations, infos


class _TransformsActions(_PartialBatches):
    """A ``VectorizeTransformAction`` wrapper: ``send`` transforms each sent action as ``step`` would."""

    if TYPE_CHECKING:  # the gymnasium wrapper this is mixed into has them
        action_space: Space[Any]
        single_action_space: Space[Any]
        out: Any

        def actions(self, actions: Any) -> Any: ...

    def _send_actions(self, actions: Any, ids: np.ndarray) -> Any:
        full_space, full_out = self.action_space, self.out
        self.action_space = batch_space(self.single_action_space, len(ids))
        self.out = create_empty_array(self.env.single_action_space, len(ids))
        try:
            return self.actions(actions)
        finally:
            self.action_space, self.out = full_space, full_out


class RecordEpisodeStatistics(_TransformsResults, gym_wrappers.RecordEpisodeStatistics):
    """gymnasium's ``RecordEpisodeStatistics``; ``recv`` adds ``info["episode"]`` for the rows that ended."""

    _per_env_state = ("episode_start_times", "episode_returns", "episode_lengths", "prev_dones")


class NormalizeObservation(_TransformsResults, gym_wrappers.NormalizeObservation):
    """gymnasium's ``NormalizeObservation``; ``recv`` updates the running statistics with the rows."""


class TransformObservation(_TransformsResults, gym_wrappers.TransformObservation):
    """gymnasium's ``TransformObservation``; ``func`` gets a batch of any size under ``recv``."""


class NormalizeReward(_TransformsResults, gym_wrappers.NormalizeReward):
    """gymnasium's ``NormalizeReward``; each env's discounted return is kept by env id."""

    _per_env_state = ("accumulated_reward", "_prev_dones")


class TransformReward(_TransformsResults, gym_wrappers.TransformReward):
    """gymnasium's ``TransformReward``; ``func`` gets a batch of any size under ``recv``."""


class ClipAction(_TransformsActions, gym_wrappers.ClipAction):
    """gymnasium's ``ClipAction``; ``send`` clips the actions it sends."""


class RescaleAction(_TransformsActions, gym_wrappers.RescaleAction):
    """gymnasium's ``RescaleAction``; ``send`` rescales the actions it sends."""
