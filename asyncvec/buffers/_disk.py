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

from asyncvec.buffers.errors import StorageDirInUseError

ColumnSpec = dict[str, tuple[tuple[int, ...], np.dtype]]
_OBJECT = np.dtype(object)


class BlobColumn:
    """A column of ``bytes`` blobs (compressed images) on disk, in append-only segment files.

    The blob of the transition with serial ``s`` (the ``s``-th ever added) is appended to
    ``{name}.seg{s // segment_rows}``; ``{name}.index.npy`` (a memmap, one row per slot) holds
    its segment, offset and length. A segment file is deleted once every transition in it has
    left the ring (:meth:`drop_before`), so the disk holds the live blobs plus at most one
    segment of older ones: ``segment_rows`` is an eighth of the capacity.

    Crash safety is the buffer's protocol: an add appends the blobs and writes their index
    rows before the commit record covers them, and a segment is dropped only when no commit
    covers it. Bytes a killed process appended past its last commit are never indexed by a
    commit and are skipped. Rows are indexed like a 1-D object array: ``column[slots]`` returns
    an object array of ``bytes``; ``column[a:b] = blobs`` appends blobs for the next serials
    (set :attr:`next_serial` before an add's writes).
    """

    def __init__(self, directory: Path, name: str, rows: int) -> None:
        self.shape = (rows,)
        self.dtype = _OBJECT
        self.directory = directory
        self.name = name
        self.segment_rows = max(1, rows // 8)
        self.next_serial = 0
        path = directory / f"{name}.index.npy"
        if path.exists():
            index = np.lib.format.open_memmap(path, mode="r+")
            if index.shape != (rows, 3) or index.dtype != np.int64:
                raise ValueError(
                    f"{path}: holds shape {index.shape} dtype {index.dtype}, expected shape {(rows, 3)} dtype "
                    f"int64; the directory belongs to a buffer with another layout"
                )
        else:
            index = np.lib.format.open_memmap(path, mode="w+", dtype=np.int64, shape=(rows, 3))
            index[:, 0] = -1  # segment -1: an empty slot
        self._map = index
        self.index = index.view(np.ndarray)
        self._files: dict[int, int] = {}  # segment -> open file descriptor

    def _segment_path(self, segment: int) -> Path:
        return self.directory / f"{self.name}.seg{segment:010d}"

    def _fd(self, segment: int, create: bool = True) -> int | None:
        fd = self._files.get(segment)
        if fd is None:
            path = self._segment_path(segment)
            if not create and not path.exists():
                return None  # a dropped segment: its slots hold no live sample
            fd = self._files[segment] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        return fd

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        rows = np.arange(self.shape[0])[index]
        out = np.empty(np.shape(rows), dtype=object)
        flat = out.reshape(-1)
        for i, (segment, offset, length) in enumerate(self.index[np.reshape(rows, -1)].tolist()):
            fd = None if segment < 0 else self._fd(segment, create=False)
            flat[i] = b"" if fd is None else os.pread(fd, length, offset)
        return out

    def __setitem__(self, index: Any, blobs: Any) -> None:
        rows = np.reshape(np.arange(self.shape[0])[index], -1)
        serials = np.arange(self.next_serial, self.next_serial + rows.size)
        self.write_rows(rows, np.broadcast_to(np.asarray(blobs, dtype=object), rows.shape), serials)
        self.next_serial += rows.size

    def write_rows(self, rows: np.ndarray, blobs: np.ndarray, serials: np.ndarray) -> None:
        """Append each blob to its serial's segment and index it at its row."""
        for row, blob, serial in zip(rows.tolist(), blobs, serials.tolist()):
            blob = blob if isinstance(blob, bytes) else b""
            segment = serial // self.segment_rows
            fd = self._fd(segment)
            assert fd is not None
            offset = os.lseek(fd, 0, os.SEEK_END)
            os.write(fd, blob)
            self.index[row] = (segment, offset, len(blob))

    def drop_before(self, serial: int) -> None:
        """Delete the segments whose transitions all have serials below ``serial``."""
        last = serial // self.segment_rows  # segments < last hold only older serials
        for path in self.directory.glob(f"{self.name}.seg*"):
            segment = int(path.name.rsplit(".seg", 1)[1])
            if segment < last:
                fd = self._files.pop(segment, None)
                if fd is not None:
                    os.close(fd)
                path.unlink(missing_ok=True)

    def fill(self, value: Any) -> None:
        self.index[:, 0] = -1

    def flush(self) -> None:
        """fsync the segments written to and msync the index."""
        for fd in self._files.values():
            os.fsync(fd)
        self._map.flush()

    def close(self) -> None:
        self._map.flush()
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def disk_bytes(self) -> int:
        """Bytes the index and the segment files take on disk (allocated blocks)."""
        paths = [self.directory / f"{self.name}.index.npy", *self.directory.glob(f"{self.name}.seg*")]
        return sum(os.stat(path).st_blocks * 512 for path in paths)


def allocate(specs: ColumnSpec, directory: Path | None) -> dict[str, Any]:
    """Zeroed columns in RAM, or ``.npy`` memmaps in ``directory`` (opened if they exist).

    Memmapped columns are returned as plain ndarray views of the mapping (slicing an
    ``np.memmap`` costs several microseconds more); flush them with :func:`flush`. Object
    columns (blobs) are object arrays in RAM and `BlobColumn` s on disk.
    """
    if directory is None:
        return {name: np.zeros(shape, dtype) for name, (shape, dtype) in specs.items()}
    columns: dict[str, Any] = {}
    for name, (shape, dtype) in specs.items():
        if np.dtype(dtype) == _OBJECT:
            if len(shape) != 1:
                raise ValueError(f"column {name}: an object column on disk must be 1-D, got shape {shape}")
            columns[name] = BlobColumn(directory, name, shape[0])
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
        else:  # a storage_dir: read its segments
            live = BlobColumn(directory, name, len(column))
            blobs = live[:]
            live.close()
        column[:] = blobs
        return
    column[...] = np.load(directory / f"{name}.npy", mmap_mode="r")


def column_nbytes(column: Any) -> int:
    """Bytes a column holds: its array, or for blobs the blobs plus Python's per-object
    overhead and the pointers (RAM) or the allocated blocks of its files (disk)."""
    if isinstance(column, BlobColumn):
        return column.disk_bytes()
    if column.dtype == _OBJECT:
        return int(column.nbytes) + sum(sys.getsizeof(blob) for blob in column if isinstance(blob, bytes))
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
        data: dict[str, Any] = json.load(file)
    return data


class DirectoryLock:
    """An exclusive ``flock`` on ``directory/lock``; the kernel drops it when the holder dies."""

    def __init__(self, directory: Path) -> None:
        self._file = open(directory / "lock", "a+")  # noqa: SIM115 - held until release()
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise StorageDirInUseError(
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
