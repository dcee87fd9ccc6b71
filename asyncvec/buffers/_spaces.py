"""Store samples of any fixed-size gymnasium space as flat numpy columns.

A space is split into leaves (Dict and Tuple are walked recursively). Each leaf becomes one
column with a leading batch dimension: Box/Discrete/MultiDiscrete/MultiBinary keep their own
shape and dtype; Text is stored as int32 indices into its character set, padded with
``len(charset)`` (gymnasium's own ``flatten``/``unflatten`` encoding). With image compression
on, an image leaf (see `is_image_space`) is stored as one ``bytes`` blob per sample (an object
column) and decoded back to uint8 on read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from gymnasium import spaces
from gymnasium.spaces.utils import flatten, unflatten
from gymnasium.vector.utils import batch_space

from asyncvec.buffers._images import ImageCompression, is_image_space

RowLabel = Callable[[int], str]

_FIXED = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def default_row_label(row: int) -> str:
    return f"batch row {row}"


@dataclass(frozen=True)
class Leaf:
    """One stored column of a space: where it sits in the nest and how it is stored."""

    path: tuple[str | int, ...]
    label: str  # for error messages, e.g. "obs['image']"
    space: spaces.Space[Any]
    shape: tuple[int, ...]  # per sample
    dtype: np.dtype
    # True when the dtype alone guarantees membership (a uint8 Box over [0, 255]), so the
    # per-batch bounds check can be skipped: it costs more than the copy for images.
    dtype_is_space: bool = False
    # Bounds that decide membership for Box, Discrete, MultiDiscrete and MultiBinary leaves:
    # a value is in the space iff low <= value <= high elementwise (None: that side is
    # unbounded). Scalars when every element shares them (one min/max reduction per batch).
    low: Any = None
    high: Any = None
    is_text: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_text", isinstance(self.space, spaces.Text))  # read on every add

    def quick_check(self, array: Any, n: int, check_values: bool = True) -> bool:
        """Whether ``array`` is a batch of ``n`` members, checked with a few whole-batch numpy
        operations; False means "not sure": run the full check, which names the bad row.

        True only for an ndarray of exactly the leaf's dtype and shape ``(n, *shape)`` whose
        values (with ``check_values``) lie within the bounds; NaN fails every comparison, so
        it never passes. Text leaves are never quick.
        """
        if (
            type(array) is not np.ndarray
            or array.dtype != self.dtype
            or self.is_text
            or array.shape != (n, *self.shape)
        ):
            return False
        if not check_values or self.dtype_is_space or n == 0:
            return True
        low, high = self.low, self.high
        if type(low) is not np.ndarray and type(high) is not np.ndarray:
            # Shared bounds: min and max decide (a NaN makes both NaN, and NaN compares False).
            return bool(array.min() >= low) and bool(array.max() <= high)
        return (low is None or bool((array >= low).all())) and (high is None or bool((array <= high).all()))


class SpaceCodec:
    """Validates, encodes and decodes batches of one space, leaf by leaf.

    Args:
        space: a Box, Discrete, MultiDiscrete, MultiBinary or Text space, or a Dict/Tuple
            nesting of them.
        field: the field name used in column names and error messages (``"obs"``).
        image_compression: compress image leaves (`is_image_space`) with this codec; None keeps
            every leaf a plain array.
    """

    def __init__(self, space: spaces.Space[Any], field: str, image_compression: ImageCompression | None = None) -> None:
        if not isinstance(space, spaces.Space):
            raise TypeError(f"{field}: expected a gymnasium.spaces.Space, got {type(space).__name__}")
        self.space = space
        self.field = field
        self.leaves: list[Leaf] = list(_walk(space, field, ()))
        # Per leaf: the codec that turns its images into blobs, or None (stored as is).
        self.compressors: list[ImageCompression | None] = [
            image_compression if image_compression is not None and is_image_space(leaf.space) else None
            for leaf in self.leaves
        ]
        self.compressed = any(codec is not None for codec in self.compressors)
        self._single = len(self.leaves) == 1 and not self.leaves[0].path
        self._batched_cache: dict[tuple[int, int], spaces.Space[Any]] = {}

    def column_names(self, prefix: str | None = None) -> list[str]:
        """Stable, file-name-safe column names, one per leaf."""
        prefix = self.field if prefix is None else prefix
        if len(self.leaves) == 1 and not self.leaves[0].path:
            return [prefix]
        return [f"{prefix}.{i}" for i in range(len(self.leaves))]

    def storage(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """Per leaf, the per-sample shape and dtype of its stored column: ``((), object)`` (one
        blob) for a compressed image leaf, else the leaf's own."""
        return [
            ((), np.dtype(object)) if codec is not None else (leaf.shape, leaf.dtype)
            for leaf, codec in zip(self.leaves, self.compressors)
        ]

    def _compress(self, columns: list[np.ndarray]) -> list[np.ndarray]:
        if not self.compressed:
            return columns
        return [column if codec is None else codec.compress(column) for codec, column in zip(self.compressors, columns)]

    # -- encoding ---------------------------------------------------------------------
    def encode(self, value: Any, n: int, row_label: RowLabel = default_row_label) -> list[np.ndarray]:
        """Validate a batch of ``n`` samples and return one array per leaf, ``(n, *shape)``.

        Raises:
            ValueError: naming the field, the expected space and, for a value outside the
                space, the offending row.
        """
        columns = [self._encode_leaf(leaf, _pick(value, leaf, self.field), n, row_label) for leaf in self.leaves]
        return self._compress(columns)

    def _encode_leaf(self, leaf: Leaf, value: Any, n: int, row_label: RowLabel) -> np.ndarray:
        if leaf.is_text:
            return self._encode_text(leaf, value, n, row_label)
        if leaf.quick_check(value, n):
            return cast(np.ndarray, value)
        array = np.asarray(value)
        expected_shape = (n, *leaf.shape)
        if array.shape != expected_shape:
            raise ValueError(
                f"{leaf.label}: expected a batch of shape {expected_shape} from {leaf.space}, got shape {array.shape}"
            )
        array = cast_lossless(array, leaf.dtype, leaf.label, leaf.space)
        if leaf.dtype_is_space:
            return array
        key = (id(leaf), n)
        batched = self._batched_cache.get(key)
        if batched is None:
            if len(self._batched_cache) > 16:
                self._batched_cache.clear()
            batched = self._batched_cache[key] = batch_space(leaf.space, n)
        if not batched.contains(array):
            for row in range(n):
                if not leaf.space.contains(array[row]):
                    raise ValueError(
                        f"{leaf.label}: {row_label(row)}: value {_show(array[row])} is not in {leaf.space}"
                    )
        return array

    def _encode_text(self, leaf: Leaf, value: Any, n: int, row_label: RowLabel) -> np.ndarray:
        if isinstance(value, str) or not isinstance(value, (Sequence, np.ndarray)):
            raise ValueError(f"{leaf.label}: expected a list of {n} str from {leaf.space}, got {type(value).__name__}")
        if len(value) != n:
            raise ValueError(f"{leaf.label}: expected a list of {n} str from {leaf.space}, got {len(value)}")
        for row, text in enumerate(value):
            if not isinstance(text, str) or not leaf.space.contains(text):
                raise ValueError(f"{leaf.label}: {row_label(row)}: value {text!r} is not in {leaf.space}")
        if n == 0:
            return np.empty((0, *leaf.shape), leaf.dtype)
        return np.stack([cast(np.ndarray, flatten(leaf.space, text)) for text in value])

    def quick_encode(self, value: Any, n: int, check_values: bool = True) -> list[np.ndarray] | None:
        """The leaves of ``value`` if every leaf passes :meth:`Leaf.quick_check`, else None.

        The fast path of :meth:`encode` for batches that are already arrays of the right
        dtype and shape (what vector envs and collectors produce); None means "use encode",
        which accepts more input (lists, lossless casts) and names what is wrong.
        """
        if self._single:
            if not self.leaves[0].quick_check(value, n, check_values):
                return None
            return self._compress([value])
        try:
            picked = [_pick(value, leaf, self.field) for leaf in self.leaves]
        except (ValueError, TypeError, KeyError, IndexError):
            return None
        if all(leaf.quick_check(array, n, check_values) for leaf, array in zip(self.leaves, picked)):
            return self._compress(picked)
        return None

    # -- decoding ---------------------------------------------------------------------
    def decode(self, columns: Sequence[np.ndarray]) -> Any:
        """Rebuild the nested structure from one array per leaf (any leading shape).

        Text leaves come back as numpy object arrays of ``str`` with the leading shape.
        """
        decoded = iter(
            [
                self._decode_leaf(leaf, column) if codec is None else codec.decompress(column, leaf.shape)
                for leaf, column, codec in zip(self.leaves, columns, self.compressors)
            ]
        )
        return _assemble(self.space, decoded)

    @staticmethod
    def _decode_leaf(leaf: Leaf, column: np.ndarray) -> np.ndarray:
        if not leaf.is_text:
            return column
        leading = column.shape[: column.ndim - 1]
        texts = np.empty(int(np.prod(leading)), dtype=object)
        for i, row in enumerate(column.reshape(-1, leaf.shape[0])):
            texts[i] = unflatten(leaf.space, row)
        return texts.reshape(leading)


def _show(value: np.ndarray | np.generic) -> str:
    """A short rendering of a rejected value (large arrays by their range only)."""
    if np.size(value) <= 16:
        return repr(np.asarray(value).tolist())
    return f"<array shape {np.shape(value)}, min {np.min(value)}, max {np.max(value)}>"


def _walk(space: spaces.Space[Any], label: str, path: tuple[str | int, ...]) -> Iterator[Leaf]:
    if isinstance(space, spaces.Dict):
        for key, subspace in space.spaces.items():
            yield from _walk(subspace, f"{label}[{key!r}]", (*path, key))
    elif isinstance(space, spaces.Tuple):
        for index, subspace in enumerate(space.spaces):
            yield from _walk(subspace, f"{label}[{index}]", (*path, index))
    elif isinstance(space, spaces.Text):
        yield Leaf(path, label, space, (space.max_length,), np.dtype(np.int32))
    elif isinstance(space, _FIXED):
        dtype = np.dtype(space.dtype)
        full_range = (
            isinstance(space, spaces.Box)
            and dtype.kind in "iu"
            and bool(np.all(space.low == np.iinfo(dtype).min) and np.all(space.high == np.iinfo(dtype).max))
        )
        low, high = _bounds(space)
        yield Leaf(path, label, space, tuple(space.shape or ()), dtype, dtype_is_space=full_range, low=low, high=high)
    else:
        raise TypeError(
            f"{label}: {space} is not supported; expected Box, Discrete, MultiDiscrete, "
            f"MultiBinary, Text, or a Dict/Tuple of them"
        )


def _bounds(space: spaces.Space[Any]) -> tuple[Any, Any]:
    """Inclusive bounds equivalent to ``space.contains`` for values of the space's dtype (see
    :meth:`Leaf.quick_check`): a scalar when every element shares it, else an array; None for
    an infinite side next to an elementwise other side."""
    if isinstance(space, spaces.Discrete):
        return int(space.start), int(space.start + space.n - 1)
    if isinstance(space, spaces.MultiBinary):
        return 0, 1
    low: Any
    high: Any
    if isinstance(space, spaces.MultiDiscrete):
        low, high = np.asarray(space.start), np.asarray(space.start + space.nvec - 1)
    else:
        box = cast(spaces.Box, space)
        low, high = np.asarray(box.low), np.asarray(box.high)
    shape = space.shape or ()
    bounds: tuple[Any, Any] = _shared(np.broadcast_to(low, shape)), _shared(np.broadcast_to(high, shape))
    low, high = bounds
    # An infinite shared bound next to an elementwise other side checks nothing: drop it
    # (NaN still fails the other side's comparison).
    if type(high) is np.ndarray and type(low) is not np.ndarray and low == -np.inf:
        low = None
    if type(low) is np.ndarray and type(high) is not np.ndarray and high == np.inf:
        high = None
    return low, high


def _shared(bound: np.ndarray) -> Any:
    """One Python scalar when every element of ``bound`` is the same, else the array."""
    if bound.size and np.all(bound == bound.flat[0]):
        return bound.flat[0].item()
    return np.ascontiguousarray(bound)


def _pick(value: Any, leaf: Leaf, field: str) -> Any:
    """Follow ``leaf.path`` into a nested batch, with errors that name the missing part."""
    label = field
    for key in leaf.path:
        if isinstance(key, str):
            if not isinstance(value, Mapping):
                raise ValueError(f"{label}: expected a dict of batched arrays, got {type(value).__name__}")
            if key not in value:
                raise ValueError(f"{label}: missing key {key!r}")
        elif not isinstance(value, (tuple, list)) or key >= len(value):
            raise ValueError(f"{label}: expected a tuple with an item {key}, got {type(value).__name__}")
        value = value[key]
        label = f"{label}[{key!r}]" if isinstance(key, str) else f"{label}[{key}]"
    return value


def cast_lossless(array: np.ndarray, target: np.dtype, label: str, expected: object) -> np.ndarray:
    """Cast ``array`` to ``target`` when no value changes; otherwise raise naming ``label``.

    Integers and bools may become floats; integers narrow only when every value fits
    (``int64`` 300 never silently wraps to ``uint8`` 44); floats never become integers.
    ``expected`` (a space or a description) is only formatted into an error message.
    """
    source = array.dtype
    if source == target:
        return array
    if target.kind == "f" and source.kind in "biuf":
        return array.astype(target)
    if target.kind in "biu" and source.kind in "biu":
        cast = array.astype(target)
        if np.array_equal(cast, array):
            return cast
        raise ValueError(f"{label}: values do not fit dtype {target} of {expected}")
    raise ValueError(f"{label}: expected dtype {target} ({expected}), got {source}")


def as_column(
    field: str,
    value: Any,
    n: int,
    dtype: np.dtype | type,
    *,
    allow_scalar: bool = True,
    minimum: float | None = None,
    finite: bool = False,
) -> np.ndarray:
    """Validate a per-sample scalar field as an ``(n,)`` array of ``dtype``.

    A scalar is broadcast to all ``n`` rows when ``allow_scalar``.
    """
    dtype = np.dtype(dtype)
    array = np.asarray(value)
    if array.ndim == 0 and allow_scalar:
        array = np.full(n, array)
    if array.dtype == object or array.shape != (n,):
        raise ValueError(f"{field}: expected {dtype} values, shape ({n},), got {array.dtype} shape {array.shape}")
    if array.dtype != dtype:
        array = cast_lossless(array, dtype, field, "one value per sample")
    if finite and not np.all(np.isfinite(array)):
        row = int(np.flatnonzero(~np.isfinite(array))[0])
        raise ValueError(f"{field}: row {row}: expected a finite number, got {array[row]}")
    if minimum is not None and array.size and array.min() < minimum:
        row = int(np.argmin(array))
        raise ValueError(f"{field}: row {row}: expected a value >= {minimum}, got {array[row]}")
    return array


def _assemble(space: spaces.Space[Any], leaves: Iterator[Any]) -> Any:
    if isinstance(space, spaces.Dict):
        return {key: _assemble(subspace, leaves) for key, subspace in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(_assemble(subspace, leaves) for subspace in space.spaces)
    return next(leaves)
