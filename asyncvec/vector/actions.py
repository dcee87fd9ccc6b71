"""What a caller hands the vector env, made per env and checked: actions (split from a batch and checked
against the single action space), reset seeds and reset masks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import Space, spaces
from gymnasium.vector.utils import batch_space, iterate

__all__ = ["ActionSplitter", "reset_mask", "seeds_for"]


_ARRAY_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


class ActionSplitter:
    """Splits the actions a vector env is given into one action per env, checking them.

    Args:
        single_action_space: the action space of one env.
        num_envs: the vector env's size (its batched action space is built once here).

    Example:
        >>> import numpy as np
        >>> from gymnasium import spaces
        >>> splitter = ActionSplitter(spaces.Discrete(3), num_envs=4)
        >>> splitter.split(np.array([0, 2]), [1, 3], validate=True)
        [np.int64(0), np.int64(2)]
        >>> splitter.split(np.array([0, 5]), [1, 3], validate=True)
        Traceback (most recent call last):
        ...
        ValueError: action 5 for env 3 is not in the action space Discrete(3)
    """

    def __init__(self, single_action_space: Space[Any], num_envs: int) -> None:
        self.single_action_space = single_action_space
        self._batched: dict[int, Space[Any]] = {num_envs: batch_space(single_action_space, num_envs)}
        self._box_bounds: tuple[Any, ...] | None = None  # a Box space's (low, high) if each is one number, else ()

    def check(self, action: Any, env_id: int) -> Any:
        """``action`` if it belongs to the space (a Box action cast to its dtype); else a ValueError naming ``env_id``."""
        space = self.single_action_space
        if isinstance(space, spaces.Box):
            action = np.asarray(action)
            if action.shape != space.shape:
                raise ValueError(f"action for env {env_id} has shape {action.shape}, expected {space.shape} of {space}")
            if np.issubdtype(action.dtype, np.number) and action.dtype != space.dtype:
                action = action.astype(space.dtype)
        if not space.contains(action):
            raise ValueError(f"action {action} for env {env_id} is not in the action space {space}")
        return action

    def batched_space(self, count: int) -> Space[Any]:
        """The action space of a ``send`` to ``count`` envs (cached per count), to split and check actions.

        A space that gymnasium batches as a ``Tuple`` of deep copies (``Text``, ``Graph``,
        ``Sequence``, custom spaces) is batched here as a ``Tuple`` of the single space itself: the
        same items and checks, without a deep copy per env (``batch_space`` of a ``Text`` space took 1.2 ms
        for 1 env, 8.8 ms for 16: a ``send`` to a number of envs not seen before stalled its caller)."""
        batched = self._batched.get(count)
        if batched is None:
            single = self.single_action_space
            if batch_space.dispatch(type(single)) is batch_space.dispatch(Space):
                batched = spaces.Tuple((single,) * count)
            else:
                batched = batch_space(single, count)
            self._batched[count] = batched
        return batched

    def split(self, actions: Any, env_ids: Sequence[int], validate: bool) -> list[Any]:
        """One action per env of ``env_ids``; with ``validate``, each checked (a bad one raises ValueError)."""
        count = len(env_ids)
        batched = self.batched_space(count)
        try:
            # gymnasium's iterate of an array space's batch is iter(array): taken directly for arrays
            arrays = type(actions) is np.ndarray and type(self.single_action_space) in _ARRAY_SPACES
            items = list(actions) if arrays else list(iterate(batched, actions))
        except Exception as exc:
            raise ValueError(
                f"actions do not fit a batch of {count} from single_action_space {self.single_action_space}: {exc}"
            ) from exc
        if len(items) != count:
            raise ValueError(
                f"got {len(items)} actions for {count} envs (env_ids={list(env_ids)}); "
                f"expected one action per env from {self.single_action_space}"
            )
        if validate and not self._quickly_valid(actions, count) and not batched.contains(actions):
            items = [self.check(a, i) for a, i in zip(items, env_ids)]  # finds the bad one, casts Box dtypes
        return items

    def fits_rows(self, actions: Any, rows: Any, validate: bool) -> bool:
        """Whether a lockstep batch ``actions`` goes into the shared action ``rows`` as one array (the compact
        step): an array of the rows' shape and dtype, and, with ``validate``, every action in the space.
        ``False`` means "take the per-env path" (which checks and names a bad action's env)."""
        if type(actions) is not np.ndarray or type(rows) is not np.ndarray:
            return False
        if actions.shape != rows.shape or actions.dtype != rows.dtype:
            return False
        count = len(actions)
        return not validate or self._quickly_valid(actions, count) or self.batched_space(count).contains(actions)

    def _quickly_valid(self, actions: Any, count: int) -> bool:
        """A cheaper ``contains`` for the common cases: an integer array of Discrete actions, or a
        Box batch of the space's dtype whose bounds are one number each (two reductions instead of
        the batched space's checks). ``False`` means "not shown", not "invalid"."""
        space = self.single_action_space
        if type(actions) is not np.ndarray or count == 0:
            return False
        if type(space) is spaces.Discrete:
            if actions.shape != (count,) or actions.dtype.kind not in "iu":
                return False
            if count <= 64:  # Python's min/max of a short list cost less than two numpy reductions
                values = actions.tolist()
                return bool(min(values) >= space.start and max(values) < space.start + space.n)
            return bool(actions.min() >= space.start and actions.max() < space.start + space.n)
        if type(space) is spaces.Box and actions.dtype == space.dtype and actions.shape == (count, *space.shape):
            bounds = self._box_bounds
            if bounds is None:
                low, high = space.low.ravel(), space.high.ravel()
                uniform = low.size > 0 and (low == low[0]).all() and (high == high[0]).all()
                bounds = self._box_bounds = (low[0], high[0]) if uniform else ()
            if not bounds:
                return False
            if actions.size <= 64:  # as for Discrete; the chained comparison is False for NaN, as numpy's is
                lowest, highest = float(bounds[0]), float(bounds[1])
                return all(lowest <= value <= highest for value in actions.ravel().tolist())
            return bool(actions.min() >= bounds[0] and actions.max() <= bounds[1])
        return False


def seeds_for(seed: int | Sequence[int | None] | None, num_envs: int) -> list[int | None]:
    """One reset seed per env, as gymnasium's vector envs take them: ``seed + i``, or a list of ``num_envs``.

    Example:
        >>> seeds_for(3, 2), seeds_for(None, 2)
        ([3, 4], [None, None])
    """
    if seed is None:
        return [None] * num_envs
    if isinstance(seed, (int, np.integer)):
        return [int(seed) + i for i in range(num_envs)]
    seeds = list(seed)
    if len(seeds) != num_envs:
        raise ValueError(
            f"If seeds are passed as a list the length must match num_envs={num_envs} but got length={len(seeds)}."
        )
    return seeds


def reset_mask(options: dict[str, Any] | None, num_envs: int) -> np.ndarray | None:
    """``options["reset_mask"]``, taken out of ``options`` and checked (a bool array, one per env, any true)."""
    if options is None or "reset_mask" not in options:
        return None
    mask = options.pop("reset_mask")
    if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.shape != (num_envs,):
        raise ValueError(f"options['reset_mask'] must be a numpy bool array of shape ({num_envs},), got {mask!r}")
    if not mask.any():
        raise ValueError("options['reset_mask'] must contain at least one True value")
    return mask
