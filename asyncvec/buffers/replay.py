"""A version-aware ring replay buffer, in RAM or crash-safe on disk."""

from __future__ import annotations

import os
import pickle
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gymnasium import spaces

from asyncvec.buffers._disk import (
    BlobColumn,
    ColumnSpec,
    CommitLog,
    DirectoryLock,
    allocate,
    column_nbytes,
    describe,
    flush,
    load_column,
    read_json,
    save_column,
    write_json_atomic,
)
from asyncvec.buffers._images import ImageCompression, resolve_image_compression
from asyncvec.buffers._spaces import SpaceCodec, as_column
from asyncvec.buffers.sum_tree import SumTree

__all__ = ["ReplayBatch", "ReplayBuffer"]

_FORMAT = "asyncvec.ReplayBuffer/1"
_META, _COMMIT, _SPACES = "meta.json", "commit.bin", "spaces.pkl"

# Per-sample metadata columns besides obs/action/next_obs.
_SCALARS: dict[str, np.dtype] = {
    "reward": np.dtype(np.float32),
    "terminated": np.dtype(np.bool_),
    "truncated": np.dtype(np.bool_),
    "policy_version": np.dtype(np.int64),
    "behavior_logp": np.dtype(np.float32),  # the last four are add()'s optional keywords (_DEFAULTS)
    "env_id": np.dtype(np.int64),
    "episode_id": np.dtype(np.int64),
    "fallback": np.dtype(np.bool_),
}


# Metadata that add() takes as optional keywords, with the value a column holds when not given.
_DEFAULTS: dict[str, Any] = {"behavior_logp": np.nan, "env_id": -1, "episode_id": -1, "fallback": False}
_SKIP = object()  # in add()'s values: this column already holds the value everywhere, no write
_NAN = _DEFAULTS["behavior_logp"]
_FIVE_ARRAYS = (np.ndarray,) * 5
assert list(_SCALARS)[-len(_DEFAULTS) :] == list(_DEFAULTS)  # add() relies on this order

_INT64, _FLOAT32, _BOOL = np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.bool_)
# Scalars stored without a conversion, by column dtype (exact types: a bool is no version).
_QUICK_SCALAR_TYPES: dict[np.dtype, tuple[type, ...]] = {
    _INT64: (int, np.int64),
    _FLOAT32: (float, np.float32, np.float64),
    _BOOL: (bool, np.bool_),
}


def _quick_metadata(value: Any, n: int, dtype: np.dtype, minimum: int | None, check_values: bool) -> Any:
    """``value`` as stored if it needs no conversion, else None: a plain scalar of the column's
    kind (checked against ``minimum``: a Python comparison) or an ``(n,)`` array of its dtype
    (float64 is narrowed to float32; checked against ``minimum`` only with ``check_values``)."""
    if type(value) is np.ndarray:
        if value.shape != (n,):
            return None
        if value.dtype != dtype:
            if not (dtype.kind == "f" and value.dtype.kind == "f"):
                return None
            value = value.astype(dtype)
        if check_values and minimum is not None and value.min() < minimum:
            return None
        return value
    if type(value) not in _QUICK_SCALAR_TYPES[dtype]:
        return None
    if minimum is not None and not value >= minimum:
        return None
    return value


@dataclass
class ReplayBatch:
    """A sampled batch; every array has the batch as its leading dimension.

    ``obs``/``next_obs``/``action`` follow their space: an array, or a dict/tuple of arrays
    for Dict/Tuple spaces; Text comes back as an object array of ``str``.
    ``staleness = current_version - policy_version``. ``indices`` are buffer slots for
    :meth:`ReplayBuffer.update_priorities`. ``weights`` are the prioritized-replay
    importance weights (all ones for uniform sampling).
    """

    obs: Any
    action: Any
    reward: np.ndarray
    next_obs: Any
    terminated: np.ndarray
    truncated: np.ndarray
    behavior_logp: np.ndarray
    policy_version: np.ndarray
    env_id: np.ndarray
    episode_id: np.ndarray
    fallback: np.ndarray
    staleness: np.ndarray
    indices: np.ndarray
    weights: np.ndarray


class ReplayBuffer:
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
        self._obs = SpaceCodec(observation_space, "obs", self.image_compression)
        self._next_obs = SpaceCodec(observation_space, "next_obs", self.image_compression)
        self._action = SpaceCodec(action_space, "action")
        self._specs = self._column_specs()
        self._tree = SumTree(self.capacity) if self.prioritized else None
        self._slot_numbers = np.arange(self.capacity)  # add() returns read-only slices of it
        self._slot_numbers.flags.writeable = False
        # Column order of the values add() writes (_quick_rows and _checked_rows build them so).
        self._write_names = [
            *self._obs.column_names(),
            *self._action.column_names(),
            *self._next_obs.column_names(),
            *_SCALARS,
        ]
        self._reward_index = self._write_names.index("reward")
        self._validate_always = validate == "always"
        self._values_checked = False  # becomes True after the first add (see validate)
        # The dtypes of obs and action when each space is one plain array (the quick path's
        # shortcut), and the batch shapes by batch size.
        single = [codec.leaves[0] for codec in (self._obs, self._action) if len(codec.leaves) == 1]
        plain = len(single) == 2 and all(not leaf.path and not leaf.is_text for leaf in single)
        plain = plain and not self._obs.compressed  # blobs are written, not the arrays given
        self._plain_leaves = (single[0].dtype, single[1].dtype) if plain else None
        self._plain_signatures: dict[int, tuple[Any, ...]] = {}
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._closed = False
        # Ring state by serial number: the s-th transition ever added lives in slot
        # s % capacity; serials oldest <= s < added are stored. On disk, the latest commit
        # record covers durable_oldest <= s < durable_end.
        self._oldest = 0
        self._added = 0
        self._durable_oldest = 0
        self._durable_end = 0
        self._adds_since_commit = 0
        self._max_priority = 1.0
        self._fallback_count = 0  # kept up to date so unfiltered sampling needs no scan
        self.storage_dir = None if storage_dir is None else Path(storage_dir)
        self._dir_lock: DirectoryLock | None = None
        self._commit_log: CommitLog | None = None
        # Optional metadata columns that hold only their default so far: an add that does not
        # pass them skips their write (what a buffer without such columns would cost).
        self._default_only: set[str] = set()
        if self.storage_dir is None:
            self._columns = allocate(self._specs, None)
            self._fill_defaults(self._columns)
        else:
            self.storage_dir.mkdir(parents=True, exist_ok=True)
            self._dir_lock = DirectoryLock(self.storage_dir)
            try:
                self._columns = self._open_directory(self.storage_dir)
            except BaseException:
                self._dir_lock.release()
                raise
        self._write_columns = [self._columns[name] for name in self._write_names]
        # By batch size B dividing the capacity: the write columns viewed as blocks of B rows.
        # Adds of B rows start at a multiple of B, and numpy assigns block k (an integer index)
        # faster than the slice [k B, (k + 1) B).
        self._blocks: dict[int, list[np.ndarray]] = {}
        self._blob_columns = [column for column in self._write_columns if isinstance(column, BlobColumn)]
        self._blockable = not self._blob_columns

    # -- layout and persistence ---------------------------------------------------------
    def _column_specs(self) -> ColumnSpec:
        specs: ColumnSpec = {}
        for codec in (self._obs, self._next_obs, self._action):
            for name, (shape, dtype) in zip(codec.column_names(), codec.storage()):
                specs[name] = ((self.capacity, *shape), dtype)
        for name, dtype in _SCALARS.items():
            specs[name] = ((self.capacity,), dtype)
        if self.prioritized:
            specs["priority"] = ((self.capacity,), np.dtype(np.float64))  # stores p ** alpha
        return specs

    def _meta(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "capacity": self.capacity,
            "prioritized": self.prioritized,
            "alpha": self.alpha if self.prioritized else None,
            "columns": describe(self._specs),
            "image_compression": None if self.image_compression is None else self.image_compression.to_dict(),
            "observation_space": str(self.observation_space),
            "action_space": str(self.action_space),
        }

    def _open_directory(self, directory: Path) -> dict[str, np.ndarray]:
        meta = self._meta()
        meta_path = directory / _META
        if meta_path.exists():
            stored = read_json(meta_path)
            for key in ("format", "capacity", "prioritized", "alpha", "columns", "image_compression"):
                if stored.get(key) != meta[key]:
                    raise ValueError(
                        f"storage_dir {directory}: holds a buffer with {key}={stored.get(key)!r}, "
                        f"this buffer has {key}={meta[key]!r} (spaces there: "
                        f"{stored.get('observation_space')}, {stored.get('action_space')})"
                    )
        columns = allocate(self._specs, directory)
        self._commit_log = CommitLog(directory / _COMMIT)
        if meta_path.exists():
            self._restore(self._commit_log, columns)
            self._import_packed_blobs(directory, columns)
        else:
            self._fill_defaults(columns)
            with open(directory / _SPACES, "wb") as file:
                pickle.dump((self.observation_space, self.action_space), file)
            write_json_atomic(meta_path, meta, self.fsync)
        return columns

    def _fill_defaults(self, columns: dict[str, np.ndarray]) -> None:
        """Fill fresh metadata columns with their defaults (see ``_default_only``)."""
        for name, value in _DEFAULTS.items():
            columns[name].fill(value)
        self._default_only = set(_DEFAULTS)

    def _import_packed_blobs(self, directory: Path, columns: dict[str, Any]) -> None:
        """A directory written by :meth:`save` packs its blobs; an on-disk buffer keeps them in
        segments by serial: move the stored samples' blobs there, then drop the packed files."""
        for name, column in columns.items():
            if isinstance(column, BlobColumn):
                column.drop_before(self._oldest)
                column.next_serial = self._added
                if (directory / f"{name}.packed").exists():
                    blobs = np.empty(self.capacity, dtype=object)
                    load_column(directory, name, blobs)
                    slots = self._valid_slots()
                    column.write_rows(slots, blobs[slots], np.arange(self._oldest, self._added))
                    column.flush()
                    (directory / f"{name}.packed").unlink()
                    (directory / f"{name}.offsets.npy").unlink(missing_ok=True)

    def _restore(self, log: CommitLog, columns: dict[str, np.ndarray]) -> None:
        """Adopt the latest commit of ``log`` and recount what its samples hold."""
        record = log.read()
        if record is None:
            return
        if not 0 <= record.end - record.oldest <= self.capacity:
            raise ValueError(f"{_COMMIT}: serials {record.oldest}..{record.end} do not fit capacity {self.capacity}")
        self._oldest = self._durable_oldest = record.oldest
        self._added = self._durable_end = record.end
        self._max_priority = record.max_priority
        slots = self._valid_slots()
        self._fallback_count = int(np.count_nonzero(columns["fallback"][slots]))
        if self.prioritized:  # slots outside the committed range may hold stale priorities
            stored = np.zeros(self.capacity, dtype=bool)
            stored[slots] = True
            columns["priority"][~stored] = 0.0
            assert self._tree is not None
            self._tree.rebuild(np.where(columns["fallback"], 0.0, columns["priority"]))

    def commit(self) -> None:
        """Make every added sample durable (``storage_dir`` mode; a no-op in RAM)."""
        with self._lock:
            self._check_open()
            self._commit_locked()

    def _commit_locked(self) -> None:
        if self._commit_log is None:
            return
        if self.fsync:
            for column in self._columns.values():
                flush(column)
        self._write_record(self._oldest, self._added)
        self._adds_since_commit = 0

    def _write_record(self, oldest: int, end: int) -> None:
        assert self._commit_log is not None
        self._commit_log.write(oldest, end, self._max_priority, self.fsync)
        self._durable_oldest, self._durable_end = oldest, end
        for column in self._blob_columns:  # blobs no commit covers any more
            column.drop_before(oldest)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the buffer to the directory ``path`` in the ``storage_dir`` format.

        Reload it in RAM with :meth:`load`, or keep using it on disk with :meth:`open`.
        Saving to the buffer's own ``storage_dir`` is a ``commit()``.
        """
        path = Path(path)
        with self._lock:
            self._check_open()
            if self.storage_dir is not None and path.resolve() == self.storage_dir.resolve():
                self._commit_locked()
                return
            path.mkdir(parents=True, exist_ok=True)
            lock = DirectoryLock(path)
            try:
                # Without a commit log the directory reads as empty while columns are replaced.
                (path / _COMMIT).unlink(missing_ok=True)
                for name, column in self._columns.items():
                    save_column(path, name, column)
                with open(path / _SPACES, "wb") as file:
                    pickle.dump((self.observation_space, self.action_space), file)
                write_json_atomic(path / _META, self._meta(), fsync=True)
                log = CommitLog(path / _COMMIT)
                log.write(self._oldest, self._added, self._max_priority, fsync=True)
                log.close()
            finally:
                lock.release()

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, seed: int | None = None) -> ReplayBuffer:
        """Read a buffer saved with :meth:`save` (or a ``storage_dir``) into RAM.

        The spaces are unpickled from ``spaces.pkl``: load only directories you trust.
        """
        path = Path(path)
        meta, (observation_space, action_space) = _read_meta(path)
        buffer = cls(
            meta["capacity"],
            observation_space,
            action_space,
            prioritized=meta["prioritized"],
            alpha=meta["alpha"] if meta["alpha"] is not None else 0.6,
            seed=seed,
            image_compression=meta.get("image_compression"),
        )
        lock = DirectoryLock(path)
        try:
            buffer._default_only = set()
            for name, column in buffer._columns.items():
                load_column(path, name, column)
            log = CommitLog(path / _COMMIT)
            buffer._restore(log, buffer._columns)
            log.close()
        finally:
            lock.release()
        return buffer

    @classmethod
    def open(cls, path: str | os.PathLike[str], **kwargs: Any) -> ReplayBuffer:
        """Reopen a ``storage_dir`` (or a saved directory) in on-disk mode.

        ``kwargs`` go to the constructor (``commit_every``, ``fsync``, ``beta``, ``seed``).
        """
        meta, (observation_space, action_space) = _read_meta(Path(path))
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
            self._commit_locked()
            self._closed = True
            for column in self._blob_columns:
                column.close()
            self._columns = {}
            if self._commit_log is not None:
                self._commit_log.close()
            if self._dir_lock is not None:
                self._dir_lock.release()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ReplayBuffer is closed")

    # -- writing --------------------------------------------------------------------------
    def add(
        self,
        obs: Any,
        action: Any,
        reward: Any,
        next_obs: Any,
        terminated: Any,
        truncated: Any,
        policy_version: Any,
        *,
        behavior_logp: Any = np.nan,
        env_id: Any = -1,
        episode_id: Any = -1,
        fallback: Any = False,
    ) -> np.ndarray:
        """Append a batch of transitions (leading dimension = batch).

        Args:
            obs, next_obs: batched observations: an array ``(B, *shape)``, a dict/tuple of
                them for Dict/Tuple spaces, a list of ``B`` str for Text.
            action: batched actions, same conventions.
            reward: ``(B,)`` floats. terminated, truncated: ``(B,)`` bools.
            policy_version: version that produced each action, ``(B,)`` or one int.
            behavior_logp: log-probability of each action under the behavior policy (NaN:
                unknown). env_id, episode_id: ids for bookkeeping (-1: unknown).
            fallback: whether the action was a deadline fallback rather than the policy's.
            Every metadata argument may be one scalar for the whole batch.

        Returns:
            The slots written, in order.

        Raises:
            ValueError: a field does not match its space or shape; the message names the
                field, the expected space and the offending row (and its env_id).
        """
        values = self._quick_rows(
            obs,
            action,
            reward,
            next_obs,
            terminated,
            truncated,
            policy_version,
            behavior_logp,
            env_id,
            episode_id,
            fallback,
        )
        if values is None:
            values = self._checked_rows(
                obs,
                action,
                reward,
                next_obs,
                terminated,
                truncated,
                policy_version,
                behavior_logp,
                env_id,
                episode_id,
                fallback,
            )
            self._default_only.clear()  # every column is written
        n = len(values[self._reward_index])
        with self._lock:
            if self._closed:
                self._check_open()
            capacity = self.capacity
            kept = n
            if n > capacity:  # only the newest `capacity` rows can be kept (_checked_rows: all arrays)
                values = [value[-capacity:] for value in values]
                kept = capacity
            end = self._added + n
            if end - capacity > self._oldest:
                if self._fallback_count or self._commit_log is not None:
                    self._retire_before(end - capacity)
                else:  # nothing to count or to commit: just forget the oldest
                    self._oldest = end - capacity
            position = (end - kept) % capacity
            stop = position + kept
            for blob_column in self._blob_columns:  # blobs go to the segments of their serials
                blob_column.next_serial = end - kept
            if stop <= capacity:
                blocks = self._blocks.get(kept) if position % kept == 0 else None
                if blocks is not None:  # the usual add: the same batch size every time
                    block = position // kept
                    for view, value in zip(blocks, values):
                        if value is not _SKIP:
                            view[block] = value
                else:
                    for column, value in zip(self._write_columns, values):
                        if value is not _SKIP:
                            column[position:stop] = value
                    if kept not in self._blocks and capacity % kept == 0 and len(self._blocks) < 4 and self._blockable:
                        self._blocks[kept] = [
                            c.reshape(capacity // kept, kept, *c.shape[1:]) for c in self._write_columns
                        ]
                slots = self._slot_numbers[position:stop]  # a read-only view: no new array per add
                head = kept
            else:  # wrapped around the end of the ring
                head = capacity - position
                for column, value in zip(self._write_columns, values):
                    if value is not _SKIP:
                        is_array = type(value) is np.ndarray
                        column[position:] = value[:head] if is_array else value
                        column[: kept - head] = value[head:] if is_array else value
                slots = np.concatenate((np.arange(position, capacity), np.arange(kept - head)))
            # Values may stop before the optional metadata columns (all at their defaults).
            fallback_flags = values[-1] if len(values) == len(self._write_columns) else _SKIP
            if fallback_flags is _SKIP:
                pass
            elif type(fallback_flags) is np.ndarray:
                self._fallback_count += int(np.count_nonzero(fallback_flags))
            elif fallback_flags:
                self._fallback_count += kept
            if self.prioritized:
                self._add_priorities(position, kept, head, fallback_flags)
            self._added = end
            self._values_checked = True
            if self._commit_log is not None:
                self._adds_since_commit += 1
                if self.commit_every and self._adds_since_commit >= self.commit_every:
                    self._commit_locked()
        return slots

    def _quick_rows(
        self,
        obs: Any,
        action: Any,
        reward: Any,
        next_obs: Any,
        terminated: Any,
        truncated: Any,
        policy_version: Any,
        behavior_logp: Any,
        env_id: Any,
        episode_id: Any,
        fallback: Any,
    ) -> list[Any] | None:
        """The values to write, in the order of ``_write_columns``, for a batch that needs no
        conversion: ndarrays of the stored dtype and shape, and metadata given as one plain
        scalar or one such array (a scalar stays a scalar: the column write broadcasts it).
        ``_SKIP`` marks a column left as it is; the list ends early when all the optional
        metadata columns are (they come last).

        With ``validate="always"``, or before the first add, the values are also checked with
        a few whole-batch numpy operations (within the spaces' bounds, finite rewards, versions
        >= 0). None when a check fails or the input needs conversion: :meth:`_checked_rows`
        then converts it or names the field, the space and the row.
        """
        if type(reward) is not np.ndarray or reward.ndim != 1:
            return None
        n = reward.shape[0]
        if n == 0 or n > self.capacity:
            return None
        check_values = self._validate_always or not self._values_checked
        signature = self._plain_signatures.get(n) if not check_values else None
        if signature is None and self._plain_leaves is not None and not check_values:
            signature = self._plain_signatures[n] = self._plain_signature(n)
        if (
            signature is not None
            and (type(obs), type(action), type(next_obs), type(terminated), type(truncated)) == _FIVE_ARRAYS
            and (obs.dtype, action.dtype, next_obs.dtype, reward.dtype, terminated.dtype, truncated.dtype,
                 obs.shape, action.shape, next_obs.shape, terminated.shape, truncated.shape) == signature
        ):  # fmt: skip
            # Plain array spaces, arrays of the stored dtypes and shapes: one tuple comparison.
            leaves: list[Any] | None = [obs, action, next_obs, reward, terminated, truncated]
        else:
            leaves = self._quick_arrays(obs, action, reward, next_obs, terminated, truncated, n, check_values)
        if leaves is None:
            return None
        if type(policy_version) is int and policy_version >= 0:
            version = policy_version
        else:
            version = _quick_metadata(policy_version, n, _INT64, 0, check_values)
        if version is None:
            return None
        # An omitted keyword is the default object itself (np.nan, -1, False): no write is
        # needed while its column holds only defaults.
        default_only = self._default_only
        if (
            len(default_only) == 4
            and behavior_logp is _NAN
            and fallback is False
            and type(env_id) is int
            and type(episode_id) is int
            and env_id == -1
            and episode_id == -1
        ):  # the common case, all four omitted, in one test: their columns are not written
            leaves.append(version)
            return leaves
        if default_only and behavior_logp is _NAN and "behavior_logp" in default_only:
            logp = _SKIP
        else:
            logp = _quick_metadata(behavior_logp, n, _FLOAT32, None, check_values)
        if default_only and type(env_id) is int and env_id == -1 and "env_id" in default_only:
            env_ids = _SKIP
        else:
            env_ids = _quick_metadata(env_id, n, _INT64, -1, check_values)
        if default_only and type(episode_id) is int and episode_id == -1 and "episode_id" in default_only:
            episode_ids = _SKIP
        else:
            episode_ids = _quick_metadata(episode_id, n, _INT64, None, check_values)
        if default_only and fallback is False and "fallback" in default_only:
            fallback_flags = _SKIP
        else:
            fallback_flags = _quick_metadata(fallback, n, _BOOL, None, check_values)
        if logp is None or env_ids is None or episode_ids is None or fallback_flags is None:
            return None
        if default_only:  # these columns are written from now on
            for name, value in (
                ("behavior_logp", logp),
                ("env_id", env_ids),
                ("episode_id", episode_ids),
                ("fallback", fallback_flags),
            ):
                if value is not _SKIP:
                    default_only.discard(name)
        leaves += (version, logp, env_ids, episode_ids, fallback_flags)
        return leaves

    def _quick_arrays(
        self,
        obs: Any,
        action: Any,
        reward: Any,
        next_obs: Any,
        terminated: Any,
        truncated: Any,
        n: int,
        check_values: bool,
    ) -> list[Any] | None:
        """The space leaves, reward, terminated and truncated of a batch that needs at most a
        float narrowing, checked leaf by leaf (values too with ``check_values``); else None."""
        obs_leaves = self._obs.quick_encode(obs, n, check_values)
        action_leaves = self._action.quick_encode(action, n, check_values)
        next_obs_leaves = self._next_obs.quick_encode(next_obs, n, check_values)
        if obs_leaves is None or action_leaves is None or next_obs_leaves is None:
            return None
        if reward.dtype != _FLOAT32:
            if reward.dtype.kind != "f":
                return None
            reward = reward.astype(_FLOAT32)
        if check_values and not np.isfinite(reward).all():
            return None
        shape = reward.shape
        for flags in (terminated, truncated):
            if type(flags) is not np.ndarray or flags.dtype != _BOOL or flags.shape != shape:
                return None
        return [*obs_leaves, *action_leaves, *next_obs_leaves, reward, terminated, truncated]

    def _plain_signature(self, n: int) -> tuple[Any, ...]:
        """What _quick_rows compares a batch of ``n`` against: dtypes, then shapes."""
        assert self._plain_leaves is not None  # only called for a plain layout
        obs_dtype, action_dtype = self._plain_leaves
        obs_shape, action_shape = (n, *self._obs.leaves[0].shape), (n, *self._action.leaves[0].shape)
        return (
            obs_dtype,
            action_dtype,
            obs_dtype,
            _FLOAT32,
            _BOOL,
            _BOOL,
            obs_shape,
            action_shape,
            obs_shape,
            (n,),
            (n,),
        )

    def _checked_rows(
        self,
        obs: Any,
        action: Any,
        reward: Any,
        next_obs: Any,
        terminated: Any,
        truncated: Any,
        policy_version: Any,
        behavior_logp: Any,
        env_id: Any,
        episode_id: Any,
        fallback: Any,
    ) -> list[np.ndarray]:
        """The values to write as ``(n, ...)`` arrays (the order of ``_write_columns``):
        converted where lossless, checked against the spaces, with errors that name the
        field, the expected space and the row (and its env_id)."""
        reward_array = np.asarray(reward)
        if reward_array.ndim != 1:
            raise ValueError(f"reward: expected a 1-D batch (leading dim = batch), got shape {reward_array.shape}")
        n = reward_array.shape[0]
        env_ids = as_column("env_id", env_id, n, np.int64, minimum=-1)

        def row_label(row: int) -> str:
            return f"row {row}" if env_ids[row] < 0 else f"row {row} (env_id {env_ids[row]})"

        leaves = []
        for codec, value in ((self._obs, obs), (self._action, action), (self._next_obs, next_obs)):
            leaves += codec.encode(value, n, row_label)
        return [
            *leaves,
            as_column("reward", reward_array, n, np.float32, allow_scalar=False, finite=True),
            as_column("terminated", terminated, n, np.bool_, allow_scalar=False),
            as_column("truncated", truncated, n, np.bool_, allow_scalar=False),
            as_column("policy_version", policy_version, n, np.int64, minimum=0),
            as_column("behavior_logp", behavior_logp, n, np.float32),
            env_ids,
            as_column("episode_id", episode_id, n, np.int64),
            as_column("fallback", fallback, n, np.bool_),
        ]

    def _add_priorities(self, position: int, kept: int, head: int, fallback_flags: Any) -> None:
        """New samples get the largest priority seen so far, in the column and the sum-tree
        (consecutive slots: the tree defers their ancestors to the next sample)."""
        assert self._tree is not None
        priority = self._max_priority**self.alpha
        no_fallbacks = fallback_flags is _SKIP or (type(fallback_flags) is not np.ndarray and not fallback_flags)
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

    def _retire_before(self, serial: int) -> None:
        """Drop the samples older than ``serial`` because their slots are about to be reused."""
        if serial <= self._oldest:
            return
        if self._fallback_count:  # count the fallbacks leaving (none to count in most buffers)
            gone = np.arange(self._oldest, min(serial, self._added)) % self.capacity
            self._fallback_count -= int(np.count_nonzero(self._columns["fallback"][gone]))
        self._oldest = serial
        if self._commit_log is not None and self._durable_oldest < min(serial, self._durable_end):
            # The last commit must stop covering these slots before they are overwritten.
            self._write_record(min(serial, self._durable_end), self._durable_end)

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
            bad = (slots < 0) | (slots >= self.capacity) | ((slots - self._oldest) % self.capacity >= len(self))
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
            for codec in (self._obs, self._action, self._next_obs)
        )
        return ReplayBatch(
            obs=obs,
            action=action,
            reward=gathered["reward"],
            next_obs=next_obs,
            terminated=gathered["terminated"],
            truncated=gathered["truncated"],
            behavior_logp=gathered["behavior_logp"],
            policy_version=gathered["policy_version"],
            env_id=gathered["env_id"],
            episode_id=gathered["episode_id"],
            fallback=gathered["fallback"],
            staleness=current_version - gathered["policy_version"],
            indices=slots,
            weights=weights,
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
        must_filter = (exclude_fallback and self._fallback_count > 0) or oldest_allowed is not None
        # The sum-tree holds exactly the samples eligible without a staleness filter (fallbacks
        # at 0), so prioritized sampling needs no O(n) mask then.
        from_tree = self.prioritized and oldest_allowed is None and (exclude_fallback or self._fallback_count == 0)
        keep = None  # over physical slots; None: every stored sample is eligible
        if must_filter and not from_tree:
            keep = np.zeros(self.capacity, dtype=bool)
            for stored in self._valid_slices():
                keep[stored] = True
            if exclude_fallback:
                keep &= ~self._columns["fallback"]
            if oldest_allowed is not None:
                keep &= self._columns["policy_version"] >= oldest_allowed
        size = len(self)
        if from_tree:
            eligible = size - (self._fallback_count if exclude_fallback else 0)
        else:
            eligible = size if keep is None else int(np.count_nonzero(keep))
        if eligible < batch_size:
            raise ValueError(
                f"sample: asked for {batch_size} samples but only {eligible} of the {size} "
                f"stored are eligible (current_version={current_version}, "
                f"max_staleness={max_staleness}, exclude_fallback={exclude_fallback}; stored "
                f"versions {self._version_span()}, {self._fallback_count} fallback samples)"
            )
        if not self.prioritized:
            picks = rng.choice(eligible, batch_size, replace=False)
            if keep is None:
                return (self._oldest + picks) % self.capacity, np.ones(batch_size, dtype=np.float32)
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
            RuntimeError: the buffer is not prioritized.
            ValueError: shapes differ, a priority is not finite and > 0, or a slot is empty.
        """
        if not self.prioritized:
            raise RuntimeError("update_priorities: this ReplayBuffer was created with prioritized=False")
        indices = np.asarray(indices)
        if indices.ndim != 1 or indices.dtype.kind not in "iu":
            raise ValueError(f"indices: expected a 1-D int array, got {indices.dtype} shape {indices.shape}")
        values = as_column("priorities", priorities, len(indices), np.float64, allow_scalar=False, finite=True)
        if np.any(values <= 0):
            row = int(np.flatnonzero(values <= 0)[0])
            raise ValueError(f"priorities: row {row}: expected a value > 0, got {values[row]}")
        with self._lock:
            self._check_open()
            logical = (indices - self._oldest) % self.capacity
            bad = (indices < 0) | (indices >= self.capacity) | (logical >= len(self))
            if np.any(bad):
                row = int(np.flatnonzero(bad)[0])
                raise ValueError(f"indices: row {row}: slot {indices[row]} holds no sample")
            self._columns["priority"][indices] = values**self.alpha
            self._set_tree_priorities(indices, self._columns["priority"][indices])
            self._max_priority = max(self._max_priority, float(values.max()))

    def version_range(self) -> tuple[int, int] | None:
        """``(oldest, newest)`` policy version stored, or None when empty."""
        with self._lock:
            return self._version_range_locked()

    def _version_range_locked(self) -> tuple[int, int] | None:
        if len(self) == 0:
            return None
        versions = [self._columns["policy_version"][part] for part in self._valid_slices()]
        return min(int(v.min()) for v in versions if v.size), max(int(v.max()) for v in versions if v.size)

    def _version_span(self) -> str:
        span = self._version_range_locked()
        return "none" if span is None else f"{span[0]}..{span[1]}"

    def _valid_slots(self) -> np.ndarray:
        return np.arange(self._oldest, self._added) % self.capacity

    def _valid_slices(self) -> tuple[slice, slice]:
        """The stored samples' slots as (at most) two contiguous ranges."""
        start, size = self._oldest % self.capacity, len(self)
        head = min(size, self.capacity - start)
        return slice(start, start + head), slice(0, size - head)

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
        return self._added

    def __len__(self) -> int:
        return self._added - self._oldest

    def __repr__(self) -> str:
        where = f", storage_dir={str(self.storage_dir)!r}" if self.storage_dir is not None else ""
        return f"ReplayBuffer(size={len(self)}, capacity={self.capacity}, prioritized={self.prioritized}{where})"


def _read_meta(path: Path) -> tuple[dict[str, Any], tuple[spaces.Space[Any], spaces.Space[Any]]]:
    if not (path / _META).exists():
        raise FileNotFoundError(f"{path}: no {_META}; not a saved ReplayBuffer")
    meta = read_json(path / _META)
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {_FORMAT!r}")
    with open(path / _SPACES, "rb") as file:
        return meta, pickle.load(file)
