"""Where the vector env keeps its envs' latest observations, and rows taken out of batches.

Observations reach the parent through shared memory (fixed-shape spaces: the workers write the
rows), through the pipe with each answer (Text, Sequence, Graph...), or both (a Dict whose
fixed-shape entries are in shared memory and the rest comes by pipe, merged on arrival).
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import numpy as np
from gymnasium import Space
from gymnasium.vector.utils import concatenate, create_empty_array, read_from_shared_memory

from asyncvec.vector.split_obs import check_row, merge_row, row_templates, shared_subspace

__all__ = ["ObservationBuffers", "copy_batch", "take", "take_info"]


def take(batch: Any, rows: np.ndarray | int) -> Any:
    """Rows (or one row) of a batched observation (nested dicts/tuples of arrays), as a copy.

    Example:
        >>> take({"x": np.arange(6).reshape(3, 2)}, np.array([2, 0]))
        {'x': array([[4, 5],
               [0, 1]])}
    """
    if isinstance(batch, dict):
        return {key: take(value, rows) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(take(value, rows) for value in batch)
    return np.take(batch, rows, axis=0)


def copy_batch(batch: Any) -> Any:
    """A copy of a batched observation: arrays copied with numpy, anything else deep-copied.

    Example:
        >>> batch = (np.zeros(2), ["a", "b"])
        >>> copied = copy_batch(batch)
        >>> copied[1] == batch[1], copied[0] is batch[0], copied[1] is batch[1]
        (True, False, False)
    """
    if type(batch) is np.ndarray and batch.dtype != object:
        return batch.copy()
    if isinstance(batch, dict):
        return {key: copy_batch(value) for key, value in batch.items()}
    if type(batch) is tuple:
        return tuple(copy_batch(value) for value in batch)
    return deepcopy(batch)


def take_info(infos: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
    """Rows of a gymnasium vector info dict (arrays and ``_key`` masks sized ``num_envs``).

    Example:
        >>> take_info({"x": np.array([1, 2, 3]), "_x": np.array([True, False, True])}, np.array([2]))
        {'x': array([3]), '_x': array([ True])}
    """
    return {key: take_info(value, rows) if isinstance(value, dict) else value[rows] for key, value in infos.items()}


class ObservationBuffers:
    """The latest observation of each of ``num_envs`` envs, and the batches made of them.

    :meth:`build` (again whenever the space or the shared memory changes) lays the buffers out;
    :meth:`store` takes an observation that came with an answer (nothing to do when it is
    wholly in shared memory).

    Example:
        >>> from gymnasium import spaces
        >>> buffers = ObservationBuffers(num_envs=2)
        >>> buffers.build(spaces.Text(8), shared_memory=None)
        >>> buffers.store(0, "hi"); buffers.store(1, "there")
        >>> buffers.batch(copy=True), buffers.rows(np.array([1]))
        (('hi', 'there'), ('there',))
    """

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs
        self.space: Space[Any] | None = None
        self.observations: Any = None  # the batch: shared memory views, or arrays filled from per_env
        self.per_env: list[Any] | None = None  # latest observation per env, unless wholly in shared memory
        self.templates: Any = None  # what the parent checks observations against without shared memory
        self._shared_rows: Any = None  # shared views of a Dict's fixed-shape entries when the rest goes by pipe

    def build(self, space: Space[Any], shared_memory: Any) -> None:
        """Lays out the buffers of ``space``; ``shared_memory``: the workers' buffer, or ``None``."""
        self.space = space
        shared_space = None if shared_memory is None else shared_subspace(space)
        self._shared_rows = None
        self.per_env = None
        # without shared memory the parent checks what the workers' write_row would have (check_row)
        self.templates = row_templates(space) if shared_memory is None else None
        if shared_space is not None and shared_space is not space:
            # Split Dict: fixed-shape entries in shared memory, the rest (e.g. Text) by pipe, merged on arrival.
            self._shared_rows = read_from_shared_memory(shared_space, shared_memory, n=self.num_envs)
            self.observations = create_empty_array(space, n=self.num_envs, fn=np.zeros)
            self.per_env = [None] * self.num_envs
        elif shared_memory is not None:
            self.observations = read_from_shared_memory(space, shared_memory, n=self.num_envs)
        else:
            self.observations = create_empty_array(space, n=self.num_envs, fn=np.zeros)
            self.per_env = [None] * self.num_envs

    @property
    def in_shared_memory(self) -> bool:
        """Whether every observation is wholly in shared memory (an answer's observation needs no handling)."""
        return self.templates is None and self.per_env is None

    def store(self, index: int, observation: Any) -> None:
        """Keeps env ``index``'s observation (the part that came by pipe).

        Raises:
            ValueError: the observation does not fit the space (as writing it to shared memory would).
        """
        if self.templates is not None:
            check_row(self.templates, index, observation)
        if self.per_env is not None:
            self.per_env[index] = (
                observation if self._shared_rows is None else merge_row(self._shared_rows, index, observation)
            )

    def single(self, index: int) -> Any:
        """Env ``index``'s latest observation."""
        if self.per_env is not None:
            return self.per_env[index]
        return take(self.observations, index)

    def batch(self, copy: bool) -> Any:
        """Every env's latest observation as one batch (the buffer itself unless ``copy``)."""
        if self.per_env is not None:
            assert self.space is not None  # built before any observation arrives
            self.observations = concatenate(self.space, self.per_env, self.observations)
        return copy_batch(self.observations) if copy else self.observations

    def rows(self, ids: np.ndarray) -> Any:
        """The latest observations of the envs ``ids`` (an integer array), as a new batch."""
        if self.per_env is None:  # everything in shared memory
            return take(self.observations, ids)
        assert self.space is not None  # built before any observation arrives
        empty = create_empty_array(self.space, n=len(ids), fn=np.zeros)
        return concatenate(self.space, [self.per_env[i] for i in ids], empty)
