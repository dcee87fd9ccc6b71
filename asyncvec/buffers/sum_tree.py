"""``SumTree``: proportional sampling and priority updates in O(log n), vectorized over a batch.

A complete binary tree over ``capacity`` leaves, stored as one flat array (node ``i`` has
children ``2i`` and ``2i + 1``, the root is node 1, leaves start at ``size``, the next power
of two). Every internal node holds the sum of its children, and a second array holds their
minimum, so the total and the smallest positive priority are read at the root in O(1).

* ``update(indices, values)`` sets leaves and recomputes their ancestors, one tree level at
  a time for the whole batch: O(k log n) for k leaves. Sums are recomputed from the children
  (never adjusted by deltas), so rounding errors do not accumulate over many updates.
* ``set_range(start, values)`` sets consecutive leaves (what a ring buffer's add writes) and
  defers their ancestors: consecutive ranges merge, and the next read recomputes the merged
  range's ancestors with one slice operation per level, so many small adds between two
  samples cost one O(log n) pass instead of one each.
* ``find(prefix)`` walks from the root to the leaf whose cumulative range contains each
  prefix value, one level at a time for the whole batch: O(k log n). With exact arithmetic
  it returns ``searchsorted(cumsum(leaves), prefix, side="right")``: the leaf ``i`` with
  ``sum(leaves[:i]) <= prefix < sum(leaves[:i + 1])``.
* ``sample(k, rng)`` draws k leaves independently with probability ``leaf / total``.

Example:
    >>> import numpy as np
    >>> tree = SumTree(5)
    >>> tree.update([0, 1, 3], [1.0, 2.0, 5.0])
    >>> tree.total, tree.min, tree.find([0.5, 1.0, 2.9, 3.0, 7.9]).tolist()
    (8.0, 1.0, [0, 1, 1, 3, 3])
    >>> counts = np.bincount(tree.sample(8000, np.random.default_rng(0)), minlength=5)
    >>> np.round(counts / 8000, 1).tolist()
    [0.1, 0.2, 0.0, 0.6, 0.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["SumTree"]


class SumTree:
    """Sums and minima of non-negative leaf values in a binary tree (see the module docstring).

    Args:
        capacity: number of leaves; all start at 0 (never sampled).

    A leaf of value 0 is empty: it is never sampled and does not count for :attr:`min`.
    """

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
        self.capacity = int(capacity)
        self.size = 1 << max(0, (self.capacity - 1).bit_length())  # leaves, a power of two
        self.depth = self.size.bit_length() - 1  # levels below the root
        self._sum = np.zeros(2 * self.size, dtype=np.float64)
        self._min = np.full(2 * self.size, np.inf, dtype=np.float64)
        self._dirty: tuple[int, int] | None = None  # leaves [lo, hi) whose ancestors are stale

    @property
    def total(self) -> float:
        """Sum of all leaves."""
        self._flush()
        return float(self._sum[1])

    @property
    def min(self) -> float:
        """Smallest positive leaf (``inf`` when every leaf is 0)."""
        self._flush()
        return float(self._min[1])

    def values(self, indices: Any = None) -> np.ndarray:
        """The leaf values at ``indices`` (all ``capacity`` leaves when None), a copy."""
        leaves = self._sum[self.size : self.size + self.capacity]
        return leaves.copy() if indices is None else leaves[np.asarray(indices, dtype=np.int64)]

    def update(self, indices: Any, values: Any) -> None:
        """Set ``leaves[indices] = values`` (the last value wins for a repeated index).

        Raises:
            ValueError: shapes differ, an index is out of range, or a value is negative or
                not finite.
        """
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        values = np.broadcast_to(np.asarray(values, dtype=np.float64), indices.shape)
        if indices.size == 0:
            return
        if indices.min() < 0 or indices.max() >= self.capacity:
            row = int(np.flatnonzero((indices < 0) | (indices >= self.capacity))[0])
            raise ValueError(f"indices: row {row}: leaf {indices[row]} is outside 0..{self.capacity - 1}")
        if not (np.isfinite(values).all() and values.min() >= 0):
            row = int(np.flatnonzero(~np.isfinite(values) | (values < 0))[0])
            raise ValueError(f"values: row {row}: expected a finite number >= 0, got {values[row]}")
        if indices.size > 1:  # keep the last value of a repeated index
            indices, last = np.unique(indices[::-1], return_index=True)
            values = values[::-1][last]
        self._flush()
        nodes = indices + self.size
        self._sum[nodes] = values
        self._min[nodes] = np.where(values > 0, values, np.inf)
        self._propagate(nodes)

    def set_range(self, start: int, stop: int, values: float | np.ndarray) -> None:
        """Set the consecutive leaves ``start .. stop - 1`` (no wrap-around) to ``values``, one
        number or an array of ``stop - start``; their ancestors are updated at the next read
        (see the module docstring). Values are not checked: they must be finite and >= 0."""
        if not 0 <= start <= stop <= self.capacity:
            raise ValueError(f"set_range: leaves {start}..{stop - 1} are outside 0..{self.capacity - 1}")
        if self._dirty is not None and (stop < self._dirty[0] or start > self._dirty[1]):
            self._flush()  # not adjacent to the pending range: settle that one first
        leaves = slice(self.size + start, self.size + stop)
        self._sum[leaves] = values
        if type(values) is np.ndarray:
            self._min[leaves] = np.where(values > 0, values, np.inf)
        else:
            self._min[leaves] = values if values > 0 else np.inf
        self._dirty = (start, stop) if self._dirty is None else (min(start, self._dirty[0]), max(stop, self._dirty[1]))

    def _flush(self) -> None:
        """Recompute the ancestors of the pending range, one slice per level."""
        if self._dirty is None:
            return
        lo, hi = self._dirty[0] + self.size, self._dirty[1] + self.size  # nodes [lo, hi)
        self._dirty = None
        while lo > 1:
            lo, hi = lo // 2, (hi - 1) // 2 + 1  # the parents of [lo, hi)
            left, right = slice(2 * lo, 2 * hi, 2), slice(2 * lo + 1, 2 * hi + 1, 2)
            self._sum[lo:hi] = self._sum[left] + self._sum[right]
            self._min[lo:hi] = np.minimum(self._min[left], self._min[right])

    def _propagate(self, nodes: np.ndarray) -> None:
        level = self.size  # first node of the children's level (levels hold [level, 2 level))
        while level > 1:
            level //= 2
            if level <= nodes.size:  # a level no larger than the batch: slices beat gathers
                self._recompute_from(level)
                return
            nodes = nodes >> 1  # siblings share a parent: it is written twice, with the same value
            left, right = 2 * nodes, 2 * nodes + 1
            self._sum[nodes] = self._sum[left] + self._sum[right]
            self._min[nodes] = np.minimum(self._min[left], self._min[right])

    def _recompute_from(self, level: int) -> None:
        """Recompute every node of the level starting at node ``level`` and all levels above."""
        while level >= 1:
            left, right = slice(2 * level, 4 * level, 2), slice(2 * level + 1, 4 * level, 2)
            self._sum[level : 2 * level] = self._sum[left] + self._sum[right]
            self._min[level : 2 * level] = np.minimum(self._min[left], self._min[right])
            level //= 2

    def rebuild(self, values: Any) -> None:
        """Replace all ``capacity`` leaves at once, in O(n) (e.g. after loading from disk)."""
        values = np.asarray(values, dtype=np.float64)
        if values.shape != (self.capacity,):
            raise ValueError(f"values: expected shape ({self.capacity},), got {values.shape}")
        if not (np.isfinite(values).all() and (values.size == 0 or values.min() >= 0)):
            raise ValueError("values: expected finite numbers >= 0")
        self._dirty = None
        self._sum[:] = 0.0
        self._min[:] = np.inf
        self._sum[self.size : self.size + self.capacity] = values
        self._min[self.size : self.size + self.capacity] = np.where(values > 0, values, np.inf)
        self._recompute_from(self.size // 2)

    def find(self, prefix: Any) -> np.ndarray:
        """For each prefix value ``v`` in ``[0, total)``, the leaf whose cumulative range holds it."""
        self._flush()
        remaining = np.array(prefix, dtype=np.float64, copy=True).reshape(-1)
        nodes = np.ones(remaining.shape, dtype=np.int64)
        for _ in range(self.depth):
            left = 2 * nodes
            left_sum = self._sum[left]
            go_right = remaining >= left_sum
            remaining -= np.where(go_right, left_sum, 0.0)
            nodes = left + go_right
        return nodes - self.size

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` leaves drawn independently with probability ``leaf / total``.

        Raises:
            ValueError: every leaf is 0.
        """
        total = self.total
        if not total > 0:
            raise ValueError("sample: every leaf is 0, nothing to sample")
        leaves = self.find(rng.random(count) * total)
        # Rounding can, very rarely, walk into a zero leaf next to the end of a range: redraw those.
        for _ in range(100):
            empty = self._sum[leaves + self.size] <= 0
            if not empty.any():
                return leaves
            leaves[empty] = self.find(rng.random(int(empty.sum())) * total)
        # Bare RuntimeError: corrupt sums are a bug (here, or set_range given values it does not check).
        raise RuntimeError("sample: could not draw a leaf with a positive value (the tree sums look corrupt)")

    def __len__(self) -> int:
        return self.capacity

    def __repr__(self) -> str:
        return f"SumTree(capacity={self.capacity}, total={self.total:g})"
