"""Errors raised by the buffers. Each subclasses ``RuntimeError``, so code that caught the bare
``RuntimeError`` these used to be keeps working."""

from __future__ import annotations

__all__ = ["BufferClosedError", "NotPrioritizedError", "StorageDirInUseError"]


class BufferClosedError(RuntimeError):
    """A :class:`~asyncvec.buffers.ReplayBuffer` or :class:`~asyncvec.buffers.RolloutStore` was used
    after ``close()`` (a ``RolloutStore.get`` waiting when it closes wakes with this too)."""


class StorageDirInUseError(RuntimeError):
    """A ``storage_dir`` (or a ``save``/``load`` directory) is locked by another open buffer, in this
    process or another; the kernel drops the lock when its holder closes or dies."""


class NotPrioritizedError(RuntimeError):
    """``update_priorities`` was called on a ``ReplayBuffer`` created with ``prioritized=False``."""
