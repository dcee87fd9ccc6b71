"""Column allocation (RAM or ``.npy`` memmaps), blob columns for compressed images, the commit
log, atomic JSON and a directory lock."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import sys
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

ColumnSpec = dict[str, tuple[tuple[int, ...], np.dtype]]
#: per blob column (object dtype), the most bytes one blob may take (its on-disk slot size)
BlobSizes = dict[str, int]
_OBJECT = np.dtype(object)


class BlobColumn:
    """A column of ``bytes`` blobs (compressed images) in two ``.npy`` memmaps.

    ``{name}.blobs.npy`` holds one fixed-size slot of ``max_bytes`` per row and
    ``{name}.lengths.npy`` each blob's length. The file is created sparse and a blob writes
    only its own bytes, so the disk holds the pages the blobs touch (page-granular), not
    ``rows * max_bytes``. Rows are indexed like a 1-D object array (``column[slots]`` returns
    an object array of ``bytes``; ``column[a:b] = blobs``), so the buffer's commit protocol is
    the one of its other columns: blob bytes and lengths are written before the commit record.
    """

    def __init__(self, directory: Path, name: str, rows: int, max_bytes: int) -> None:
        self.shape = (rows,)
        self.dtype = _OBJECT
        paths = (directory / f"{name}.blobs.npy", directory / f"{name}.lengths.npy")
        specs = (((rows, max_bytes), np.dtype(np.uint8)), ((rows,), np.dtype(np.int32)))
        maps = []
        for path, (shape, dtype) in zip(paths, specs):
            if path.exists():
                column = np.lib.format.open_memmap(path, mode="r+")
                if column.shape != shape or column.dtype != dtype:
                    raise ValueError(
                        f"{path}: holds shape {column.shape} dtype {column.dtype}, expected shape {shape} dtype "
                        f"{dtype}; the directory belongs to a buffer with another layout"
                    )
            else:
                column = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
            maps.append(column)
        self._maps = maps
        self.data, self.lengths = (column.view(np.ndarray) for column in maps)
        self.paths = paths
        packed = directory / f"{name}.packed"
        if packed.exists():  # a directory written by save(): move its blobs into the slots
            load_column(directory, name, self)
            self.flush()
            packed.unlink()
            (directory / f"{name}.offsets.npy").unlink(missing_ok=True)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        rows = np.arange(self.shape[0])[index]
        out = np.empty(np.shape(rows), dtype=object)
        flat = out.reshape(-1)
        for i, row in enumerate(np.reshape(rows, -1)):
            flat[i] = self.data[row, : self.lengths[row]].tobytes()
        return out

    def __setitem__(self, index: Any, blobs: Any) -> None:
        rows = np.reshape(np.arange(self.shape[0])[index], -1)
        values = np.broadcast_to(np.asarray(blobs, dtype=object), rows.shape)
        for row, blob in zip(rows, values):
            blob = blob if isinstance(blob, bytes) else b""
            if len(blob) > self.data.shape[1]:
                raise ValueError(f"a blob of {len(blob)} bytes does not fit a slot of {self.data.shape[1]} bytes")
            self.data[row, : len(blob)] = np.frombuffer(blob, dtype=np.uint8)
            self.lengths[row] = len(blob)

    def fill(self, value: Any) -> None:
        self.lengths[:] = 0

    def flush(self) -> None:
        for column in self._maps:
            column.flush()

    def disk_bytes(self) -> int:
        """Bytes the two files take on disk (allocated blocks: the blob file is sparse)."""
        return sum(os.stat(path).st_blocks * 512 for path in self.paths)


def allocate(specs: ColumnSpec, directory: Path | None, blob_sizes: BlobSizes | None = None) -> dict[str, Any]:
    """Zeroed columns in RAM, or ``.npy`` memmaps in ``directory`` (opened if they exist).

    Memmapped columns are returned as plain ndarray views of the mapping (slicing an
    ``np.memmap`` costs several microseconds more); flush them with :func:`flush`. Object
    columns (blobs) are object arrays in RAM and `BlobColumn` s on disk, with slots of
    ``blob_sizes[name]`` bytes.
    """
    if directory is None:
        return {name: np.zeros(shape, dtype) for name, (shape, dtype) in specs.items()}
    columns: dict[str, Any] = {}
    for name, (shape, dtype) in specs.items():
        if np.dtype(dtype) == _OBJECT:
            if blob_sizes is None or name not in blob_sizes or len(shape) != 1:
                raise ValueError(f"column {name}: an object column on disk needs a 1-D shape and a blob size")
            columns[name] = BlobColumn(directory, name, shape[0], blob_sizes[name])
            continue
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


def flush(column: Any) -> None:
    """msync a column made by :func:`allocate` (a no-op for RAM columns)."""
    if isinstance(column, BlobColumn):
        column.flush()
        return
    base = column.base
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if isinstance(base, np.memmap):
        base.flush()


def save_column(directory: Path, name: str, column: Any) -> None:
    """Write a column to ``directory``: ``{name}.npy``, or for blobs a packed
    ``{name}.packed`` (the blobs back to back) with ``{name}.offsets.npy`` (``rows + 1``)."""
    if isinstance(column, BlobColumn) or column.dtype == _OBJECT:
        blobs = column[:] if isinstance(column, BlobColumn) else column
        sizes = np.fromiter((len(b) if isinstance(b, bytes) else 0 for b in blobs), np.int64, len(blobs))
        offsets = np.concatenate(([0], np.cumsum(sizes)))
        with open(directory / f"{name}.packed", "wb") as file:
            for blob in blobs:
                if isinstance(blob, bytes):
                    file.write(blob)
        np.save(directory / f"{name}.offsets.npy", offsets)
        return
    np.save(directory / f"{name}.npy", column)


def load_column(directory: Path, name: str, column: Any) -> None:
    """Fill ``column`` from what :func:`save_column` (or a ``storage_dir``) wrote."""
    if isinstance(column, BlobColumn) or column.dtype == _OBJECT:
        if (directory / f"{name}.packed").exists():
            offsets = np.load(directory / f"{name}.offsets.npy")
            packed = (directory / f"{name}.packed").read_bytes()
            blobs = np.empty(len(offsets) - 1, dtype=object)
            for i in range(len(blobs)):
                blobs[i] = packed[offsets[i] : offsets[i + 1]]
        else:  # a storage_dir: blob slots
            lengths = np.load(directory / f"{name}.lengths.npy")
            data = np.load(directory / f"{name}.blobs.npy", mmap_mode="r")
            blobs = np.empty(len(lengths), dtype=object)
            for i, length in enumerate(lengths):
                blobs[i] = data[i, :length].tobytes()
        column[:] = blobs
        return
    column[...] = np.load(directory / f"{name}.npy", mmap_mode="r")


def column_nbytes(column: Any) -> int:
    """Bytes a column holds: its array, or for blobs the blobs plus Python's per-object
    overhead and the pointers (RAM) or the allocated blocks of its files (disk)."""
    if isinstance(column, BlobColumn):
        return column.disk_bytes()
    if column.dtype == _OBJECT:
        return column.nbytes + sum(sys.getsizeof(blob) for blob in column if isinstance(blob, bytes))
    return int(column.nbytes)


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
