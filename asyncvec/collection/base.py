"""``BackgroundCollector``: the background loop every collector stands on, and its one error type.

A collector runs its loop (``_loop``) in a daemon thread: each collector's own ``start`` (its
arguments differ) starts it through ``_start_thread``, which refuses a second start;
:meth:`~BackgroundCollector.stop` ends the loop and joins the thread,
and an error of the loop (or of a callback that reports it with ``_fail``) is re-raised in the
learner by :meth:`~BackgroundCollector.check` as a :class:`CollectorError` with the original
chained as ``__cause__``. Subclasses keep only what differs: what one pass of the loop does and
where its results go.
"""

from __future__ import annotations

import abc
import threading
from typing import Any, TypeVar

from asyncvec.lifecycle import release_if_held

__all__ = ["BackgroundCollector", "CollectorError"]

_Collector = TypeVar("_Collector", bound="BackgroundCollector")


class CollectorError(RuntimeError):
    """The collector thread stopped on an error (the original is chained as ``__cause__``)."""


class BackgroundCollector(abc.ABC):
    """A loop in a background thread with one way to start, stop and surface errors.

    Subclasses implement ``_loop(*args)`` (run until ``self._stopping`` is set) and may override
    the hooks ``_wake`` (end the loop's current wait: called on stop and on failure),
    ``_on_failure`` (e.g. close a sink a learner waits on) and ``_loop_ended`` (clean up after
    the loop, error or not). ``self._cond`` guards the error and wakes waiters on stop and failure.

    Class attributes:
        thread_name: the thread's name.
        failure_message: how :meth:`check` starts its message.
        stop_timeout_s: what :meth:`stop` waits when given no timeout.

    Example:
        >>> class Counter(BackgroundCollector):
        ...     count = 0
        ...     def _loop(self, limit):
        ...         while not self._stopping.wait(0.001):
        ...             self.count += 1
        ...             if self.count == limit:
        ...                 raise ValueError("enough")
        >>> counter = Counter()
        >>> counter._start_thread(3)
        >>> counter._thread.join(10)
        >>> try:
        ...     counter.check()
        ... except CollectorError as error:
        ...     print(error, "| cause:", repr(error.__cause__))
        the collector stopped: ValueError: enough | cause: ValueError('enough')
        >>> counter.stop(); counter.running
        False
    """

    thread_name = "asyncvec-collector"
    failure_message = "the collector stopped"
    stop_timeout_s = 30.0

    def __init__(self) -> None:
        self._stopping = threading.Event()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ control
    def _refuse_second_start(self) -> None:
        """A :class:`CollectorError` once the thread was started (call it before preparing a start)."""
        if self._thread is not None:
            raise CollectorError(f"{type(self).__name__} already started")

    def _start_thread(self, *args: Any) -> None:
        """Runs ``_loop(*args)`` in a new daemon thread; a second call is a :class:`CollectorError`."""
        self._refuse_second_start()
        self._thread = threading.Thread(target=self._run_loop, args=args, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ends the loop and joins its thread (``timeout`` seconds, default ``stop_timeout_s``);
        a thread still alive then is a :class:`CollectorError`."""
        timeout = self.stop_timeout_s if timeout is None else timeout
        self._stopping.set()
        release_if_held(self._cond)  # a Ctrl-C as a `with self._cond:` was entered can leave it held
        with self._cond:
            self._cond.notify_all()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise CollectorError(f"the {type(self).__name__} thread did not stop within {timeout} s")

    def stop_soon(self) -> None:
        """Asks the loop to end and returns at once (:meth:`stop` joins it later): a lockstep collector waiting for
        the learner's publish then ends at that publish, without another step (lag 0 steps no env past the
        last update, as a sync loop)."""
        self._stopping.set()

    def check(self) -> None:
        """Raises :class:`CollectorError` (the original chained) if the loop or a callback failed."""
        if self._error is not None:
            raise CollectorError(
                f"{self.failure_message}: {type(self._error).__name__}: {self._error}"
            ) from self._error

    @property
    def running(self) -> bool:
        """The thread was started and has not ended."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self: _Collector) -> _Collector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the loop
    @abc.abstractmethod
    def _loop(self, *args: Any) -> None:
        """Runs in the thread until ``self._stopping`` is set; an error it raises fails the collector."""

    def _run_loop(self, *args: Any) -> None:
        try:
            self._loop(*args)
        except BaseException as exc:  # surfaced to the learner by check()
            self._fail(exc)
        finally:
            self._loop_ended()

    def _fail(self, exc: BaseException) -> None:
        """Records the first error (re-raised by :meth:`check`) and ends the loop. Errors after
        :meth:`stop` are not recorded: stopping abandons the work in flight. Safe from any thread."""
        with self._cond:
            if self._stopping.is_set():
                return
            self._error = exc
            self._stopping.set()
            self._cond.notify_all()
        self._on_failure()
        self._wake()

    def _wake(self) -> None:
        """Ends the loop's current wait (on stop and on failure); nothing by default."""

    def _on_failure(self) -> None:
        """Runs once, after the first error is recorded; nothing by default."""

    def _loop_ended(self) -> None:
        """Runs in the thread after the loop, error or not; nothing by default."""
