"""A version-aware ring replay buffer, in RAM or crash-safe on disk."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gymnasium import spaces

from asyncvec.buffers._disk import column_nbytes
from asyncvec.buffers._images import ImageCompression, resolve_image_compression
from asyncvec.buffers._rows import ReplayRows, read_meta
from asyncvec.buffers._spaces import as_column
from asyncvec.buffers.errors import BufferClosedError, NotPrioritizedError
from asyncvec.buffers.sum_tree import SumTree
from asyncvec.buffers.transitions import NUMBERS, Transitions, TransitionWriter

__all__ = ["ReplayBatch", "ReplayBuffer"]


@dataclass(kw_only=True)
class ReplayBatch(Transitions):
    """A sampled batch: the `Transitions` fields (``values`` is all NaN: a `ReplayBuffer` does
    not keep critic values) plus what sampling adds; every array has the batch as its leading
    dimension.

    ``obs``/``next_obs``/``action`` follow their space: an array, or a dict/tuple of arrays
    for Dict/Tuple spaces; Text comes back as an object array of ``str``.
    ``staleness = current_version - policy_version``. ``indices`` are buffer slots for
    :meth:`ReplayBuffer.update_priorities`. ``weights`` are the prioritized-replay
    importance weights (all ones for uniform sampling).
    """

    staleness: np.ndarray
    indices: np.ndarray
    weights: np.ndarray


class ReplayBuffer(TransitionWriter[np.ndarray]):
    """Preallocated ring buffer of transitions, each stamped with its policy version.

    Storage is one numpy column per field (per leaf for Dict/Tuple spaces), in RAM or, with
    ``storage_dir``, in ``.npy`` memmaps that survive a killed process.

    Commit semantics (``storage_dir`` mode): ``add`` writes the rows into the memmaps, then,
    every ``commit_every`` adds (or on ``commit()``/``close()``), writes a commit record
    (the range of stored sample serials) into ``commit.bin``. Records alternate between
    two checksummed slots, so a record torn by a crash is ignored and the previous one
    holds. Memmapped pages live in the kernel page cache, so a process killed with SIGKILL
    loses nothing written before its last commit: reopening the directory finds every
    committed sample, intact, with its version. Before an add reuses slots of the ring
    that the last commit covers, a record that no longer covers them is written first,
    so a crash mid-write never exposes a half-written sample; a crash inside such an add
    also loses the oldest samples it was evicting (at most its batch size).
    ``fsync=True`` additionally msyncs the columns before and the record after every
    commit, which also survives power loss or an OS crash, at a large cost per commit.

    Thread safety: one lock guards ``add``, ``sample`` and ``update_priorities``; one writer
    and any number of reader threads may share a buffer. A ``storage_dir`` is locked
    (``flock``) to one open buffer at a time.

    Args:
        capacity: number of transitions kept; the oldest are overwritten.
        observation_space: space of ``obs`` and ``next_obs``: Box, Discrete, MultiDiscrete,
            MultiBinary, Text, or a Dict/Tuple of them.
        action_space: space of ``action`` (same choices).
        prioritized: proportional prioritized replay (Schaul et al. 2016).
        alpha: priority exponent, ``P(i) = p_i^alpha / sum_k p_k^alpha``.
        beta: importance-weight exponent, ``w_i = (N P(i))^-beta / max_j w_j``; may be
            changed between samples (annealing).
        storage_dir: directory for the memmapped, crash-safe mode; reopened if it already
            holds a buffer with the same layout.
        commit_every: commit after this many ``add`` calls (``storage_dir`` mode); 0 commits
            only on ``commit()``/``close()``.
        fsync: make every commit durable against power loss (slow).
        validate: how much of each added batch is checked. ``"first"`` (default): every
            batch must have the right types, dtypes and shapes; the values themselves
            (within the spaces, finite rewards, versions >= 0) are checked in full on the
            first ``add`` and on any batch that needs a conversion (lists, other dtypes),
            and trusted afterwards, as gymnasium's env checker does with an env's first
            steps. ``"always"``: the values of every batch are checked too (a few
            whole-batch numpy reductions per add: several times slower for small batches).
        seed: seed of the buffer's own random generator.
        image_compression: store image leaves of the observation space (uint8 Box
            ``(H, W)``/``(H, W, C)``, see ``is_image_space``) compressed, one blob per sample:
            ``True`` or ``"zlib"`` (lossless), ``"quantize"`` or ``"jpeg"`` (lossy), or an
            `ImageCompression`. None (default): stored as plain arrays. Compressed images
            cost CPU on every ``add`` and ``sample``; see docs/buffers.md for the numbers.

    Example:
        >>> import numpy as np
        >>> from gymnasium import spaces
        >>> buffer = ReplayBuffer(100, spaces.Box(-1, 1, (3,)), spaces.Discrete(2), seed=0)
        >>> obs = np.zeros((4, 3), np.float32)
        >>> slots = buffer.add(obs, np.array([0, 1, 1, 0]), np.ones(4), obs,
        ...                    np.zeros(4, bool), np.zeros(4, bool), policy_version=[5, 5, 6, 7])
        >>> batch = buffer.sample(2, current_version=7, max_staleness=1)
        >>> sorted(batch.staleness.tolist()), len(buffer), buffer.version_range()
        ([0, 1], 4, (5, 7))
    """

    def __init__(
        self,
        capacity: int,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        *,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        storage_dir: str | os.PathLike[str] | None = None,
        commit_every: int = 1,
        fsync: bool = False,
        validate: Literal["first", "always"] = "first",
        seed: int | None = None,
        image_compression: bool | str | ImageCompression | None = None,
    ) -> None:
        if validate not in ("first", "always"):
            raise ValueError(f"validate: expected 'first' or 'always', got {validate!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
        if not alpha >= 0:
            raise ValueError(f"alpha: expected a number >= 0, got {alpha!r}")
        if not beta >= 0:
            raise ValueError(f"beta: expected a number >= 0, got {beta!r}")
        if isinstance(commit_every, bool) or not isinstance(commit_every, int) or commit_every < 0:
            raise ValueError(f"commit_every: expected an int >= 0, got {commit_every!r}")
        self.capacity = int(capacity)
        self.observation_space = observation_space
        self.action_space = action_space
        self.prioritized = bool(prioritized)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.commit_every = commit_every
        self.fsync = bool(fsync)
        self.image_compression = resolve_image_compression(image_compression)
        self.storage_dir = None if storage_dir is None else Path(storage_dir)
        self._tree = SumTree(self.capacity) if self.prioritized else None
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._closed = False
        self._rows = ReplayRows(
            self.capacity,
            observation_space,
            action_space,
            prioritized=self.prioritized,
            alpha=self.alpha,
            storage_dir=self.storage_dir,
            commit_every=commit_every,
            fsync=self.fsync,
            validate=validate,
            image_compression=self.image_compression,
        )
        self._columns = self._rows.columns  # read by sampling; the same arrays the rows write
        self._on_disk = self.storage_dir is not None  # (in RAM an add has nothing to commit)
        # The numbers of `Transitions` a sample reads from its columns, and those it fills in.
        self._kept_numbers = [number.name for number in NUMBERS if number.name in self._columns]
        self._numbers_not_kept = [number for number in NUMBERS if number.name not in self._columns]
        # add()'s three steps, bound once (an attribute lookup less per add on the hot path)
        self._quick_rows, self._checked_rows, self._write = (
            self._rows.quick_rows,
            self._rows.checked_rows,
            self._rows.write,
        )
        self._rebuild_tree()

    def _rebuild_tree(self) -> None:
        """After the rows adopted a commit record: the sum-tree from the priority column."""
        if self._tree is not None and self._rows.restored:
            columns = self._columns
            self._tree.rebuild(np.where(columns["fallback"], 0.0, columns["priority"]))

    # -- persistence ----------------------------------------------------------------------
    def commit(self) -> None:
        """Make every added sample durable (``storage_dir`` mode; a no-op in RAM)."""
        with self._lock:
            self._check_open()
            self._rows.commit()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the buffer to the directory ``path`` in the ``storage_dir`` format.

        Reload it in RAM with :meth:`load`, or keep using it on disk with :meth:`open`.
        Saving to the buffer's own ``storage_dir`` is a ``commit()``.
        """
        with self._lock:
            self._check_open()
            self._rows.save(Path(path))

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, seed: int | None = None) -> ReplayBuffer:
        """Read a buffer saved with :meth:`save` (or a ``storage_dir``) into RAM.

        The spaces are unpickled from ``spaces.pkl``: load only directories you trust.
        """
        path = Path(path)
        meta, (observation_space, action_space) = read_meta(path)
        buffer = cls(
            meta["capacity"],
            observation_space,
            action_space,
            prioritized=meta["prioritized"],
            alpha=meta["alpha"] if meta["alpha"] is not None else 0.6,
            seed=seed,
            image_compression=meta.get("image_compression"),
        )
        buffer._rows.load(path)
        buffer._rebuild_tree()
        return buffer

    @classmethod
    def open(cls, path: str | os.PathLike[str], **kwargs: Any) -> ReplayBuffer:
        """Reopen a ``storage_dir`` (or a saved directory) in on-disk mode.

        ``kwargs`` go to the constructor (``commit_every``, ``fsync``, ``beta``, ``seed``).
        """
        meta, (observation_space, action_space) = read_meta(Path(path))
        if meta["prioritized"]:
            kwargs |= {"prioritized": True, "alpha": meta["alpha"]}
        if meta.get("image_compression") is not None:
            kwargs["image_compression"] = meta["image_compression"]
        return cls(meta["capacity"], observation_space, action_space, storage_dir=path, **kwargs)

    def close(self) -> None:
        """Commit (``storage_dir`` mode), release the directory and the memory."""
        with self._lock:
            if self._closed:
                return
            self._rows.close()
            self._closed = True
            self._columns = {}

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError("ReplayBuffer is closed")

    # -- writing --------------------------------------------------------------------------
    def add_transitions(self, transitions: Transitions) -> np.ndarray:
        """Append a `Transitions` record (what a collector writes to either buffer); :meth:`add`
        takes its fields as arguments. ``values`` is not kept (off-policy learners compute their own).

        Returns:
            The slots written, in order.

        Raises:
            ValueError: a field does not match its space or shape; the message names the
                field, the expected space and the offending row (and its env_id).
        """
        rows = self._quick_rows(transitions)
        if rows is None:
            rows = self._checked_rows(transitions)
        with self._lock:
            if self._closed:
                self._check_open()
            slots = self._write(rows)
            if self._tree is not None:
                self._add_priorities(slots)
            if self._on_disk:
                self._rows.commit_if_due()
        return slots

    def _add_priorities(self, slots: np.ndarray) -> None:
        """New samples get the largest priority seen so far, in the column and the sum-tree
        (consecutive slots: the tree defers their ancestors to the next sample)."""
        assert self._tree is not None
        priority = self._rows.max_priority**self.alpha
        position, kept = int(slots[0]), len(slots)
        head = min(kept, self.capacity - position)
        no_fallbacks = self._rows.fallback_count == 0  # (then none of the new samples is one)
        for start, stop in ((position, position + head), (0, kept - head)):
            if stop > start:
                self._columns["priority"][start:stop] = priority
                leaves = priority if no_fallbacks else np.where(self._columns["fallback"][start:stop], 0.0, priority)
                self._tree.set_range(start, stop, leaves)

    def _set_tree_priorities(self, slots: np.ndarray, priorities: Any) -> None:
        """Mirror ``p ** alpha`` of ``slots`` into the sum-tree, with 0 for fallback samples.

        Sampling excludes fallbacks by default; keeping them at 0 in the tree lets that
        default sample in O(log n) without a scan (``exclude_fallback=False`` reads the
        priority column instead)."""
        assert self._tree is not None
        values = np.where(self._columns["fallback"][slots], 0.0, priorities)
        self._tree.update(slots, values)

    # -- reading --------------------------------------------------------------------------
    def sample(
        self,
        batch_size: int,
        current_version: int,
        max_staleness: int | None = None,
        exclude_fallback: bool = True,
        rng: np.random.Generator | int | None = None,
    ) -> ReplayBatch:
        """Sample ``batch_size`` distinct transitions (prioritized: proportional, with replacement).

        Args:
            batch_size: number of transitions.
            current_version: the learner's version; ``staleness = current_version -
                policy_version``.
            max_staleness: skip samples with a larger staleness.
            exclude_fallback: skip transitions whose action was a deadline fallback.
            rng: a numpy Generator or seed; the buffer's own generator when None.

        Raises:
            ValueError: fewer than ``batch_size`` samples are stored or eligible.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
        if isinstance(current_version, bool) or not isinstance(current_version, (int, np.integer)):
            raise ValueError(f"current_version: expected an int, got {current_version!r}")
        if max_staleness is not None and (not isinstance(max_staleness, (int, np.integer)) or max_staleness < 0):
            raise ValueError(f"max_staleness: expected an int >= 0 or None, got {max_staleness!r}")
        generator = rng if isinstance(rng, np.random.Generator) else None
        with self._lock:
            self._check_open()
            if generator is None:
                generator = self._rng if rng is None else np.random.default_rng(rng)
            slots, weights = self._choose(batch_size, current_version, max_staleness, exclude_fallback, generator)
            rows = {name: column[slots] for name, column in self._columns.items()}
        return self._batch(rows, slots, current_version, weights)

    def gather(self, indices: Any, current_version: int) -> ReplayBatch:
        """The transitions stored at buffer slots ``indices`` (e.g. to follow an n-step sequence).

        The slots of one ``add`` call are consecutive (mod ``capacity``), so the transitions
        of one env are not: link them by ``env_id``/``episode_id`` at add time. A slot is
        reused once ``capacity`` newer transitions were added; compare ``episode_id`` or
        ``env_id`` of the result to detect that.

        Raises:
            ValueError: a slot is out of range or holds no sample.
        """
        slots = np.asarray(indices, dtype=np.int64).reshape(-1)
        with self._lock:
            self._check_open()
            bad = (slots < 0) | (slots >= self.capacity) | ((slots - self._rows.oldest) % self.capacity >= len(self))
            if np.any(bad):
                row = int(np.flatnonzero(bad)[0])
                raise ValueError(f"gather: row {row}: slot {slots[row]} holds no sample")
            rows = {name: column[slots] for name, column in self._columns.items()}
        return self._batch(rows, slots, current_version, np.ones(slots.size, dtype=np.float32))

    def _batch(
        self, gathered: dict[str, np.ndarray], slots: np.ndarray, current_version: int, weights: np.ndarray
    ) -> ReplayBatch:
        """Assemble copied rows into a batch (outside the lock: decoding Text is slow)."""
        obs, action, next_obs = (
            codec.decode([gathered[name] for name in codec.column_names()])
            for codec in (self._rows.obs, self._rows.action, self._rows.next_obs)
        )
        numbers = {name: gathered[name] for name in self._kept_numbers}
        for number in self._numbers_not_kept:  # the critic values: NaN
            numbers[number.name] = np.full(len(slots), number.default, number.dtype)
        staleness = current_version - numbers["policy_version"]
        return ReplayBatch(
            obs=obs, action=action, next_obs=next_obs, **numbers, staleness=staleness, indices=slots, weights=weights
        )

    def _choose(
        self,
        batch_size: int,
        current_version: int,
        max_staleness: int | None,
        exclude_fallback: bool,
        rng: np.random.Generator,
    ) -> tuple[np.ndarray, np.ndarray]:
        oldest_allowed = None if max_staleness is None else current_version - max_staleness
        must_filter = (exclude_fallback and self._rows.fallback_count > 0) or oldest_allowed is not None
        # The sum-tree holds exactly the samples eligible without a staleness filter (fallbacks
        # at 0), so prioritized sampling needs no O(n) mask then.
        from_tree = self.prioritized and oldest_allowed is None and (exclude_fallback or self._rows.fallback_count == 0)
        keep = None  # over physical slots; None: every stored sample is eligible
        if must_filter and not from_tree:
            keep = np.zeros(self.capacity, dtype=bool)
            for stored in self._rows.valid_slices():
                keep[stored] = True
            if exclude_fallback:
                keep &= ~self._columns["fallback"]
            if oldest_allowed is not None:
                keep &= self._columns["policy_version"] >= oldest_allowed
        size = len(self)
        if from_tree:
            eligible = size - (self._rows.fallback_count if exclude_fallback else 0)
        else:
            eligible = size if keep is None else int(np.count_nonzero(keep))
        if eligible < batch_size:
            raise ValueError(
                f"sample: asked for {batch_size} samples but only {eligible} of the {size} "
                f"stored are eligible (current_version={current_version}, "
                f"max_staleness={max_staleness}, exclude_fallback={exclude_fallback}; stored "
                f"versions {self._version_span()}, {self._rows.fallback_count} fallback samples)"
            )
        if not self.prioritized:
            picks = rng.choice(eligible, batch_size, replace=False)
            if keep is None:
                return (self._rows.oldest + picks) % self.capacity, np.ones(batch_size, dtype=np.float32)
            return np.flatnonzero(keep)[picks], np.ones(batch_size, dtype=np.float32)
        if from_tree:  # O(log n) per sample
            assert self._tree is not None
            slots = self._tree.sample(batch_size, rng)
            # w_i = (N P(i))^-beta / max_j w_j = (p_i / p_min)^-beta.
            weights = (self._tree.values(slots) / self._tree.min) ** -self.beta
            return slots, weights.astype(np.float32)
        # A staleness filter (or fallbacks wanted back): mask the priority column, O(n).
        # Empty slots hold priority 0, so the whole column can be sampled from directly.
        priorities = self._columns["priority"]
        if keep is not None:
            priorities = np.where(keep, priorities, 0.0)
        cumulative = np.cumsum(priorities)
        total = cumulative[-1]
        slots = np.searchsorted(cumulative, rng.random(batch_size) * total, side="right")
        slots = np.minimum(slots, self.capacity - 1)  # guards against float rounding at the top
        # w_i = (N P(i))^-beta, normalized by the largest weight among the eligible samples.
        smallest = np.min(priorities, where=priorities > 0, initial=np.inf)
        weights = (priorities[slots] / smallest) ** -self.beta
        return slots, weights.astype(np.float32)

    def update_priorities(self, indices: Any, priorities: Any) -> None:
        """Set the priorities (e.g. ``|TD error| + eps``) of the sampled slots ``indices``.

        Raises:
            NotPrioritizedError: the buffer is not prioritized (a ``RuntimeError``).
            ValueError: shapes differ, a priority is not finite and > 0, or a slot is empty.
        """
        if not self.prioritized:
            raise NotPrioritizedError("update_priorities: this ReplayBuffer was created with prioritized=False")
        indices = np.asarray(indices)
        if indices.ndim != 1 or indices.dtype.kind not in "iu":
            raise ValueError(f"indices: expected a 1-D int array, got {indices.dtype} shape {indices.shape}")
        values = as_column("priorities", priorities, len(indices), np.float64, allow_scalar=False, finite=True)
        if np.any(values <= 0):
            row = int(np.flatnonzero(values <= 0)[0])
            raise ValueError(f"priorities: row {row}: expected a value > 0, got {values[row]}")
        with self._lock:
            self._check_open()
            logical = (indices - self._rows.oldest) % self.capacity
            bad = (indices < 0) | (indices >= self.capacity) | (logical >= len(self))
            if np.any(bad):
                row = int(np.flatnonzero(bad)[0])
                raise ValueError(f"indices: row {row}: slot {indices[row]} holds no sample")
            self._columns["priority"][indices] = values**self.alpha
            self._set_tree_priorities(indices, self._columns["priority"][indices])
            self._rows.max_priority = max(self._rows.max_priority, float(values.max()))

    def version_range(self) -> tuple[int, int] | None:
        """``(oldest, newest)`` policy version stored, or None when empty."""
        with self._lock:
            return self._version_range_locked()

    def _version_range_locked(self) -> tuple[int, int] | None:
        if len(self) == 0:
            return None
        versions = [self._columns["policy_version"][part] for part in self._rows.valid_slices()]
        return min(int(v.min()) for v in versions if v.size), max(int(v.max()) for v in versions if v.size)

    def _version_span(self) -> str:
        span = self._version_range_locked()
        return "none" if span is None else f"{span[0]}..{span[1]}"

    @property
    def nbytes(self) -> int:
        """Bytes the buffer's columns hold: arrays in full; compressed images as their blobs
        plus Python's per-object overhead (RAM) or the disk blocks their files take (disk)."""
        return sum(self.column_nbytes().values())

    def column_nbytes(self) -> dict[str, int]:
        """`nbytes` by stored column (``obs.0``, ``next_obs``, ``reward``...)."""
        with self._lock:
            self._check_open()
            return {name: column_nbytes(column) for name, column in self._columns.items()}

    @property
    def num_added(self) -> int:
        """Transitions passed to ``add`` over the buffer's life (including overwritten ones)."""
        return self._rows.added

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        where = f", storage_dir={str(self.storage_dir)!r}" if self.storage_dir is not None else ""
        return f"ReplayBuffer(size={len(self)}, capacity={self.capacity}, prioritized={self.prioritized}{where})"
