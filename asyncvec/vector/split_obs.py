"""Which part of an observation travels through shared memory, and which over the pipe.

Fixed-shape observations (Box, Discrete, MultiDiscrete, MultiBinary, and Dict/Tuple of them)
travel through shared memory as a whole. A ``Dict`` observation that mixes fixed-shape entries
with variable-size ones (``Text``, ``Sequence``, ``Graph``), such as a camera image plus an
instruction, is split: its fixed-shape entries (the image) are written to shared memory by the
worker, and only the rest (the short instruction string) is pickled with the step's answer.
The parent merges both back into one observation when it files the answer.

Every fixed-shape entry is checked on its way (`write_row`, `check_row`): an image of the wrong
shape or dtype is an error naming the field, the env and what was expected, never broadcast or
cast. With shared memory the worker checks while it writes; without (``shared_memory=False``,
Ray workers) the parent checks each answer against `row_templates` of the space.

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
    >>> check_row(row_templates(space), 3, {"image": np.zeros((8, 8)), "instruction": "lift"})
    Traceback (most recent call last):
    ...
    ValueError: observation['image'] of env 3 has shape (8, 8), expected (8, 8, 3)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from gymnasium import Space, spaces
from gymnasium.vector.utils import create_empty_array

__all__ = [
    "check_row",
    "copy_row",
    "is_fixed_shape",
    "merge_row",
    "pipe_part",
    "row_templates",
    "shared_subspace",
    "write_row",
]

_FIXED_SHAPE_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def is_fixed_shape(space: Space[Any]) -> bool:
    """Whether every observation of ``space`` has the same dtype and shape (fits shared memory)."""
    if isinstance(space, spaces.Dict):
        return all(is_fixed_shape(s) for s in space.spaces.values())
    if isinstance(space, spaces.Tuple):
        return all(is_fixed_shape(s) for s in space.spaces)
    return isinstance(space, _FIXED_SHAPE_SPACES)


def shared_subspace(space: Space[Any]) -> Space[Any] | None:
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
    merged = {key: copy_row(value, index) for key, value in rows.items()}
    merged.update(rest)
    return merged


def copy_row(rows: Any, index: int) -> Any:
    """Row ``index`` of shared views (nested dicts/tuples of arrays), as a copy (a numpy scalar for 1-D views)."""
    if isinstance(rows, dict):
        return {key: copy_row(value, index) for key, value in rows.items()}
    if isinstance(rows, tuple):
        return tuple(copy_row(value, index) for value in rows)
    return rows[index].copy()


def row_templates(space: Space[Any]) -> Any:
    """Arrays of zero rows with the row shape and dtype of each fixed-shape entry of ``space``
    (what `check_row` compares an observation with when there are no shared views), or None."""
    shared = shared_subspace(space)
    return None if shared is None else create_empty_array(shared, n=0, fn=np.empty)


def check_row(rows: Any, index: int, value: Any, field: str = "observation") -> None:
    """Raise ValueError unless ``value`` fits one row of ``rows`` (shared views or `row_templates`):
    the same keys, each array of the row's shape and of a dtype that casts to the row's within
    its kind (no float image for uint8 rows). The message names the field, env ``index`` and
    what was expected."""
    _visit_row(rows, index, value, field, write=False)


def write_row(rows: Any, index: int, value: Any, field: str = "observation") -> None:
    """Write one env's observation into row ``index`` of the shared views after `check_row`'s checks.

    Unlike numpy assignment it never broadcasts nor casts across kinds.
    """
    if (
        type(rows) is np.ndarray
        and type(value) is np.ndarray
        and value.dtype == rows.dtype
        and (value.shape == rows.shape[1:])
    ):
        rows[index] = value  # the common case (one array of the row's dtype and shape), without the walk
        return
    _visit_row(rows, index, value, field, write=True)


def _visit_row(rows: Any, index: int, value: Any, field: str, write: bool) -> None:
    if isinstance(rows, dict):
        for key, sub_rows in rows.items():
            if not hasattr(value, "keys") or key not in value:
                raise ValueError(f"{field} of env {index} has no key {key!r} (expected keys {sorted(rows)})")
            _visit_row(sub_rows, index, value[key], f"{field}[{key!r}]", write)
        return
    if isinstance(rows, tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(rows):
            raise ValueError(
                f"{field} of env {index} is not a tuple of {len(rows)} entries: got {type(value).__name__}"
            )
        for position, (sub_rows, sub_value) in enumerate(zip(rows, value)):
            _visit_row(sub_rows, index, sub_value, f"{field}[{position}]", write)
        return
    value = np.asarray(value)
    if value.shape != rows.shape[1:]:
        raise ValueError(f"{field} of env {index} has shape {value.shape}, expected {rows.shape[1:]}")
    if not np.can_cast(value.dtype, rows.dtype, casting="same_kind"):
        raise ValueError(f"{field} of env {index} has dtype {value.dtype}, expected {rows.dtype}")
    if write:
        rows[index] = value
