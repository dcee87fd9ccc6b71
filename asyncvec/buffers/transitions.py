"""`Transitions`: the one record of a batch of transitions that collectors write and both
buffers take. Its fields are the parameters of ``add`` (`TransitionWriter`, the base of both
buffers), and the per-transition numbers among them say how a buffer stores and checks them
(`NUMBERS`): adding a field to the record is adding it here."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Generic, TypeVar

import numpy as np

from asyncvec.buffers._spaces import as_column

__all__ = ["NUMBERS", "Number", "TransitionWriter", "Transitions", "policy_columns"]


@dataclass(frozen=True)
class Number:
    """A per-transition number of `Transitions` (``reward``, ``policy_version``...): how the buffers
    store and check its column.

    Attributes:
        name: the field's name, also its column's.
        dtype: the column's dtype (a value converts to it only where lossless).
        default: the value a row holds when ``add`` does not get the field (MISSING: required).
        per_row: it must come as a ``(B,)`` array, never as one scalar for the whole batch.
        finite: NaN and infinities are refused.
        minimum: smaller values are refused (None: any).

    A ``per_row`` number is required; any other may be one scalar for the whole batch.
    """

    name: str
    dtype: np.dtype
    default: Any
    per_row: bool
    finite: bool
    minimum: int | None

    @property
    def required(self) -> bool:
        """Whether ``add`` needs the field (it has no default)."""
        return self.default is MISSING

    def column(self, value: Any, n: int) -> np.ndarray:
        """``value`` as an ``(n,)`` array of the dtype, converted where lossless and checked; a
        ``ValueError`` names the field, the expected dtype and shape, and the first bad row."""
        return as_column(
            self.name, value, n, self.dtype, allow_scalar=not self.per_row, minimum=self.minimum, finite=self.finite
        )


def _number(dtype: type, *, per_row: bool = False, finite: bool = False, minimum: int | None = None) -> dict[str, Any]:
    """The metadata of a `Transitions` field that is one number per transition (see `Number`)."""
    return {"dtype": np.dtype(dtype), "per_row": per_row, "finite": finite, "minimum": minimum}


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

    # Fields without `_number` metadata are observations or actions: stored as their space says.
    obs: Any
    action: Any
    reward: np.ndarray = field(metadata=_number(np.float32, per_row=True, finite=True))
    next_obs: Any
    terminated: np.ndarray = field(metadata=_number(np.bool_, per_row=True))
    truncated: np.ndarray = field(metadata=_number(np.bool_, per_row=True))
    policy_version: Any = field(metadata=_number(np.int64, minimum=0))
    behavior_logp: Any = field(default=np.nan, metadata=_number(np.float32))
    env_id: Any = field(default=-1, metadata=_number(np.int64, minimum=-1))
    episode_id: Any = field(default=-1, metadata=_number(np.int64))
    fallback: Any = field(default=False, metadata=_number(np.bool_))
    values: Any = field(default=np.nan, metadata=_number(np.float32))

    def add_arguments(self) -> dict[str, Any]:
        """The record's fields by name: the keyword arguments of both buffers' ``add``."""
        return {name: getattr(self, name) for name in FIELD_NAMES}

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


def policy_columns(outputs: Sequence[Any]) -> dict[str, np.ndarray]:
    """The fields of `Transitions` that a policy's answers (one ``PolicyOutput`` per row) give:
    ``behavior_logp``, ``policy_version`` and ``fallback``.

    Example:
        >>> from types import SimpleNamespace as Answer
        >>> columns = policy_columns([Answer(behavior_logp=-0.5, policy_version=3, fallback=False)])
        >>> columns["policy_version"].tolist(), columns["behavior_logp"].dtype
        ([3], dtype('float32'))
    """
    return {
        "behavior_logp": np.array([o.behavior_logp for o in outputs], dtype=np.float32),
        "policy_version": np.array([o.policy_version for o in outputs], dtype=np.int64),
        "fallback": np.array([o.fallback for o in outputs], dtype=bool),
    }


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Transitions))
"""The fields of `Transitions` in order: the parameters of ``add``."""

NUMBERS: tuple[Number, ...] = tuple(
    Number(f.name, default=f.default, **f.metadata) for f in fields(Transitions) if "dtype" in f.metadata
)
"""The per-transition numbers of `Transitions`, in field order: a buffer keeps each as a column."""

_Added = TypeVar("_Added")


class TransitionWriter(abc.ABC, Generic[_Added]):
    """The base of both buffers: one ``add``, whose parameters are the fields of `Transitions`;
    a buffer implements :meth:`add_transitions`."""

    def add(
        self,
        obs: Any,
        action: Any,
        reward: Any,
        next_obs: Any,
        terminated: Any,
        truncated: Any,
        policy_version: Any,
        *,
        behavior_logp: Any = np.nan,
        env_id: Any = -1,
        episode_id: Any = -1,
        fallback: Any = False,
        values: Any = np.nan,
    ) -> _Added:
        """Append a batch of transitions (leading dimension = batch); the arguments are the fields
        of `Transitions`, and ``add(...)`` is ``add_transitions(Transitions(...))``.

        Args:
            obs, next_obs: batched observations: an array ``(B, *shape)``, a dict/tuple of
                them for Dict/Tuple spaces, a list of ``B`` str for Text. Where an episode ended,
                ``next_obs`` is its final observation (a `RolloutStore` also takes None).
            action: batched actions, same conventions.
            reward: ``(B,)`` floats. terminated, truncated: ``(B,)`` bools.
            policy_version: version that produced each action, ``(B,)`` or one int.
            behavior_logp: log-probability of each action under the behavior policy (NaN:
                unknown).
            env_id: the env of each row (-1: unknown); a `RolloutStore` needs it (indices in
                ``[0, num_envs)``, in any order, an env may appear more than once).
            episode_id: the episode of each row (-1: unknown); not kept by a `RolloutStore`.
            fallback: whether the action was a deadline fallback rather than the policy's.
            values: critic values of ``obs``; not kept by a `ReplayBuffer` (off-policy learners
                compute their own).
            Every metadata argument may be one scalar for the whole batch.

        Returns:
            What :meth:`add_transitions` returns: the slots written (`ReplayBuffer`), None
            (`RolloutStore`).

        Raises:
            ValueError: a field does not match its space or shape; the message names the
                field, the expected space and the offending row (and its env); see
                :meth:`add_transitions` for what else a buffer refuses.
        """
        record = Transitions(
            obs, action, reward, next_obs, terminated, truncated, policy_version,
            behavior_logp, env_id, episode_id, fallback, values,
        )  # fmt: skip
        return self.add_transitions(record)

    @abc.abstractmethod
    def add_transitions(self, transitions: Transitions) -> _Added:
        """Append a `Transitions` record (what a collector writes to either buffer)."""


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
