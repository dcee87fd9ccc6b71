"""Which part of an observation travels through shared memory, and which over the pipe.

Fixed-shape observations (Box, Discrete, MultiDiscrete, MultiBinary, and Dict/Tuple of them)
travel through shared memory as a whole. A ``Dict`` observation that mixes fixed-shape entries
with variable-size ones (``Text``, ``Sequence``, ``Graph``), such as a camera image plus an
instruction, is split: its fixed-shape entries (the image) are written to shared memory by the
worker, and only the rest (the short instruction string) is pickled with the step's answer.
The parent merges both back into one observation when it files the answer.

Why not the Text in shared memory too? Gymnasium can store a ``Text`` there (``max_length``
int32 character indices per env), but its reader decodes a fresh tuple of strings at each read
instead of giving a live view, and the buffer costs ``4 * max_length`` bytes per env for an
instruction of a few dozen characters; pickling that short string with the step's answer
(about 100 bytes in all) is simpler and as cheap.

Example:
    >>> import numpy as np
    >>> from gymnasium import spaces
    >>> space = spaces.Dict({"image": spaces.Box(0, 255, (8, 8, 3), np.uint8), "instruction": spaces.Text(32)})
    >>> list(shared_subspace(space).keys())
    ['image']
    >>> pipe_part({"image": None}, {"image": np.zeros((8, 8, 3)), "instruction": "lift"})
    {'instruction': 'lift'}
    >>> shared_subspace(spaces.Text(32)) is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gymnasium import Space, spaces

__all__ = ["is_fixed_shape", "merge_row", "pipe_part", "shared_subspace"]

_FIXED_SHAPE_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def is_fixed_shape(space: Space) -> bool:
    """Whether every observation of ``space`` has the same dtype and shape (fits shared memory)."""
    if isinstance(space, spaces.Dict):
        return all(is_fixed_shape(s) for s in space.spaces.values())
    if isinstance(space, spaces.Tuple):
        return all(is_fixed_shape(s) for s in space.spaces)
    return isinstance(space, _FIXED_SHAPE_SPACES)


def shared_subspace(space: Space) -> Space | None:
    """The part of ``space`` that travels through shared memory, or ``None`` if none does.

    The whole space when it is fixed-shape; for a top-level ``Dict``, the ``Dict`` of its
    fixed-shape entries when there is at least one; otherwise ``None`` (all over the pipe).
    """
    if is_fixed_shape(space):
        return space
    if isinstance(space, spaces.Dict):
        fixed = {key: sub for key, sub in space.spaces.items() if is_fixed_shape(sub)}
        if fixed:
            return spaces.Dict(fixed)
    return None


def pipe_part(rows: Any, observation: Any) -> Any:
    """What of ``observation`` still crosses the pipe once ``rows`` (the shared views) hold the rest.

    ``None`` when everything is in shared memory; the dict of the other entries when ``rows``
    holds only some keys of a dict observation.
    """
    if isinstance(rows, dict) and isinstance(observation, Mapping) and len(observation) > len(rows):
        return {key: value for key, value in observation.items() if key not in rows}
    return None


def merge_row(rows: Any, index: int, rest: Mapping[str, Any]) -> dict[str, Any]:
    """One env's whole observation: row ``index`` of the shared views (copied) plus ``rest`` from the pipe."""
    merged = {key: _copy_row(value, index) for key, value in rows.items()}
    merged.update(rest)
    return merged


def _copy_row(rows: Any, index: int) -> Any:
    if isinstance(rows, dict):
        return {key: _copy_row(value, index) for key, value in rows.items()}
    if isinstance(rows, tuple):
        return tuple(_copy_row(value, index) for value in rows)
    return rows[index].copy()
