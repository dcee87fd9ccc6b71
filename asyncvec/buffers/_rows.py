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
from collections.abc import Callable
from operator import attrgetter
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
from asyncvec.buffers._spaces import SpaceCodec
from asyncvec.buffers.transitions import NUMBERS, Number, Transitions

__all__ = ["ReplayRows", "read_meta"]

_FORMAT = "asyncvec.ReplayBuffer/1"
_META, _COMMIT, _SPACES = "meta.json", "commit.bin", "spaces.pkl"

# The per-transition numbers of `Transitions` a ReplayBuffer keeps, one column each: all but the
# critic values (off-policy learners compute their own). In the order write() takes them (after
# the space leaves): the required ones, then add()'s optional keywords, last, so that the values
# of an add that omits them all can end early.
_REQUIRED = tuple(number for number in NUMBERS if number.required)
_OPTIONAL = tuple(number for number in NUMBERS if not number.required and number.name != "values")
_KEPT = _REQUIRED + _OPTIONAL
_ENV_ID = next(number for number in _KEPT if number.name == "env_id")  # checked first: row labels name it
# quick_rows reads the required fields (add's positional parameters) by name: a loop over them
# costs a tenth of an add. It handles the optional ones whatever they are.
assert tuple(number.name for number in _REQUIRED) == ("reward", "terminated", "truncated", "policy_version")
_REWARD, _TERMINATED, _TRUNCATED, _VERSION = _REQUIRED
_optional_of = attrgetter(*(number.name for number in _OPTIONAL))  # (two or more: a tuple)
_ALL_OPTIONAL = len(_OPTIONAL)


def _defaults_test(group: tuple[Number, ...]) -> Callable[[Transitions], bool]:
    """A test whether a record's fields of ``group`` are all their default objects (what ``add``
    passes for omitted keywords). It is written out as code once, as `dataclasses` writes an
    ``__init__``: a generic loop over the fields costs a twentieth of an add."""
    test = " and ".join(f"t.{number.name} is defaults[{index}]" for index, number in enumerate(group))
    function: Callable[[Transitions], bool] = eval(f"lambda t: {test}", {"defaults": [n.default for n in group]})
    return function


_all_omitted = _defaults_test(_OPTIONAL)

_SKIP = object()  # in write()'s values: this column already holds the value everywhere, no write
_FIVE_ARRAYS = (np.ndarray,) * 5

_INT64, _FLOAT32, _BOOL = np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.bool_)
# Scalars stored without a conversion, by column dtype (exact types: a bool is no version).
_QUICK_SCALAR_TYPES: dict[np.dtype, tuple[type, ...]] = {
    _INT64: (int, np.int64),
    _FLOAT32: (float, np.float32, np.float64),
    _BOOL: (bool, np.bool_),
}


def _quick_number(value: Any, n: int, number: Number, check_values: bool) -> Any:
    """``value`` as stored if it needs no conversion, else None: an ``(n,)`` array of the column's
    dtype (float64 is narrowed to float32; checked against ``minimum`` and ``finite`` only with
    ``check_values``) or, unless the number is ``per_row``, a plain scalar of the column's kind
    (checked against ``minimum``: a Python comparison)."""
    dtype = number.dtype
    if type(value) is np.ndarray:
        if value.shape != (n,):
            return None
        if value.dtype != dtype:
            if not (dtype.kind == "f" and value.dtype.kind == "f"):
                return None
            value = value.astype(dtype)
        if check_values:
            if number.minimum is not None and value.min() < number.minimum:
                return None
            if number.finite and not np.isfinite(value).all():
                return None
        return value
    if number.per_row or type(value) not in _QUICK_SCALAR_TYPES[dtype]:
        return None
    if number.minimum is not None and not value >= number.minimum:
        return None
    if number.finite and not np.isfinite(value):
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
            *(number.name for number in _KEPT),
        ]
        self._reward_index = self._write_names.index("reward")
        self._fallback_index = self._write_names.index("fallback")
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
        for number in _KEPT:
            specs[number.name] = ((self.capacity,), number.dtype)
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
        for number in _OPTIONAL:
            columns[number.name].fill(number.default)
        self._default_only = {number.name for number in _OPTIONAL}

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
        (only the newest ``capacity`` when more), retiring the oldest where the ring is full.
        Returns the slots written, in order.
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
        fallback_flags = values[self._fallback_index] if len(values) > self._fallback_index else _SKIP
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

    def quick_rows(self, t: Transitions) -> list[Any] | None:
        """The values to write, in the order of ``_write_columns``, for a
        batch that needs no conversion: ndarrays of the stored dtype and shape, and metadata
        given as one plain scalar or one such array (a scalar stays a scalar: the column write
        broadcasts it). ``_SKIP`` marks a column left as it is; the list ends early when all the
        optional metadata columns are (they come last).

        With ``validate="always"``, or before the first add, the values are also checked with
        a few whole-batch numpy operations (within the spaces' bounds, finite rewards, versions
        >= 0). None when a check fails or the input needs conversion: :meth:`checked_rows`
        then converts it or names the field, the space and the row.
        """
        reward = t.reward
        if type(reward) is not np.ndarray or reward.ndim != 1:
            return None
        n = reward.shape[0]
        if n == 0 or n > self.capacity:
            return None
        check_values = self._check_values
        signature = self._plain_signatures.get(n) if not check_values else None
        if signature is None and self._plain_leaves is not None and not check_values:
            signature = self._plain_signatures[n] = self._plain_signature(n)
        obs, action, next_obs, terminated, truncated = t.obs, t.action, t.next_obs, t.terminated, t.truncated
        if (
            signature is not None
            and (type(obs), type(action), type(next_obs), type(terminated), type(truncated)) == _FIVE_ARRAYS
            and (obs.dtype, action.dtype, next_obs.dtype, reward.dtype, terminated.dtype, truncated.dtype,
                 obs.shape, action.shape, next_obs.shape, terminated.shape, truncated.shape) == signature
        ):  # fmt: skip
            # Plain array spaces, arrays of the stored dtypes and shapes: one tuple comparison.
            values: list[Any] | None = [obs, action, next_obs, reward, terminated, truncated]
        else:
            values = self._quick_arrays(t, n, check_values)
        if values is None:
            return None
        version = t.policy_version
        if type(version) is not int or version < 0:
            version = _quick_number(version, n, _VERSION, check_values)
            if version is None:
                return None
        values.append(version)
        # An omitted keyword is the default object itself (np.nan, -1, False): no write is
        # needed while its column holds only defaults.
        default_only = self._default_only
        if len(default_only) == _ALL_OPTIONAL and _all_omitted(t):
            return values  # the common case, all omitted: their columns are not written
        optional = _optional_of(t)
        for number, value in zip(_OPTIONAL, optional):
            if default_only and value is number.default and number.name in default_only:
                value = _SKIP
            else:
                value = _quick_number(value, n, number, check_values)
                if value is None:
                    return None
            values.append(value)
        if default_only:  # the columns given are written from now on
            given = zip(_OPTIONAL, values[-_ALL_OPTIONAL:])
            default_only.difference_update(number.name for number, value in given if value is not _SKIP)
        return values

    def _quick_arrays(self, t: Transitions, n: int, check_values: bool) -> list[Any] | None:
        """The space leaves, reward, terminated and truncated of a batch that
        needs at most a float narrowing, checked leaf by leaf (values too with ``check_values``);
        else None."""
        obs_leaves = self.obs.quick_encode(t.obs, n, check_values)
        action_leaves = self.action.quick_encode(t.action, n, check_values)
        next_obs_leaves = self.next_obs.quick_encode(t.next_obs, n, check_values)
        if obs_leaves is None or action_leaves is None or next_obs_leaves is None:
            return None
        reward = _quick_number(t.reward, n, _REWARD, check_values)
        terminated = _quick_number(t.terminated, n, _TERMINATED, check_values)
        truncated = _quick_number(t.truncated, n, _TRUNCATED, check_values)
        if reward is None or terminated is None or truncated is None:
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

    def checked_rows(self, t: Transitions) -> list[np.ndarray]:
        """The values to write as ``(n, ...)`` arrays (the order of ``_write_columns``): converted
        where lossless, checked against the spaces, with errors that name the field, the expected
        space and the row (and its env_id)."""
        reward = np.asarray(t.reward)
        if reward.ndim != 1:
            raise ValueError(f"reward: expected a 1-D batch (leading dim = batch), got shape {reward.shape}")
        n = reward.shape[0]
        env_ids = _ENV_ID.column(t.env_id, n)

        def row_label(row: int) -> str:
            return f"row {row}" if env_ids[row] < 0 else f"row {row} (env_id {env_ids[row]})"

        values = []
        for codec, value in ((self.obs, t.obs), (self.action, t.action), (self.next_obs, t.next_obs)):
            values += codec.encode(value, n, row_label)
        for number in _KEPT:
            values.append(env_ids if number is _ENV_ID else number.column(getattr(t, number.name), n))
        self._default_only.clear()  # every column is written (only once the batch is known good)
        return values

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
