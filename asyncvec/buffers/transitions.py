"""`Transitions`: the one record of a batch of transitions that collectors write and both
buffers take (``ReplayBuffer.add_transitions``, ``RolloutStore.add_transitions``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

__all__ = ["Transitions"]


@dataclass
class Transitions:
    """A batch of transitions; every field has the batch as its leading dimension.

    The fields are the parameters of ``add`` on both buffers, in the same order and with the
    same defaults; the metadata after ``policy_version`` may be one scalar for the whole batch.

    Attributes:
        obs, next_obs: observations before and after the step: an array ``(B, *shape)``, a
            dict/tuple of them for Dict/Tuple spaces, ``B`` str for Text. Where an episode
            ended, ``next_obs`` is its final observation.
        action: the action the policy sampled (Box actions unclipped: ``behavior_logp``
            belongs to it; the env executed it clipped into the action space).
        reward: ``(B,)`` float. terminated, truncated: ``(B,)`` bool.
        policy_version: ``(B,)`` int, the version that chose each action.
        behavior_logp: log-probability of each action under the acting policy (NaN: unknown).
        env_id: the env each row came from (-1: unknown; a `RolloutStore` needs it).
        episode_id: the episode each row belongs to (-1: unknown).
        fallback: the action was a fallback (a deadline miss) rather than the policy's sample.
        values: critic values of ``obs`` for on-policy learners (NaN: none).

    Example:
        >>> import numpy as np
        >>> from gymnasium import spaces
        >>> from asyncvec.buffers import ReplayBuffer, RolloutStore, Transitions
        >>> batch = Transitions(np.zeros((2, 1), np.float32), np.array([0, 1]), np.ones(2),
        ...                     np.zeros((2, 1), np.float32), np.zeros(2, bool), np.zeros(2, bool),
        ...                     policy_version=3, env_id=np.array([0, 1]))
        >>> replay = ReplayBuffer(8, spaces.Box(-1, 1, (1,)), spaces.Discrete(2))
        >>> store = RolloutStore(1, 2, spaces.Box(-1, 1, (1,)), spaces.Discrete(2))
        >>> _ = replay.add_transitions(batch); store.add_transitions(batch)
        >>> len(replay), store.ready()
        (2, True)
    """

    obs: Any
    action: Any
    reward: np.ndarray
    next_obs: Any
    terminated: np.ndarray
    truncated: np.ndarray
    policy_version: Any
    behavior_logp: Any = np.nan
    env_id: Any = -1
    episode_id: Any = -1
    fallback: Any = False
    values: Any = np.nan

    def add_arguments(self) -> dict[str, Any]:
        """The record's fields by name: the keyword arguments of both buffers' ``add``."""
        return {name: getattr(self, name) for name in _ADD_ARGUMENTS}

    def take(self, rows: np.ndarray) -> Transitions:
        """Rows ``rows`` of every field (a field given as one scalar for the batch stays that scalar).

        Example:
            >>> batch = Transitions(np.arange(3), np.arange(3), np.ones(3), np.arange(3), np.zeros(3, bool),
            ...                     np.zeros(3, bool), policy_version=np.array([4, 5, 6]), fallback=False)
            >>> part = batch.take(np.array([2, 0]))
            >>> part.policy_version.tolist(), part.fallback
            ([6, 4], False)
        """
        return Transitions(**{name: _take_field(value, rows) for name, value in self.add_arguments().items()})


def _take_field(value: Any, rows: np.ndarray) -> Any:
    if np.isscalar(value) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return value  # one value for the whole batch
    return take_rows(value, rows)


def take_rows(batch: Any, rows: np.ndarray) -> Any:
    """Rows ``rows`` of a batched field: an array, a dict or tuple of them, or a tuple of ``str`` (Text).

    Example:
        >>> take_rows({"x": np.arange(3)}, np.array([2])), take_rows(("a", "b", "c"), np.array([1, 0]))
        ({'x': array([2])}, ('b', 'a'))
    """
    if isinstance(batch, dict):
        return {key: take_rows(value, rows) for key, value in batch.items()}
    if isinstance(batch, tuple) and batch and not isinstance(batch[0], (np.ndarray, dict, tuple)):
        return tuple(batch[i] for i in rows.tolist())
    if isinstance(batch, tuple):
        return tuple(take_rows(value, rows) for value in batch)
    if isinstance(batch, list):
        return [batch[i] for i in rows.tolist()]
    return batch[rows]


_ADD_ARGUMENTS = tuple(field.name for field in fields(Transitions))
