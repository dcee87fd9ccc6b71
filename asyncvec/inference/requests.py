"""The pieces a policy request passes through: its fallback action, its cache key, the LRU cache, the version
lock that lets a weight swap wait for in-flight batches, the request record, and splitting a batch of observations.

`asyncvec.inference.base.BatchedPolicy` is built from them; `zero_action` and `split_batch` also serve the control and
distributed rooms.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from contextlib import contextmanager
from typing import Any

import gymnasium as gym
import numpy as np

from asyncvec.inference.types import TextPrompt


def zero_action(space: gym.Space) -> Any:
    """The "no-op" action of a space: zeros clipped into the bounds, ``start`` for discrete
    spaces, the empty string for `gymnasium.spaces.Text`.

    Example:
        >>> zero_action(gym.spaces.Discrete(3, start=1))
        1
        >>> zero_action(gym.spaces.Box(low=1.0, high=2.0, shape=(2,))).tolist()
        [1.0, 1.0]
    """
    if isinstance(space, gym.spaces.Discrete):
        return int(space.start)
    if isinstance(space, gym.spaces.Box):
        return np.clip(np.zeros(space.shape, dtype=space.dtype), space.low, space.high).astype(space.dtype)
    if isinstance(space, gym.spaces.MultiDiscrete):
        return np.array(space.start, dtype=space.dtype, copy=True)
    if isinstance(space, gym.spaces.MultiBinary):
        return np.zeros(space.shape, dtype=space.dtype)
    if isinstance(space, gym.spaces.Text):
        return ""
    if isinstance(space, gym.spaces.Tuple):
        return tuple(zero_action(sub) for sub in space.spaces)
    if isinstance(space, gym.spaces.Dict):
        return {key: zero_action(sub) for key, sub in space.spaces.items()}
    raise ValueError(f"no zero action for action_space {space!r}; pass fallback=<function(obs, env_id) -> action>")


def observation_key(obs: Any) -> bytes:
    """A content hash of an observation (arrays, dicts, sequences, strings, numbers).

    Equal content gives equal keys; dtype and shape are part of the key.

    Example:
        >>> observation_key(np.zeros(3)) == observation_key(np.zeros(3))
        True
        >>> observation_key(np.zeros(3)) == observation_key(np.zeros(3, dtype=np.float32))
        False
    """
    digest = hashlib.blake2b(digest_size=16)
    _feed_hash(digest, obs)
    return digest.digest()


def _feed_hash(digest: Any, obs: Any) -> None:
    if isinstance(obs, np.ndarray):
        digest.update(f"nd{obs.dtype.str}{obs.shape}".encode())
        digest.update(np.ascontiguousarray(obs).tobytes())
    elif isinstance(obs, TextPrompt):
        digest.update(b"tp" + repr(dataclasses.astuple(obs)).encode())
    elif isinstance(obs, str):
        digest.update(b"s%d:" % len(obs) + obs.encode())
    elif isinstance(obs, bytes):
        digest.update(b"b%d:" % len(obs) + obs)
    elif isinstance(obs, Mapping):
        digest.update(b"{")
        for key in sorted(obs, key=str):
            _feed_hash(digest, str(key))
            _feed_hash(digest, obs[key])
        digest.update(b"}")
    elif isinstance(obs, (list, tuple)):
        digest.update(b"[%d" % len(obs))
        for item in obs:
            _feed_hash(digest, item)
        digest.update(b"]")
    elif isinstance(obs, (bool, int, float, np.generic)) or obs is None:
        digest.update(f"{type(obs).__name__}:{obs!r}".encode())
    else:
        raise TypeError(f"cannot hash an observation of type {type(obs).__name__} for the result cache")


class LRUCache:
    """Thread-safe LRU map with a fixed capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)


class VersionLock:
    """Readers/writer lock that prefers the writer: batches read, a weight swap writes.

    While a swap waits, no new batch starts, so a swap cannot be starved by a busy queue,
    and no batch ever runs on a mix of old and new weights.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @property
    def writers_waiting(self) -> int:
        """Writers waiting for the readers to leave (new readers wait meanwhile)."""
        return self._writers_waiting

    @contextmanager
    def read(self) -> Iterator[None]:
        entered = False  # set with the count, so an interrupt anywhere leaves the count as it found it
        try:
            with self._cond:
                while self._writer or self._writers_waiting:
                    self._cond.wait()
                self._readers += 1
                entered = True
            yield
        finally:
            if entered:
                with self._cond:
                    self._readers -= 1
                    if self._readers == 0:
                        self._cond.notify_all()

    @contextmanager
    def write(self, timeout: float) -> Iterator[None]:
        acquired = False  # an interrupt after the swap was granted still hands it back (readers would wait forever)
        try:
            with self._cond:
                self._writers_waiting += 1
                try:
                    acquired = self._cond.wait_for(lambda: not self._writer and self._readers == 0, timeout)
                    if acquired:
                        self._writer = True
                finally:
                    self._writers_waiting -= 1
                    if not self._writer:
                        self._cond.notify_all()
            if not acquired:
                raise TimeoutError(f"in-flight batches did not finish within {timeout} s; weights not swapped")
            yield
        finally:
            if acquired:
                with self._cond:
                    self._writer = False
                    self._cond.notify_all()


@dataclasses.dataclass(eq=False)
class Request:
    raw_obs: Any
    obs: Any
    env_id: int | None
    submitted: float
    future: Future
    cache_key: bytes | None = None
    completed: bool = False
    prefix: Any = None  # a GeneratedPrefix: what a failed attempt had generated, continued by the next one


def submit_all(
    policy: Any, obs_batch: Any, env_ids: Sequence[int] | None, timeout: float | None, *, label: str
) -> list[Any]:
    """`Policy.act` through ``policy.submit``: submits each observation of the batch with its env id (default: its
    position), waits for all and returns the answers (`PolicyOutput`); ``label`` starts the errors.

    Raises:
        ValueError: not one env id per observation.
        TimeoutError: not every answer arrived within ``timeout`` seconds.
    """
    observations = split_batch(obs_batch)
    ids = list(range(len(observations))) if env_ids is None else list(env_ids)
    if len(ids) != len(observations):
        raise ValueError(f"{label}: got {len(observations)} observations but {len(ids)} env_ids")
    futures = [policy.submit(obs, env_id=env_id) for obs, env_id in zip(observations, ids, strict=True)]
    _, not_done = wait_futures(futures, timeout=timeout)
    if not_done:
        raise TimeoutError(f"{label}: {len(not_done)} of {len(futures)} answers not ready after {timeout} s")
    return [future.result() for future in futures]


def split_batch(obs_batch: Any) -> list[Any]:
    """Split a batch (sequence, stacked array, or dict of stacked arrays) into observations.

    Example:
        >>> split_batch({"a": np.zeros((2, 3)), "b": np.ones(2)})[1]["b"]
        np.float64(1.0)
    """
    if isinstance(obs_batch, (str, bytes)):
        raise TypeError("act() takes a batch of observations, got a single str; use submit() or wrap it in a list")
    if isinstance(obs_batch, np.ndarray):
        if obs_batch.ndim == 0:
            raise TypeError("act() takes a batch of observations, got a 0-d array")
        return list(obs_batch)
    if isinstance(obs_batch, Mapping):
        lengths = {key: len(value) for key, value in obs_batch.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"dict observation batch has keys of different lengths: {lengths}")
        size = next(iter(lengths.values()), 0)
        return [{key: value[index] for key, value in obs_batch.items()} for index in range(size)]
    if isinstance(obs_batch, Sequence):
        return list(obs_batch)
    raise TypeError(f"act() takes a list, a stacked array or a dict of stacked arrays, got {type(obs_batch).__name__}")
