"""Starting and stopping, shared by every room: ``with obj:`` closes it, a lock an interrupt left held is released,
and a command line's Ctrl-C never lands where it would leave a lock held."""

from __future__ import annotations

import _thread
import abc
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any, Self

__all__ = ["ClosesOnExit", "interrupts_outside_locks", "release_if_held"]

# Where a KeyboardInterrupt leaves a lock held: a `with condition:` whose lock was taken but whose block (which
# releases it) has not started, or whose release has not run yet. Both are Python code (threading.py).
_LOCK_WINDOWS = frozenset({threading.Condition.__enter__.__code__, threading.Condition.__exit__.__code__})
REDELIVER_AFTER_S = 0.01


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


@contextlib.contextmanager
def interrupts_outside_locks(report_after_s: float | None = 20.0) -> Iterator[None]:
    """Ctrl-C (SIGINT) raises ``KeyboardInterrupt`` as Python's default handler does, except while the main thread
    is between taking a condition's lock and entering the ``with`` block that releases it (or inside that release):
    there it is delivered again ``REDELIVER_AFTER_S`` later. Without this, a Ctrl-C landing there leaves the lock
    held, and a collector or batching thread that takes it next waits forever, so stopping waits out every timeout.

    A stop still running ``report_after_s`` seconds after the first Ctrl-C prints where each thread is (to
    stderr), so a slow stop says why. Installed only from the main thread over Python's default handler (a handler
    of the caller's stays); the previous handler is restored at the end.

    Example:
        >>> condition = threading.Condition()
        >>> with interrupts_outside_locks():
        ...     with condition:  # a Ctrl-C raises KeyboardInterrupt here, never as the lock is taken or given back
        ...         condition.notify_all()
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    finished = threading.Event()
    first = threading.Event()

    def _interrupt(signum: int, frame: FrameType | None) -> None:
        if frame is not None and frame.f_code in _LOCK_WINDOWS and frame.f_locals["self"]._is_owned():
            # (not owned: still waiting for the lock, or given back; the interrupt then leaves nothing held)
            _thread.start_new_thread(_redeliver, ())  # no Python lock taken here: the frame may hold one
            return
        if report_after_s is not None and not first.is_set():
            first.set()
            _thread.start_new_thread(_report_if_still_stopping, (report_after_s, finished))
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, _interrupt)
    try:
        yield
    finally:
        finished.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _redeliver() -> None:
    time.sleep(REDELIVER_AFTER_S)
    os.kill(os.getpid(), signal.SIGINT)


def _report_if_still_stopping(after_s: float, finished: threading.Event) -> None:
    if not finished.wait(after_s):
        print(f"\nstill stopping {after_s:g} s after Ctrl-C; where each thread is:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
