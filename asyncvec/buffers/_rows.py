"""The rows of a `ReplayBuffer`: its columns (in RAM or crash-safe ``.npy`` memmaps), the ring of
sample serials, turning an ``add``'s arguments into column values (a quick path for arrays that
need no conversion, a checked one that converts and names what is wrong) and writing them, and
the commit records that make them durable on disk. Sampling and the public API live in
:mod:`asyncvec.buffers.replay`; the caller holds the buffer's lock around every method here
except :meth:`ReplayRows.quick_rows` and :meth:`ReplayRows.checked_rows`.
"""

from __future__ import annotations

import os
import pickle
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
    describe,
    flush,
    load_column,
    read_json,
    save_column,
    write_json_atomic,
)
from asyncvec.buffers._images import ImageCompression
from asyncvec.buffers._spaces import SpaceCodec, as_column

__all__ = ["ReplayRows", "read_meta"]

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
_SKIP = object()  # in write()'s values: this column already holds the value everywhere, no write
_NAN = _DEFAULTS["behavior_logp"]
_FIVE_ARRAYS = (np.ndarray,) * 5
assert list(_SCALARS)[-len(_DEFAULTS) :] == list(_DEFAULTS)  # quick_rows relies on this order

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


class ReplayRows:
    """Preallocated columns holding a ring of ``capacity`` samples, each with a serial number.

    The s-th transition ever added lives in slot ``s % capacity``; serials ``oldest <= s <
    added`` are stored. With ``storage_dir`` the columns are memmaps and a commit record (the
    range of committed serials, see `CommitLog`) is written every ``commit_every`` writes; see
    `ReplayBuffer` for the crash-safety protocol. Arguments as for `ReplayBuffer`.
    """

    def __init__(
        self,
        capacity: int,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        *,
        prioritized: bool,
        alpha: float,
        storage_dir: str | os.PathLike[str] | None,
        commit_every: int,
        fsync: bool,
        validate: Literal["first", "always"],
        image_compression: ImageCompression | None,
    ) -> None:
        self.capacity = capacity
        self.observation_space = observation_space
        self.action_space = action_space
        self.prioritized = prioritized
        self.alpha = alpha
        self.commit_every = commit_every
        self.fsync = fsync
        self.image_compression = image_compression
        self.obs = SpaceCodec(observation_space, "obs", image_compression)
        self.next_obs = SpaceCodec(observation_space, "next_obs", image_compression)
        self.action = SpaceCodec(action_space, "action")
        self._specs = self._column_specs()
        self._slot_numbers = np.arange(capacity)  # write() returns read-only slices of it
        self._slot_numbers.flags.writeable = False
        # Column order of the values write() takes (quick_rows and checked_rows build them so).
        self._write_names = [
            *self.obs.column_names(),
            *self.action.column_names(),
            *self.next_obs.column_names(),
            *_SCALARS,
        ]
        self._reward_index = self._write_names.index("reward")
        self._validate_always = validate == "always"
        # Whether quick_rows checks values too: always, or until the first write (see validate).
        self._check_values = True
        # The dtypes of obs and action when each space is one plain array (the quick path's
        # shortcut), and the batch shapes by batch size.
        single = [codec.leaves[0] for codec in (self.obs, self.action) if len(codec.leaves) == 1]
        plain = len(single) == 2 and all(not leaf.path and not leaf.is_text for leaf in single)
        plain = plain and not self.obs.compressed  # blobs are written, not the arrays given
        self._plain_leaves = (single[0].dtype, single[1].dtype) if plain else None
        self._plain_signatures: dict[int, tuple[Any, ...]] = {}
        # Ring state by serial number (see the class docstring). On disk, the latest commit
        # record covers durable_oldest <= s < durable_end.
        self.oldest = 0
        self.added = 0
        self._durable_oldest = 0
        self._durable_end = 0
        self._adds_since_commit = 0
        self.max_priority = 1.0  # the largest priority given so far, kept in commit records
        self.fallback_count = 0  # kept up to date so unfiltered sampling needs no scan
        self.storage_dir = None if storage_dir is None else Path(storage_dir)
        self._dir_lock: DirectoryLock | None = None
        self._commit_log: CommitLog | None = None
        # Optional metadata columns that hold only their default so far: a write that does not
        # pass them skips them (what a buffer without such columns would cost).
        self._default_only: set[str] = set()
        self.restored = False  # whether a commit record was adopted (the sum-tree is rebuilt then)
        if self.storage_dir is None:
            self.columns = allocate(self._specs, None)
            self._fill_defaults(self.columns)
        else:
            self.storage_dir.mkdir(parents=True, exist_ok=True)
            self._dir_lock = DirectoryLock(self.storage_dir)
            try:
                self.columns = self._open_directory(self.storage_dir)
            except BaseException:
                self._dir_lock.release()
                raise
        self._write_columns = [self.columns[name] for name in self._write_names]
        self._full_width = len(self._write_columns)  # values end early when the optional metadata is skipped
        # By batch size B dividing the capacity: the write columns viewed as blocks of B rows.
        # Writes of B rows start at a multiple of B, and numpy assigns block k (an integer index)
        # faster than the slice [k B, (k + 1) B).
        self._blocks: dict[int, list[np.ndarray]] = {}
        self._blob_columns = [column for column in self._write_columns if isinstance(column, BlobColumn)]
        self._blockable = not self._blob_columns

    # -- layout and persistence ---------------------------------------------------------
    def _column_specs(self) -> ColumnSpec:
        specs: ColumnSpec = {}
        for codec in (self.obs, self.next_obs, self.action):
            for name, (shape, dtype) in zip(codec.column_names(), codec.storage()):
                specs[name] = ((self.capacity, *shape), dtype)
        for name, dtype in _SCALARS.items():
            specs[name] = ((self.capacity,), dtype)
        if self.prioritized:
            specs["priority"] = ((self.capacity,), np.dtype(np.float64))  # stores p ** alpha
        return specs

    def meta(self) -> dict[str, Any]:
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
        meta = self.meta()
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
            self.restore(self._commit_log, columns)
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
                column.drop_before(self.oldest)
                column.next_serial = self.added
                if (directory / f"{name}.packed").exists():
                    blobs = np.empty(self.capacity, dtype=object)
                    load_column(directory, name, blobs)
                    slots = self.valid_slots()
                    column.write_rows(slots, blobs[slots], np.arange(self.oldest, self.added))
                    column.flush()
                    (directory / f"{name}.packed").unlink()
                    (directory / f"{name}.offsets.npy").unlink(missing_ok=True)

    def restore(self, log: CommitLog, columns: dict[str, np.ndarray]) -> None:
        """Adopt the latest commit of ``log`` and recount what its samples hold (``restored``: the
        owner rebuilds its sum-tree from the priority column)."""
        record = log.read()
        if record is None:
            return
        if not 0 <= record.end - record.oldest <= self.capacity:
            raise ValueError(f"{_COMMIT}: serials {record.oldest}..{record.end} do not fit capacity {self.capacity}")
        self.oldest = self._durable_oldest = record.oldest
        self.added = self._durable_end = record.end
        self.max_priority = record.max_priority
        slots = self.valid_slots()
        self.fallback_count = int(np.count_nonzero(columns["fallback"][slots]))
        if self.prioritized:  # slots outside the committed range may hold stale priorities
            stored = np.zeros(self.capacity, dtype=bool)
            stored[slots] = True
            columns["priority"][~stored] = 0.0
        self.restored = True

    def commit(self) -> None:
        """Write a commit record covering every stored sample (``storage_dir`` mode; else a no-op)."""
        if self._commit_log is None:
            return
        if self.fsync:
            for column in self.columns.values():
                flush(column)
        self._write_record(self.oldest, self.added)
        self._adds_since_commit = 0

    def _write_record(self, oldest: int, end: int) -> None:
        assert self._commit_log is not None
        self._commit_log.write(oldest, end, self.max_priority, self.fsync)
        self._durable_oldest, self._durable_end = oldest, end
        for column in self._blob_columns:  # blobs no commit covers any more
            column.drop_before(oldest)

    def save(self, path: Path) -> None:
        """Write the rows to the directory ``path`` in the ``storage_dir`` format (a commit when
        ``path`` is this buffer's own ``storage_dir``)."""
        if self.storage_dir is not None and path.resolve() == self.storage_dir.resolve():
            self.commit()
            return
        path.mkdir(parents=True, exist_ok=True)
        lock = DirectoryLock(path)
        try:
            # Without a commit log the directory reads as empty while columns are replaced.
            (path / _COMMIT).unlink(missing_ok=True)
            for name, column in self.columns.items():
                save_column(path, name, column)
            with open(path / _SPACES, "wb") as file:
                pickle.dump((self.observation_space, self.action_space), file)
            write_json_atomic(path / _META, self.meta(), fsync=True)
            log = CommitLog(path / _COMMIT)
            log.write(self.oldest, self.added, self.max_priority, fsync=True)
            log.close()
        finally:
            lock.release()

    def load(self, path: Path) -> None:
        """Read the rows that :meth:`save` wrote to ``path`` into these (RAM) columns."""
        lock = DirectoryLock(path)
        try:
            self._default_only = set()
            for name, column in self.columns.items():
                load_column(path, name, column)
            log = CommitLog(path / _COMMIT)
            self.restore(log, self.columns)
            log.close()
        finally:
            lock.release()

    def close(self) -> None:
        """Commit, then release the files, the directory and the memory."""
        self.commit()
        for column in self._blob_columns:
            column.close()
        self.columns = {}
        if self._commit_log is not None:
            self._commit_log.close()
        if self._dir_lock is not None:
            self._dir_lock.release()

    # -- writing --------------------------------------------------------------------------
    def write(self, values: list[Any]) -> np.ndarray:
        """Write the rows of :meth:`quick_rows` or :meth:`checked_rows` after the newest ones
        (only the newest ``capacity`` when more), retiring the oldest where the ring is full and
        committing every ``commit_every`` writes. Returns the slots written, in order.
        """
        n = len(values[self._reward_index])
        capacity = self.capacity
        kept = n
        if n > capacity:  # only the newest `capacity` rows can be kept (checked_rows: all arrays)
            values = [value[-capacity:] for value in values]
            kept = capacity
        end = self.added + n
        if end - capacity > self.oldest:
            if self.fallback_count or self._commit_log is not None:
                self.retire_before(end - capacity)
            else:  # nothing to count or to commit: just forget the oldest
                self.oldest = end - capacity
        position = (end - kept) % capacity
        stop = position + kept
        if not self._blockable:  # blobs go to the segments of their serials
            for blob_column in self._blob_columns:
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
                    self._blocks[kept] = [c.reshape(capacity // kept, kept, *c.shape[1:]) for c in self._write_columns]
            slots = self._slot_numbers[position:stop]  # a read-only view: no new array per add
        else:  # wrapped around the end of the ring
            head = capacity - position
            for column, value in zip(self._write_columns, values):
                if value is not _SKIP:
                    is_array = type(value) is np.ndarray
                    column[position:] = value[:head] if is_array else value
                    column[: kept - head] = value[head:] if is_array else value
            slots = np.concatenate((np.arange(position, capacity), np.arange(kept - head)))
        # Values may stop before the optional metadata columns (all at their defaults).
        fallback_flags = values[-1] if len(values) == self._full_width else _SKIP
        if fallback_flags is _SKIP:
            pass
        elif type(fallback_flags) is np.ndarray:
            self.fallback_count += int(np.count_nonzero(fallback_flags))
        elif fallback_flags:
            self.fallback_count += kept
        self.added = end
        self._check_values = self._validate_always
        return slots

    def commit_if_due(self) -> None:
        """Counts one add and commits when ``commit_every`` adds have passed. The buffer calls it after
        everything of the add is written (the rows' priorities too), so a commit never covers a row
        whose priority is not yet set."""
        if self._commit_log is not None:
            self._adds_since_commit += 1
            if self.commit_every and self._adds_since_commit >= self.commit_every:
                self.commit()

    def quick_rows(
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
        >= 0). None when a check fails or the input needs conversion: :meth:`checked_rows`
        then converts it or names the field, the space and the row.
        """
        if type(reward) is not np.ndarray or reward.ndim != 1:
            return None
        n = reward.shape[0]
        if n == 0 or n > self.capacity:
            return None
        check_values = self._check_values
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
        obs_leaves = self.obs.quick_encode(obs, n, check_values)
        action_leaves = self.action.quick_encode(action, n, check_values)
        next_obs_leaves = self.next_obs.quick_encode(next_obs, n, check_values)
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
        """What quick_rows compares a batch of ``n`` against: dtypes, then shapes."""
        assert self._plain_leaves is not None  # only called for a plain layout
        obs_dtype, action_dtype = self._plain_leaves
        obs_shape, action_shape = (n, *self.obs.leaves[0].shape), (n, *self.action.leaves[0].shape)
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

    def checked_rows(
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
        for codec, value in ((self.obs, obs), (self.action, action), (self.next_obs, next_obs)):
            leaves += codec.encode(value, n, row_label)
        rows = [
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
        self._default_only.clear()  # every column is written (only once the batch is known good)
        return rows

    def retire_before(self, serial: int) -> None:
        """Drop the samples older than ``serial`` because their slots are about to be reused."""
        if serial <= self.oldest:
            return
        if self.fallback_count:  # count the fallbacks leaving (none to count in most buffers)
            gone = np.arange(self.oldest, min(serial, self.added)) % self.capacity
            self.fallback_count -= int(np.count_nonzero(self.columns["fallback"][gone]))
        self.oldest = serial
        if self._commit_log is not None and self._durable_oldest < min(serial, self._durable_end):
            # The last commit must stop covering these slots before they are overwritten.
            self._write_record(min(serial, self._durable_end), self._durable_end)

    def valid_slots(self) -> np.ndarray:
        return np.arange(self.oldest, self.added) % self.capacity

    def valid_slices(self) -> tuple[slice, slice]:
        """The stored samples' slots as (at most) two contiguous ranges."""
        start, size = self.oldest % self.capacity, len(self)
        head = min(size, self.capacity - start)
        return slice(start, start + head), slice(0, size - head)

    def __len__(self) -> int:
        return self.added - self.oldest


def read_meta(path: Path) -> tuple[dict[str, Any], tuple[spaces.Space[Any], spaces.Space[Any]]]:
    if not (path / _META).exists():
        raise FileNotFoundError(f"{path}: no {_META}; not a saved ReplayBuffer")
    meta = read_json(path / _META)
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {_FORMAT!r}")
    with open(path / _SPACES, "rb") as file:
        return meta, pickle.load(file)
