"""The safety layer between a policy and the actuators: bounds, a rate limit, a user predicate.

`SafetyFilter` checks each action before it reaches the env and replaces a violating one by a
safe one, in this order:

1. **finite**: an action with NaN or inf is replaced by the safe action (reason ``"nonfinite"``).
2. **bounds**: each element is clipped into ``[low, high]`` (default: the action space's
   bounds) (``"bounds"``).
3. **rate**: each element may move at most ``max_delta`` from the previous executed action of
   the same env; larger steps are clipped to ``previous ± max_delta`` (``"rate"``).
4. **predicate**: ``predicate(obs, action) -> bool``; when False, the action is replaced by the
   safe action (``"predicate"``).

The safe action is ``"hold"`` (the previous executed action of that env, or zero at the start
of an episode), ``"zero"`` (the action space's no-op), or a function
``safe_action(obs, previous, env_id) -> action``. Every replacement is counted per reason
(`SafetyFilter.stats`, `SafetyFilter.log` writes them to TensorBoard through a `RunLogger`) and
reported to the caller, which marks the sample: an action the filter replaced is not the
policy's choice and must not be trained on as one.

Use it as a gymnasium wrapper (`SafetyWrapper`, any policy: the verdict is in ``info``) or let
the `ChunkExecutor` call it on every executed action.

Example:
    >>> import gymnasium as gym, numpy as np
    >>> space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    >>> safety = SafetyFilter(space, max_delta=0.5)
    >>> safety(None, np.array([0.0, 0.0]), env_id=0)
    (array([0., 0.], dtype=float32), None)
    >>> safety(None, np.array([3.0, 0.2]), env_id=0)
    (array([0.5, 0.2], dtype=float32), 'bounds+rate')
    >>> safety.stats()["replaced"], safety.stats()["bounds"], safety.stats()["rate"]
    (1, 1, 1)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from asyncvec.inference.requests import zero_action

__all__ = ["SAFETY_REASONS", "SafetyFilter", "SafetyWrapper"]

SAFETY_REASONS = ("nonfinite", "bounds", "rate", "predicate")

SafeAction = str | Callable[[Any, np.ndarray | None, int], Any]


class SafetyFilter:
    """Replaces unsafe actions by safe ones and counts why (see the module docstring).

    Args:
        action_space: a ``Box`` action space; actions must have its shape (reshaped if they
            have its size).
        low, high: bounds to enforce (scalars or arrays of the action's shape); default the
            space's bounds.
        max_delta: the largest change of any element from one executed action to the next
            (scalar or array), or None for no rate limit.
        predicate: ``predicate(obs, action) -> bool``, True when the (bounded, rate-limited)
            action is safe in ``obs``; or None.
        safe_action: ``"hold"``, ``"zero"`` or ``safe_action(obs, previous, env_id)``.

    Raises:
        ValueError: an action of the wrong size (the message names the env and the space).
    """

    def __init__(
        self,
        action_space: gym.spaces.Box,
        *,
        low: Any = None,
        high: Any = None,
        max_delta: Any = None,
        predicate: Callable[[Any, np.ndarray], bool] | None = None,
        safe_action: SafeAction = "hold",
    ) -> None:
        if not isinstance(action_space, gym.spaces.Box):
            raise TypeError(f"SafetyFilter needs a Box action space, got {action_space!r}")
        if not (callable(safe_action) or safe_action in ("hold", "zero")):
            raise ValueError(
                f"safe_action must be 'hold', 'zero' or a function(obs, previous, env_id), got {safe_action!r}"
            )
        if predicate is not None and not callable(predicate):
            raise TypeError(f"predicate must be a function(obs, action) -> bool, got {type(predicate).__name__}")
        self.action_space = action_space
        shape, dtype = action_space.shape, action_space.dtype
        self.low = np.broadcast_to(np.asarray(action_space.low if low is None else low, dtype=dtype), shape).copy()
        self.high = np.broadcast_to(np.asarray(action_space.high if high is None else high, dtype=dtype), shape).copy()
        if np.any(self.low > self.high):
            raise ValueError(f"low must be <= high everywhere, got low={self.low}, high={self.high}")
        self.max_delta = None
        if max_delta is not None:
            self.max_delta = np.broadcast_to(np.asarray(max_delta, dtype=dtype), shape).copy()
            if np.any(self.max_delta < 0) or not np.all(np.isfinite(self.max_delta)):
                raise ValueError(f"max_delta must be finite and >= 0, got {max_delta!r}")
        self.predicate = predicate
        self.safe_action = safe_action
        self._zero = np.clip(zero_action(action_space), self.low, self.high).astype(dtype)
        self._previous: dict[int, np.ndarray] = {}
        self._counts = dict.fromkeys(("checked", "replaced", *SAFETY_REASONS), 0)

    def reset(self, env_id: int | None = None) -> None:
        """Forgets the previous action of ``env_id`` (all envs if None): call at an episode start."""
        if env_id is None:
            self._previous.clear()
        else:
            self._previous.pop(int(env_id), None)

    def previous(self, env_id: int) -> np.ndarray | None:
        """The last action executed by ``env_id`` in this episode, if any."""
        return self._previous.get(int(env_id))

    def __call__(self, obs: Any, action: Any, *, env_id: int = 0) -> tuple[np.ndarray, str | None]:
        """Returns ``(action to execute, reason)``; ``reason`` is None when the action passed untouched,
        else the violated checks joined by ``+`` (e.g. ``"bounds+rate"``). Records the executed
        action as ``env_id``'s previous one."""
        space = self.action_space
        proposed = np.asarray(action)
        if proposed.size != int(np.prod(space.shape)) or not np.issubdtype(proposed.dtype, np.number):
            raise ValueError(
                f"SafetyFilter: action for env {env_id} has shape {proposed.shape} and dtype {proposed.dtype}, "
                f"expected {space.shape} of {space}"
            )
        proposed = proposed.reshape(space.shape)
        previous = self._previous.get(int(env_id))
        reasons: list[str] = []
        if not np.all(np.isfinite(proposed)):
            reasons.append("nonfinite")
            executed = self._safe(obs, previous, env_id)
        else:
            executed = proposed.astype(space.dtype, copy=True)
            if np.any(executed < self.low) or np.any(executed > self.high):
                reasons.append("bounds")
                executed = np.clip(executed, self.low, self.high)
            if self.max_delta is not None and previous is not None:
                limited = np.clip(executed, previous - self.max_delta, previous + self.max_delta)
                if np.any(limited != executed):
                    reasons.append("rate")
                    executed = limited
            if self.predicate is not None and not self.predicate(obs, executed):
                reasons.append("predicate")
                executed = self._safe(obs, previous, env_id)
        self._counts["checked"] += 1
        if reasons:
            self._counts["replaced"] += 1
            for reason in reasons:
                self._counts[reason] += 1
        self._previous[int(env_id)] = executed
        return executed, "+".join(reasons) if reasons else None

    def _safe(self, obs: Any, previous: np.ndarray | None, env_id: int) -> np.ndarray:
        if callable(self.safe_action):
            value = np.asarray(self.safe_action(obs, previous, env_id), dtype=self.action_space.dtype)
            if value.shape != self.action_space.shape:
                raise ValueError(
                    f"SafetyFilter: safe_action returned shape {value.shape} for env {env_id}, "
                    f"expected {self.action_space.shape}"
                )
            return value
        if self.safe_action == "hold" and previous is not None:
            return previous.copy()
        return self._zero.copy()

    def stats(self) -> dict[str, int | float]:
        """Counts: checked, replaced, one per reason (an action may have several), replaced_fraction."""
        counts: dict[str, int | float] = dict(self._counts)
        counts["replaced_fraction"] = (
            self._counts["replaced"] / self._counts["checked"] if self._counts["checked"] else 0.0
        )
        return counts

    def log(self, logger: Any, step: int, prefix: str = "safety/") -> None:
        """Writes the counts to a `asyncvec.metrics.RunLogger` (TensorBoard) at ``step``."""
        logger.log({f"{prefix}{key}": value for key, value in self.stats().items()}, step=step)


class SafetyWrapper(gym.Wrapper):
    """Runs every action through a `SafetyFilter` before the wrapped env sees it.

    Works under any policy (the filter needs no policy). ``info`` of each step carries
    ``safety_replaced`` (bool), ``safety_reason`` (``""`` when the action passed) and
    ``executed_action``; a sample with ``safety_replaced`` is not the policy's choice.

    Example:
        >>> import gymnasium as gym
        >>> env = SafetyWrapper(gym.make("Pendulum-v1"), max_delta=0.5)
        >>> _ = env.reset(seed=0)
        >>> _, _, _, _, info = env.step(np.array([2.0], dtype=np.float32))
        >>> info["safety_replaced"], info["safety_reason"]
        (False, '')
        >>> _, _, _, _, info = env.step(np.array([-2.0], dtype=np.float32))
        >>> info["safety_reason"], info["executed_action"].tolist()
        ('rate', [1.5])
    """

    def __init__(self, env: gym.Env, safety: SafetyFilter | None = None, **filter_kwargs: Any) -> None:
        super().__init__(env)
        if safety is not None and filter_kwargs:
            raise ValueError("pass either a SafetyFilter or its keyword arguments, not both")
        self.safety = safety if safety is not None else SafetyFilter(env.action_space, **filter_kwargs)
        self._obs: Any = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.safety.reset(0)
        self._obs, info = self.env.reset(seed=seed, options=options)
        return self._obs, info

    def step(self, action: Any):
        executed, reason = self.safety(self._obs, action, env_id=0)
        self._obs, reward, terminated, truncated, info = self.env.step(executed)
        info = {
            **info,
            "safety_replaced": reason is not None,
            "safety_reason": reason or "",
            "executed_action": executed,
        }
        return self._obs, reward, terminated, truncated, info
