"""Column allocation (RAM or ``.npy`` memmaps), the commit log, atomic JSON and a directory lock."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

ColumnSpec = dict[str, tuple[tuple[int, ...], np.dtype]]


def allocate(specs: ColumnSpec, directory: Path | None) -> dict[str, np.ndarray]:
    """Zeroed columns in RAM, or ``.npy`` memmaps in ``directory`` (opened if they exist).

    Memmapped columns are returned as plain ndarray views of the mapping (slicing an
    ``np.memmap`` costs several microseconds more); flush them with :func:`flush`.
    """
    if directory is None:
        return {name: np.zeros(shape, dtype) for name, (shape, dtype) in specs.items()}
    columns = {}
    for name, (shape, dtype) in specs.items():
        path = directory / f"{name}.npy"
        if path.exists():
            column = np.lib.format.open_memmap(path, mode="r+")
            if column.shape != shape or column.dtype != dtype:
                raise ValueError(
                    f"{path}: holds shape {column.shape} dtype {column.dtype}, expected shape "
                    f"{shape} dtype {dtype}; the directory belongs to a buffer with another layout"
                )
        else:
            column = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
        columns[name] = column.view(np.ndarray)
    return columns


def flush(column: np.ndarray) -> None:
    """msync a column made by :func:`allocate` (a no-op for RAM columns)."""
    base = column.base
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if isinstance(base, np.memmap):
        base.flush()


def describe(specs: ColumnSpec) -> dict[str, Any]:
    """A JSON-friendly description of column shapes and dtypes."""
    return {name: {"shape": list(shape), "dtype": np.dtype(dtype).str} for name, (shape, dtype) in specs.items()}


def write_json_atomic(path: Path, payload: dict[str, Any], fsync: bool) -> None:
    """Write ``payload`` to ``path`` so readers see the old or the new file, never a mix.

    The new content goes to a temporary file that replaces ``path`` with ``os.replace``
    (atomic on POSIX). With ``fsync`` the file and its directory are also synced, so the
    header survives power loss, not only a killed process.
    """
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as file:
        json.dump(payload, file)
        if fsync:
            file.flush()
            os.fsync(file.fileno())
    os.replace(tmp, path)
    if fsync:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as file:
        return json.load(file)


class DirectoryLock:
    """An exclusive ``flock`` on ``directory/lock``; the kernel drops it when the holder dies."""

    def __init__(self, directory: Path) -> None:
        self._file = open(directory / "lock", "a+")  # noqa: SIM115 - held until release()
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise RuntimeError(
                f"storage_dir {directory} is already open in another buffer or process; close that one first"
            ) from None

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()


class CommitRecord(NamedTuple):
    """What a commit makes durable: samples with serials ``oldest <= s < end``."""

    seq: int
    oldest: int
    end: int
    max_priority: float


class CommitLog:
    """Two alternating checksummed commit records in a small memmapped file.

    A commit writes record ``seq`` into slot ``seq % 2`` with a CRC32 over its fields; a
    reader takes the valid record with the highest ``seq``. A process killed in the middle
    of writing a record leaves a bad checksum in that slot and the previous commit intact
    in the other, so a commit is atomic without a rename and costs one small memcpy (the
    mapped page is in the kernel page cache the moment it is written).
    """

    _FORMAT = struct.Struct("<QqqdI")  # seq, oldest, end, max_priority, crc32
    _SLOT = 64

    def __init__(self, path: Path) -> None:
        if not path.exists():
            with open(path, "wb") as file:
                file.write(bytes(2 * self._SLOT))
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r+", shape=(2 * self._SLOT,))
        self._map = self._mmap.view(np.ndarray)
        last = self.read()
        self._seq = 0 if last is None else last.seq

    def read(self) -> CommitRecord | None:
        """The latest intact record, or None if nothing was ever committed."""
        best = None
        for slot in range(2):
            raw = self._map[slot * self._SLOT : slot * self._SLOT + self._FORMAT.size].tobytes()
            seq, oldest, end, max_priority, crc = self._FORMAT.unpack(raw)
            if seq and crc == zlib.crc32(raw[:-4]) and (best is None or seq > best.seq):
                best = CommitRecord(seq, oldest, end, max_priority)
        return best

    def write(self, oldest: int, end: int, max_priority: float, fsync: bool) -> None:
        """Commit a new record; with ``fsync`` it is also on disk when this returns."""
        self._seq += 1
        fields = self._FORMAT.pack(self._seq, oldest, end, max_priority, 0)[:-4]
        record = fields + struct.pack("<I", zlib.crc32(fields))
        offset = (self._seq % 2) * self._SLOT
        self._map[offset : offset + len(record)] = np.frombuffer(record, dtype=np.uint8)
        if fsync:
            self._mmap.flush()

    def close(self) -> None:
        self._mmap.flush()
        del self._map, self._mmap
