"""`ActionTokenizer`: continuous actions <-> discrete action tokens (RT-2 / OpenVLA style).

Each dimension ``d`` of a bounded Box action is cut into ``num_bins`` equal bins over
``[low[d], high[d]]``. A value maps to the bin that holds it (values outside the bounds are
clipped first); a bin decodes to its centre, so a round trip is exact up to half a bin width,
``(high - low) / (2 * num_bins)``. Bin ``b`` is the token id ``first_token_id + b``: a
vision-language-action model reads and writes actions as ``num_bins`` extra tokens at the end
of its vocabulary. A chunk of ``H`` actions of ``D`` dimensions is ``H * D`` tokens, action by
action, dimension by dimension.

Pure numpy: no torch, no tokenizer library.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ActionTokenizer"]


class ActionTokenizer:
    """Uniform binning of a bounded continuous action space into action tokens.

    Args:
        low, high: per-dimension finite bounds, shape ``(D,)`` (or scalars with ``dim``), or a
            ``gymnasium.spaces.Box`` as ``low`` (then ``high`` is not given).
        num_bins: bins per dimension (256, as RT-2 and OpenVLA).
        first_token_id: the token id of bin 0; bin ``b`` is token ``first_token_id + b``.
        dim: number of dimensions when ``low``/``high`` are scalars.

    Example:
        >>> tok = ActionTokenizer([-1.0, 0.0], [1.0, 2.0], num_bins=256, first_token_id=100)
        >>> ids = tok.encode([[0.0, 2.0], [-1.0, 5.0]])   # two actions (a chunk of 2), 5.0 is clipped
        >>> ids.tolist()
        [[228, 355], [100, 355]]
        >>> tok.decode(ids).round(3).tolist()
        [[0.004, 1.996], [-0.996, 1.996]]
        >>> tok.bin_width.tolist(), tok.token_range
        ([0.0078125, 0.0078125], (100, 356))
    """

    def __init__(
        self,
        low: Any,
        high: Any = None,
        *,
        num_bins: int = 256,
        first_token_id: int = 0,
        dim: int | None = None,
    ) -> None:
        if high is None and hasattr(low, "low") and hasattr(low, "high"):  # a Box space
            space = low
            if len(space.shape) != 1:
                raise ValueError(f"ActionTokenizer: expected a 1-D Box action space, got shape {space.shape}")
            low, high = space.low, space.high
        if high is None:
            raise TypeError("ActionTokenizer: pass low and high (or a gymnasium Box as the only argument)")
        if isinstance(num_bins, bool) or not isinstance(num_bins, (int, np.integer)) or num_bins < 2:
            raise ValueError(f"ActionTokenizer: num_bins must be an int >= 2, got {num_bins!r}")
        if isinstance(first_token_id, bool) or not isinstance(first_token_id, (int, np.integer)) or first_token_id < 0:
            raise ValueError(f"ActionTokenizer: first_token_id must be an int >= 0, got {first_token_id!r}")
        low_array = np.asarray(low, dtype=np.float64)
        high_array = np.asarray(high, dtype=np.float64)
        if dim is not None:
            low_array = np.broadcast_to(low_array, (dim,))
            high_array = np.broadcast_to(high_array, (dim,))
        if low_array.ndim != 1 or low_array.shape != high_array.shape or low_array.size == 0:
            raise ValueError(
                f"ActionTokenizer: low and high must be 1-D of the same length (or scalars with dim=...), "
                f"got shapes {low_array.shape} and {high_array.shape}"
            )
        if not (np.all(np.isfinite(low_array)) and np.all(np.isfinite(high_array))):
            raise ValueError("ActionTokenizer: every bound must be finite (an unbounded dimension cannot be binned)")
        if np.any(high_array <= low_array):
            bad = int(np.flatnonzero(high_array <= low_array)[0])
            raise ValueError(
                f"ActionTokenizer: dimension {bad}: high {high_array[bad]} must be greater than low {low_array[bad]}"
            )
        self.low = low_array.copy()
        self.high = high_array.copy()
        self.num_bins = int(num_bins)
        self.first_token_id = int(first_token_id)
        self.dim = int(low_array.size)
        self.bin_width = (self.high - self.low) / self.num_bins
        self.centers = self.low[:, None] + (np.arange(self.num_bins) + 0.5)[None, :] * self.bin_width[:, None]

    @property
    def token_range(self) -> tuple[int, int]:
        """``(first, stop)``: action tokens are ``first <= id < stop``."""
        return self.first_token_id, self.first_token_id + self.num_bins

    def _check_actions(self, actions: Any) -> np.ndarray:
        array = np.asarray(actions)
        if array.dtype.kind not in "biuf":
            raise ValueError(f"ActionTokenizer.encode: expected numeric actions, got dtype {array.dtype}")
        if array.ndim == 0 or array.shape[-1] != self.dim:
            raise ValueError(
                f"ActionTokenizer.encode: expected actions of shape (..., {self.dim}) (last axis = action "
                f"dimensions), got shape {array.shape}"
            )
        array = array.astype(np.float64)
        if np.any(np.isnan(array)):
            index = tuple(int(i) for i in np.argwhere(np.isnan(array))[0])
            raise ValueError(f"ActionTokenizer.encode: action{list(index)} is NaN")
        return array

    def bins(self, actions: Any) -> np.ndarray:
        """Bin index of every action value, ``(..., D)`` int64 in ``[0, num_bins)``; values
        outside the bounds are clipped into the first or last bin."""
        array = self._check_actions(actions)
        index = np.floor((array - self.low) / self.bin_width)
        return np.clip(index, 0, self.num_bins - 1).astype(np.int64)

    def encode(self, actions: Any) -> np.ndarray:
        """Token ids of actions ``(..., D)``: the same shape, int64."""
        return self.bins(actions) + self.first_token_id

    def is_action_token(self, token_ids: Any) -> np.ndarray:
        """Whether each id is an action token (a bool array of the same shape)."""
        ids = np.asarray(token_ids)
        first, stop = self.token_range
        return (ids >= first) & (ids < stop)

    def decode(self, token_ids: Any) -> np.ndarray:
        """Continuous actions (bin centres) of token ids ``(..., D)`` or a flat ``(H * D,)``
        sequence (returned as ``(H, D)``).

        Raises:
            ValueError: the ids are not integers, their count is not a multiple of ``D``, or an
                id is not an action token (the message names its position and value).
        """
        ids = np.asarray(token_ids)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"ActionTokenizer.decode: expected integer token ids, got dtype {ids.dtype}")
        if ids.ndim == 0:
            raise ValueError("ActionTokenizer.decode: expected a sequence of token ids, got a scalar")
        if ids.shape[-1] != self.dim:
            if ids.ndim == 1 and ids.size % self.dim == 0 and ids.size:
                ids = ids.reshape(-1, self.dim)
            else:
                raise ValueError(
                    f"ActionTokenizer.decode: expected token ids of shape (..., {self.dim}) or a flat sequence "
                    f"of a multiple of {self.dim}, got shape {ids.shape}"
                )
        valid = self.is_action_token(ids)
        if not np.all(valid):
            where = tuple(int(i) for i in np.argwhere(~valid)[0])
            first, stop = self.token_range
            raise ValueError(
                f"ActionTokenizer.decode: token {int(ids[where])} at position {list(where)} is not an action "
                f"token (action tokens are {first} <= id < {stop})"
            )
        bins = ids.astype(np.int64) - self.first_token_id
        return self.centers[np.arange(self.dim), bins]

    def __repr__(self) -> str:
        return f"ActionTokenizer(dim={self.dim}, num_bins={self.num_bins}, token_range={self.token_range})"
