"""`DynamicBatcher`: continuous admission of independent requests, dispatched as batches."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

from asyncvec.inference.types import PolicyClosedError

T = TypeVar("T")

logger = logging.getLogger(__name__)

# Safety factor of the adaptive rule: provision 25% more capacity than the arrivals need.
ADAPTIVE_HEADROOM = 1.25


def fit_batch_cost(sizes: list[int] | np.ndarray, seconds: list[float] | np.ndarray) -> tuple[float, float]:
    """Least-squares fit of ``seconds ≈ a + b * size`` over recent backend calls.

    Both coefficients are clamped at 0. With fewer than two distinct sizes the slope cannot
    be identified, so ``b = 0`` and ``a`` is the mean duration.

    Example:
        >>> a, b = fit_batch_cost([1, 2, 4], [0.051, 0.052, 0.054])
        >>> round(a, 3), round(b, 3)
        (0.05, 0.001)
    """
    x = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.size == 0:
        return 0.0, 0.0
    if np.unique(x).size < 2:
        return max(float(y.mean()), 0.0), 0.0
    b, a = np.polyfit(x, y, 1)
    if b < 0:  # noisy timings: a flat cost model is the best non-negative fit
        return max(float(y.mean()), 0.0), 0.0
    if a < 0:  # cost through the origin
        return 0.0, float(np.dot(x, y) / np.dot(x, x))
    return float(a), float(b)


def adaptive_threshold(
    arrival_rate: float,
    a_s: float,
    b_s: float,
    max_inflight_batches: int,
    max_batch_size: int,
    headroom: float = ADAPTIVE_HEADROOM,
) -> int:
    """Smallest batch size that keeps up with the arrivals, with headroom.

    ``k`` concurrent batches of size ``B`` that each take ``a + b·B`` seconds serve
    ``k·B / (a + b·B)`` requests per second. Requiring that to be at least ``h·λ`` (arrival
    rate λ, headroom h) gives ``B ≥ h·λ·a / (k − h·λ·b)``. A larger threshold would only add
    waiting, a smaller one would let the queue grow. When ``k ≤ h·λ·b`` no batch size keeps up
    and the answer is ``max_batch_size``.

    Example:
        >>> adaptive_threshold(arrival_rate=200.0, a_s=0.05, b_s=0.001, max_inflight_batches=1,
        ...                    max_batch_size=64)
        17
    """
    if arrival_rate <= 0.0:
        return 1
    spare = max_inflight_batches - headroom * arrival_rate * b_s
    if spare <= 0.0:
        return max_batch_size
    need = headroom * arrival_rate * a_s / spare
    return int(min(max(math.ceil(need), 1), max_batch_size))


class DynamicBatcher(Generic[T]):
    """Groups requests that arrive independently into batches for a handler.

    ``put`` admits requests at any time (from any thread). ``max_inflight_batches`` worker
    threads each take a batch when one is ready and call ``handler(batch)``:

    * a batch is ready when ``threshold`` requests wait (``max_batch_size`` in static mode)
      or ``max_wait_ms`` has passed since the oldest waiting request arrived. Time spent
      while every worker was busy does not count: the wait runs from the later of the
      arrival and the moment a worker became free. Otherwise, when envs resubmit right after
      their answers (a closed loop), requests that queued behind a busy backend would leave
      at once in a small batch and split the envs into two alternating half-size cohorts;
    * a batch holds up to ``max_batch_size`` requests, highest ``priority`` first and, within
      a priority, oldest first;
    * while all workers are busy, requests keep queueing, so under load batches come out full;
    * a hold (``hold_ms > 0``, off by default): a batch of fewer than ``hold_below`` requests
      leaves no earlier than ``hold_ms`` after its oldest request arrived (or as soon as
      ``hold_below`` requests wait; a queue at the dispatch threshold leaves at once, hold or
      not). When a call's fixed cost dominates (``a`` much larger
      than ``b``), a call of one spends a whole call slot on one request; holding it a few
      milliseconds for a second one halves that cost per request, and leaves slots free for
      the bursts. Every request still leaves within ``max(hold_ms, max_wait_ms)`` of the
      later of its arrival and a worker becoming free.

    Adaptive mode (``adaptive=True``) measures each handler call, fits the fixed cost ``a``
    and per-item cost ``b`` by least squares over the last ``fit_window`` calls
    (`fit_batch_cost`), estimates the arrival rate λ over recent arrivals, and sets the
    threshold to the smallest batch that keeps up with λ with 25% headroom
    (`adaptive_threshold`): ``B* = ceil(1.25·λ·a / (k − 1.25·λ·b))``, clamped to
    ``[1, max_batch_size]``. Until the first call is measured the threshold is
    ``max_batch_size``. ``max_wait_ms`` still bounds every wait.

    If the handler returns a number, it is taken as the backend seconds of the call (so time
    spent in retries' back-off does not distort the fit); otherwise the call's wall time is
    used. ``drop_if(item)`` (optional) discards items when a batch is formed, e.g. requests
    already answered by a deadline fallback.

    Example:
        >>> import queue
        >>> batches = queue.Queue()
        >>> batcher = DynamicBatcher(batches.put, max_batch_size=4, max_wait_ms=1000)
        >>> for i in range(4):
        ...     batcher.put(i)
        >>> batches.get(timeout=10)
        [0, 1, 2, 3]
        >>> batcher.close()
        []
    """

    def __init__(
        self,
        handler: Callable[[list[T]], float | None],
        *,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        max_inflight_batches: int = 1,
        adaptive: bool = False,
        drop_if: Callable[[T], bool] | None = None,
        fit_window: int = 64,
        hold_ms: float = 0.0,
        hold_below: int = 2,
        name: str = "asyncvec-batcher",
    ) -> None:
        if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if not isinstance(max_inflight_batches, int) or max_inflight_batches < 1:
            raise ValueError(f"max_inflight_batches must be an int >= 1, got {max_inflight_batches!r}")
        if not isinstance(max_wait_ms, (int, float)) or not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be a number >= 0, got {max_wait_ms!r}")
        if not isinstance(fit_window, int) or fit_window < 2:
            raise ValueError(f"fit_window must be an int >= 2, got {fit_window!r}")
        if isinstance(hold_ms, bool) or not isinstance(hold_ms, (int, float)) or not hold_ms >= 0:
            raise ValueError(f"hold_ms must be a number >= 0, got {hold_ms!r}")
        if isinstance(hold_below, bool) or not isinstance(hold_below, int) or hold_below < 1:
            raise ValueError(f"hold_below must be an int >= 1, got {hold_below!r}")
        self._handler = handler
        self.max_batch_size = max_batch_size
        self.max_wait_s = float(max_wait_ms) / 1000.0
        self.max_inflight_batches = max_inflight_batches
        self.adaptive = bool(adaptive)
        self.hold_s = float(hold_ms) / 1000.0
        self.hold_below = hold_below
        self._drop_if = drop_if
        self._name = name
        self._cond = threading.Condition()
        # entries: (-priority, sequence number, arrival time, item)
        self._heap: list[tuple[int, int, float, T]] = []
        self._seq = itertools.count()
        self._closed = False
        self._workers: list[threading.Thread] = []
        self._inflight = 0
        self._arrivals: deque[float] = deque(maxlen=max(4 * max_batch_size, 32))
        self._timings: deque[tuple[int, float]] = deque(maxlen=fit_window)
        self._fit: tuple[float, float] | None = None
        self._batches = 0
        self._items = 0
        self._dropped = 0
        self._handler_errors = 0

    # ----------------------------------------------------------------------------- admission
    def put(self, item: T, priority: int = 0) -> None:
        """Admit one request; higher ``priority`` is dispatched first.

        Raises:
            PolicyClosedError: after `close`.
        """
        now = time.monotonic()
        with self._cond:
            if self._closed:
                raise PolicyClosedError("the batcher is closed; no new requests are accepted")
            if not self._workers:
                self._start_workers()
            heapq.heappush(self._heap, (-int(priority), next(self._seq), now, item))
            self._arrivals.append(now)
            self._cond.notify()

    def _start_workers(self) -> None:
        for index in range(self.max_inflight_batches):
            worker = threading.Thread(target=self._worker_loop, name=f"{self._name}-{index}", daemon=True)
            worker.start()
            self._workers.append(worker)

    # ------------------------------------------------------------------------------ dispatch
    @property
    def threshold(self) -> int:
        """Queue length at which a batch is dispatched without waiting for ``max_wait_ms``."""
        with self._cond:
            return self._threshold_locked(time.monotonic())

    def _threshold_locked(self, now: float) -> int:
        if not self.adaptive or self._fit is None:
            return self.max_batch_size
        a_s, b_s = self._fit
        return adaptive_threshold(
            self._arrival_rate_locked(now), a_s, b_s, self.max_inflight_batches, self.max_batch_size
        )

    def _arrival_rate_locked(self, now: float) -> float:
        # Counting up to "now" (not the last arrival) lets the estimate decay when traffic stops.
        if len(self._arrivals) < 2:
            return 0.0
        span = now - self._arrivals[0]
        return len(self._arrivals) / span if span > 0 else 0.0

    def _wait_for_batch_locked(self, free_since: float) -> list[T] | None:
        while True:
            if self._closed:
                return None
            if not self._heap:
                self._cond.wait()
                continue
            now = time.monotonic()
            waiting = len(self._heap)
            if waiting < self._threshold_locked(now):
                # The batching wait starts when the request arrived or this worker became free,
                # whichever is later: waiting for a busy backend is not waiting for a batch.
                oldest = min(entry[2] for entry in self._heap)
                ready_at = max(oldest, free_since) + self.max_wait_s
                if waiting < self.hold_below:  # a small batch: hold it for more (hold_ms)
                    ready_at = max(ready_at, oldest + self.hold_s)
                remaining = ready_at - now
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
            batch = self._pop_batch_locked()
            if batch:
                return batch

    def _pop_batch_locked(self) -> list[T]:
        batch: list[T] = []
        while self._heap and len(batch) < self.max_batch_size:
            item = heapq.heappop(self._heap)[3]
            if self._drop_if is not None and self._drop_if(item):
                self._dropped += 1
                continue
            batch.append(item)
        return batch

    def _worker_loop(self) -> None:
        free_since = time.monotonic()
        while True:
            with self._cond:
                batch = self._wait_for_batch_locked(free_since)
                if batch is None:
                    return
                self._inflight += 1
                self._batches += 1
                self._items += len(batch)
                if self._heap:
                    self._cond.notify()  # an idle worker may form the next batch at once
            started = time.perf_counter()
            measured: float | None = None
            try:
                measured = self._handler(batch)
            except Exception:  # the handler owns error delivery; a bug must not kill the worker
                logger.exception("%s: batch handler raised", self._name)
                with self._cond:
                    self._handler_errors += 1
            elapsed = time.perf_counter() - started
            with self._cond:
                free_since = time.monotonic()
                self._inflight -= 1
                if isinstance(measured, (int, float)) and not isinstance(measured, bool):
                    self._timings.append((len(batch), float(measured)))
                else:
                    self._timings.append((len(batch), elapsed))
                if self.adaptive:
                    sizes, seconds = zip(*self._timings, strict=True)
                    self._fit = fit_batch_cost(list(sizes), list(seconds))

    # ------------------------------------------------------------------------------ shutdown
    def close(self, timeout: float = 10.0) -> list[T]:
        """Stop the workers (after their current batch) and return the undispatched items.

        Waits at most ``timeout`` seconds in total for in-flight batches; workers still busy
        after that are daemon threads and are reported in the log.
        """
        with self._cond:
            self._closed = True
            leftover = [entry[3] for entry in sorted(self._heap)]
            self._heap.clear()
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for worker in self._workers:
            worker.join(max(deadline - time.monotonic(), 0.0))
            if worker.is_alive():
                logger.warning("%s: worker %s still busy after close(timeout=%s)", self._name, worker.name, timeout)
        return leftover

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    # --------------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, float]:
        """Counters: batches, items, mean batch size, queue depth, in-flight batches, fit."""
        with self._cond:
            now = time.monotonic()
            a_s, b_s = self._fit if self._fit is not None else (float("nan"), float("nan"))
            return {
                "batches": self._batches,
                "batched_items": self._items,
                "mean_batch_size": self._items / self._batches if self._batches else 0.0,
                "queue_depth": len(self._heap),
                "inflight_batches": self._inflight,
                "dropped_before_dispatch": self._dropped,
                "handler_errors": self._handler_errors,
                "batch_threshold": self._threshold_locked(now),
                "arrival_rate_hz": self._arrival_rate_locked(now),
                "fit_a_ms": a_s * 1000.0,
                "fit_b_ms": b_s * 1000.0,
            }

    def fitted_cost(self) -> tuple[float, float] | None:
        """The current ``(a, b)`` fit in seconds (adaptive mode), or None before any call."""
        with self._cond:
            return self._fit
