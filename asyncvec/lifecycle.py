"""Starting and stopping, shared by every room: ``with obj:`` closes it, and a lock an interrupt left held is released."""

from __future__ import annotations

import abc
import threading
from typing import Any, Self

__all__ = ["ClosesOnExit", "release_if_held"]


class ClosesOnExit(abc.ABC):
    """Mixin: ``with obj:`` returns ``obj`` and calls its ``close()`` at the end, even after an error.

    Example:
        >>> class Resource(ClosesOnExit):
        ...     def close(self) -> None:
        ...         print("closed")
        >>> with Resource() as resource:
        ...     pass
        closed
    """

    @abc.abstractmethod
    def close(self) -> None:
        """Releases what the object holds; safe to call twice."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def release_if_held(condition: threading.Condition) -> None:
    """Releases ``condition``'s lock as many times as this thread holds it.

    A ``KeyboardInterrupt`` that lands as ``with condition:`` is entered (after the lock is
    taken, before the block runs: ``Condition.__enter__`` is Python code) leaves the lock held,
    and a collector thread's next ``with condition:`` then waits forever. Call it where such an
    interrupt is handled, before stopping that thread.

    Example:
        >>> condition = threading.Condition()
        >>> condition.acquire()
        True
        >>> release_if_held(condition); release_if_held(condition)  # held once: released once
        >>> condition.acquire(blocking=False)
        True
    """
    while condition._is_owned():  # its RLock: owned by this thread, not by any thread
        condition.release()
