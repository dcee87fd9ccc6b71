"""Time-major on-policy rollout segments filled by an asynchronous collector."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from gymnasium import spaces

from asyncvec.buffers._disk import column_nbytes
from asyncvec.buffers._images import ImageCompression, resolve_image_compression
from asyncvec.buffers._spaces import SpaceCodec
from asyncvec.buffers.errors import BufferClosedError
from asyncvec.buffers.transitions import NUMBERS, Transitions, TransitionWriter
from asyncvec.lifecycle import release_if_held

__all__ = ["RolloutStore", "Segment"]


@dataclass
class Segment:
    """One full rollout segment, time-major ``[T, N]``: the `Transitions` fields a segment keeps,
    under the same names, plus ``last_obs`` (the env of a column is its index, so no ``env_id``).

    Attributes:
        obs: observation at each step, ``[T, N, *obs_shape]`` (dict/tuple of such arrays for
            Dict/Tuple spaces; object arrays of ``str`` for Text).
        action: action taken at each step, ``[T, N, *action_shape]``.
        reward: ``[T, N]`` float32, the reward received after ``action[t]``.
        terminated, truncated: ``[T, N]`` bool, whether the episode ended after step ``t``.
        values: ``[T, N]`` float32 critic values given to ``add`` (NaN where none was given).
        behavior_logp: ``[T, N]`` float32 log-probability of ``action[t]`` under the
            behavior policy.
        policy_version: ``[T, N]`` int64 version that chose ``action[t]``.
        last_obs: ``[N, *obs_shape]``, the observation after step ``T - 1`` of each env, to
            bootstrap ``V(last_obs)``.
        next_obs: ``[T, N, *obs_shape]``, the observation each step ended in, as given to
            ``add`` (meaningful only where ``add`` got one, not None). Where an episode ended it is the
            episode's final observation, so a truncated step can bootstrap ``V(next_obs[t])``.
        fallback: ``[T, N]`` bool, whether ``action[t]`` was a fallback (a deadline miss) rather
            than the policy's sample; learners mask these out of their losses.
    """

    obs: Any
    action: Any
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    values: np.ndarray
    behavior_logp: np.ndarray
    policy_version: np.ndarray
    last_obs: Any
    next_obs: Any = None
    fallback: np.ndarray | None = None

    def staleness(self, current_version: int) -> np.ndarray:
        """``[T, N]`` ``current_version - policy_version``."""
        return current_version - self.policy_version


# The per-transition numbers of `Transitions` a segment keeps (those `Segment` has), one column each.
_KEPT = tuple(number for number in NUMBERS if number.name in {field.name for field in fields(Segment)})


class RolloutStore(TransitionWriter[None]):
    """Collects fixed-length, time-major segments ``[T, N]`` for on-policy learners.

    Transitions arrive per env in any order and in partial batches (EnvPool style): ``add``
    (the signature of ``ReplayBuffer.add``, ``env_id`` required) appends each env's transition
    at that env's own cursor. The segment is ready when every
    env has ``T`` steps; ``get()`` returns it and shifts any steps a fast env already
    collected beyond ``T`` to the start of the next segment. An env may run at most
    ``max_steps_ahead`` steps past ``T`` before ``add`` refuses its transitions.

    Bootstrapping: the segment's ``last_obs[e]`` is env ``e``'s observation after its step
    ``T - 1``: the observation of its step ``T`` if it ran ahead, otherwise the ``next_obs``
    passed with its latest ``add``. ``get`` raises if an env has neither.

    Thread safety: ``add`` (collector thread) and ``get`` (learner thread) share one lock;
    ``get(timeout=...)`` blocks until the segment is ready.

    Args:
        num_steps: ``T``, steps per env in a segment.
        num_envs: ``N``.
        observation_space: per-env observation space (as for :class:`ReplayBuffer`).
        action_space: per-env action space.
        max_steps_ahead: how many steps of the next segment an env may collect before
            ``get``; defaults to ``num_steps``.
        image_compression: store image observations compressed (as for :class:`ReplayBuffer`:
            ``True``/``"zlib"`` lossless, ``"quantize"``/``"jpeg"`` lossy); ``get`` decodes them.

    Example:
        >>> import numpy as np
        >>> from gymnasium import spaces
        >>> store = RolloutStore(2, 3, spaces.Box(-1, 1, (1,)), spaces.Discrete(2))
        >>> def step(env_ids, version):  # a partial batch from an asynchronous env
        ...     n = len(env_ids)
        ...     store.add(np.zeros((n, 1), np.float32), np.ones(n, int), np.ones(n),
        ...               np.full((n, 1), 0.5, np.float32), np.zeros(n, bool), np.zeros(n, bool),
        ...               version, behavior_logp=np.full(n, -0.7), env_id=env_ids)
        >>> step([0, 2], 0); step([2, 1, 0], 0); store.ready()
        False
        >>> step([1, 2], 1); store.ready()
        True
        >>> segment = store.get(timeout=0)
        >>> segment.reward.shape, segment.policy_version[:, 2].tolist(), store.steps_per_env
        ((2, 3), [0, 0], [0, 0, 1])
    """

    def __init__(
        self,
        num_steps: int,
        num_envs: int,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        *,
        max_steps_ahead: int | None = None,
        image_compression: bool | str | ImageCompression | None = None,
    ) -> None:
        for field, value in (("num_steps", num_steps), ("num_envs", num_envs)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{field}: expected a positive int, got {value!r}")
        max_steps_ahead = num_steps if max_steps_ahead is None else max_steps_ahead
        if (
            isinstance(max_steps_ahead, bool)
            or not isinstance(max_steps_ahead, (int, np.integer))
            or max_steps_ahead < 0
        ):
            raise ValueError(f"max_steps_ahead: expected an int >= 0, got {max_steps_ahead!r}")
        self.num_steps = int(num_steps)
        self.num_envs = int(num_envs)
        self.max_steps_ahead = int(max_steps_ahead)
        self.observation_space = observation_space
        self.action_space = action_space
        self.image_compression = resolve_image_compression(image_compression)
        self._obs = SpaceCodec(observation_space, "obs", self.image_compression)
        self._action = SpaceCodec(action_space, "action")
        self._next_obs = SpaceCodec(observation_space, "next_obs", self.image_compression)
        rows = self.num_steps + self.max_steps_ahead
        self._columns: dict[str, np.ndarray] = {}
        for codec in (self._obs, self._action, self._next_obs):
            for name, (shape, dtype) in zip(codec.column_names(), codec.storage()):
                self._columns[name] = np.zeros((rows, self.num_envs, *shape), dtype)
        for number in _KEPT:
            self._columns[number.name] = np.zeros((rows, self.num_envs), number.dtype)
        self._columns["has_next_obs"] = np.zeros((rows, self.num_envs), np.bool_)
        self._cursor = np.zeros(self.num_envs, dtype=np.int64)
        self._cond = threading.Condition()
        self._closed = False

    def add_transitions(self, transitions: Transitions) -> None:
        """Append a `Transitions` record (what a collector writes to either buffer), one transition
        for each row at its env's cursor; :meth:`add` takes its fields as arguments.

        ``env_id`` is required here: ``(B,)`` env indices in ``[0, num_envs)`` (or one for every
        row), in any order; an env may appear more than once (its transitions are appended in
        order). ``next_obs`` may be None; it is kept per step as ``Segment.next_obs``, and the
        latest one per env serves as the bootstrap observation if the env has not started its
        next segment. ``episode_id`` is not kept (a segment is indexed by step and env).

        Raises:
            ValueError: a field does not match its space/shape (the message names the field,
                the space and the env), ``env_id`` is missing or out of range, or an env is
                already ``max_steps_ahead`` steps past the segment end.
        """
        t = transitions
        env_id, reward, next_obs = t.env_id, t.reward, t.next_obs
        if type(env_id) is int and env_id == -1:
            raise ValueError(
                f"env_id: RolloutStore.add needs the env index of each row, in [0, {self.num_envs}); got the default -1"
            )
        env_ids = np.asarray(env_id)
        if env_ids.ndim == 0 and env_ids.dtype.kind in "iu":  # one env for every row
            env_ids = np.full(np.shape(reward)[:1], env_ids)
        if env_ids.ndim != 1 or env_ids.dtype.kind not in "iu":
            raise ValueError(f"env_id: expected a 1-D int array, got {env_ids.dtype} shape {env_ids.shape}")
        n = len(env_ids)
        if n and (env_ids.min() < 0 or env_ids.max() >= self.num_envs):
            row = int(np.flatnonzero((env_ids < 0) | (env_ids >= self.num_envs))[0])
            raise ValueError(f"env_id: row {row}: env {env_ids[row]} is not in [0, {self.num_envs})")

        def row_label(row: int) -> str:
            return f"row {row} (env {env_ids[row]})"

        data: dict[str, np.ndarray] = {}
        for codec, value in ((self._obs, t.obs), (self._action, t.action)):
            data.update(zip(codec.column_names(), codec.encode(value, n, row_label)))
        for number in _KEPT:
            data[number.name] = number.column(getattr(t, number.name), n)
        next_columns = None if next_obs is None else self._next_obs.encode(next_obs, n, row_label)
        if next_columns is None:  # clear what an earlier segment left in these rows
            next_columns = [np.zeros((n, *shape), dtype) for shape, dtype in self._next_obs.storage()]
        data.update(zip(self._next_obs.column_names(), next_columns))
        data["has_next_obs"] = np.full(n, next_obs is not None)
        # The k-th occurrence of an env in this batch goes k steps past its cursor.
        occurrence = np.zeros(n, dtype=np.int64)
        seen: dict[int, int] = {}
        for row, env in enumerate(env_ids.tolist()):
            occurrence[row] = seen.get(env, 0)
            seen[env] = occurrence[row] + 1
        limit = self.num_steps + self.max_steps_ahead
        with self._cond:
            if self._closed:
                raise BufferClosedError("RolloutStore is closed")
            rows = self._cursor[env_ids] + occurrence
            if n and rows.max() >= limit:
                row = int(np.argmax(rows))
                raise ValueError(
                    f"add: env {env_ids[row]} already holds {self._cursor[env_ids[row]]} steps, the "
                    f"segment length {self.num_steps} plus max_steps_ahead={self.max_steps_ahead}; "
                    f"call get() to consume the ready segment first"
                )
            for name, value in data.items():
                self._columns[name][rows, env_ids] = value
            np.add.at(self._cursor, env_ids, 1)
            if self._ready_locked():
                self._cond.notify_all()

    def ready(self) -> bool:
        """Whether every env holds at least ``num_steps`` steps."""
        with self._cond:
            return self._ready_locked()

    def _ready_locked(self) -> bool:
        return bool(np.all(self._cursor >= self.num_steps))

    def get(self, timeout: float | None = None) -> Segment:
        """Wait for the segment, return it and start the next one.

        Args:
            timeout: seconds to wait for the segment; 0 checks once; None waits until ready
                or ``close()``.

        Raises:
            TimeoutError: not ready in time (the message lists the steps per env).
            ValueError: an env has no bootstrap observation (pass ``next_obs`` to ``add``).
            BufferClosedError: the store was closed (a ``RuntimeError``).
        """
        T = self.num_steps
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or self._ready_locked(), timeout):
                raise TimeoutError(
                    f"get: segment not ready after {timeout}s; steps per env {self._cursor.tolist()}, need {T} each"
                )
            if self._closed:
                raise BufferClosedError("RolloutStore is closed")
            ahead = self._cursor > T
            missing = ~ahead & ~self._columns["has_next_obs"][T - 1]
            if np.any(missing):
                raise ValueError(
                    f"get: envs {np.flatnonzero(missing).tolist()} have no bootstrap observation; "
                    f"pass next_obs to add() or add their next step first"
                )
            segment = {name: column[:T].copy() for name, column in self._columns.items()}
            # An env that ran ahead bootstraps from its step T; the others from their last next_obs.
            last_obs = []
            for obs_name, next_name in zip(self._obs.column_names(), self._next_obs.column_names()):
                last = segment[next_name][T - 1].copy()
                if ahead.any():  # (with max_steps_ahead=0 there is no row T to read)
                    last[ahead] = self._columns[obs_name][T, ahead]
                last_obs.append(last)
            for env in np.flatnonzero(ahead).tolist():
                extra = int(self._cursor[env]) - T
                for column in self._columns.values():
                    column[:extra, env] = column[T : T + extra, env]
            self._cursor = np.maximum(self._cursor - T, 0)
        return Segment(
            obs=self._obs.decode([segment[name] for name in self._obs.column_names()]),
            action=self._action.decode([segment[name] for name in self._action.column_names()]),
            last_obs=self._obs.decode(last_obs),
            next_obs=self._next_obs.decode([segment[name] for name in self._next_obs.column_names()]),
            **{number.name: segment[number.name] for number in _KEPT},
        )

    @property
    def nbytes(self) -> int:
        """Bytes the store's columns hold (compressed images: their blobs and Python's overhead)."""
        with self._cond:
            return sum(column_nbytes(column) for column in self._columns.values())

    @property
    def steps_per_env(self) -> list[int]:
        """Steps each env holds now (can exceed ``num_steps`` by ``max_steps_ahead``)."""
        with self._cond:
            steps: list[int] = self._cursor.tolist()
            return steps

    def clear(self) -> None:
        """Drop every stored step and bootstrap observation (e.g. after a policy reset)."""
        with self._cond:
            self._cursor[:] = 0

    def close(self) -> None:
        """Wake a waiting ``get`` (it raises RuntimeError) and refuse further adds."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def release_after_interrupt(self) -> None:
        """Releases the store's lock if this thread still holds it. A ``KeyboardInterrupt`` that
        lands as ``get`` enters ``with`` (after the lock is taken, before the block runs) leaves
        it held, and the collector thread's next ``add`` would then wait forever. Call it where
        such an interrupt is handled, before stopping the collector."""
        release_if_held(self._cond)

    def __repr__(self) -> str:
        return f"RolloutStore(num_steps={self.num_steps}, num_envs={self.num_envs}, steps_per_env={self.steps_per_env})"
