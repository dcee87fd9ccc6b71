"""Policy versions, the max-lag gate and staleness statistics (stdlib only).

The learner owns a :class:`VersionManager`. Every ``publish(weights)`` bumps a
monotonically increasing integer version and hands the weights to every registered
backend. Collectors stamp each sample with the version that produced it and ask the
manager whether that version is still fresh enough (``admit``), or wait until it is
(``wait_for_lag``). The :class:`~asyncvec.collection.Collector` applies ``within_lag`` to an
action's version immediately before sending it to its env, drops a stale one
(``record_dropped``) and asks again (the max-lag rule, docs/agents.md).

Sharing across processes: the version counter, the closed flag, the staleness histogram
and the drop counter live in ``multiprocessing`` shared memory (``Value``/``Array``) guarded
by one ``multiprocessing.Condition``. Hand the manager to a child process as a
``Process`` argument (inheritance; ``spawn``, ``fork`` and ``forkserver`` all work). The
child sees the same version, can wait on it and records into the same statistics.
Registered backends are per process: a child's copy starts with none.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.context
import operator
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from asyncvec.lifecycle import ClosesOnExit

__all__ = [
    "StalenessStats",
    "VersionManager",
    "VersionManagerClosedError",
    "WeightsBackend",
    "adapt_max_staleness",
    "per_token_versions",
    "with_lag",
]

VersionSource = int | Callable[[], int]


class VersionManagerClosedError(RuntimeError):
    """A :class:`VersionManager` was used after ``close()``."""


class WeightsBackend(Protocol):
    """Anything that can load a new set of policy weights."""

    def load_weights(self, weights: Any, version: int) -> None:
        """Replace the weights in use and remember their version."""


@dataclass(frozen=True)
class StalenessStats:
    """Snapshot of the staleness statistics.

    Attributes:
        count: number of recorded samples.
        mean: mean staleness (0.0 when nothing was recorded).
        max: largest recorded staleness (0 when nothing was recorded).
        histogram: ``histogram[s]`` counts samples with staleness ``s``; the last bin counts
            every staleness ``>= len(histogram) - 1``.
        dropped: samples rejected by the max-lag gate.
    """

    count: int
    mean: float
    max: int
    histogram: list[int]
    dropped: int


class VersionManager(ClosesOnExit):
    """Monotonic policy version with a max-lag gate, shareable with child processes.

    Args:
        initial_version: the version before the first ``publish``.
        max_lag: largest allowed ``current_version - version_in_use``; ``None`` disables the
            gate.
        on_lag: what ``admit`` does with a too-stale version: ``"wait"`` blocks until the
            version in use catches up (or the timeout passes), ``"drop"`` rejects at once.
        histogram_bins: number of staleness histogram bins (the last one is open-ended).
        poll_interval: how often a waiter re-reads a callable version source, in seconds.
            Publishing and ``close()`` wake waiters at once regardless.
        mp_context: ``multiprocessing`` context used to create the shared state; the
            default context when ``None``.

    Example:
        >>> class Backend:
        ...     def load_weights(self, weights, version):
        ...         self.weights, self.version = weights, version
        >>> vm = VersionManager(max_lag=1, on_lag="drop")
        >>> backend = Backend()
        >>> vm.register(backend)
        >>> vm.publish({"w": 1.0}), backend.version
        (1, 1)
        >>> vm.publish({"w": 2.0})
        2
        >>> vm.admit(1), vm.admit(0)
        (True, False)
        >>> vm.record_staleness([0, 1, 1])
        >>> vm.staleness_stats().mean, vm.staleness_stats().dropped
        (0.6666666666666666, 1)
        >>> vm.close()
    """

    def __init__(
        self,
        initial_version: int = 0,
        *,
        max_lag: int | None = None,
        on_lag: Literal["wait", "drop"] = "wait",
        histogram_bins: int = 32,
        poll_interval: float = 0.005,
        mp_context: multiprocessing.context.BaseContext | None = None,
    ) -> None:
        initial_version = _check_int("initial_version", initial_version, minimum=0)
        if max_lag is not None:
            max_lag = _check_int("max_lag", max_lag, minimum=0)
        if on_lag not in ("wait", "drop"):
            raise ValueError(f"on_lag: expected 'wait' or 'drop', got {on_lag!r}")
        histogram_bins = _check_int("histogram_bins", histogram_bins, minimum=2)
        if not poll_interval > 0:
            raise ValueError(f"poll_interval: expected a positive number, got {poll_interval!r}")
        ctx = mp_context if mp_context is not None else multiprocessing.get_context()
        self.max_lag = max_lag
        self.on_lag = on_lag
        self.poll_interval = float(poll_interval)
        # One condition guards every shared value below; lock=False avoids a second lock each.
        self._cond = ctx.Condition(ctx.Lock())
        self._version = ctx.Value("q", initial_version, lock=False)
        self._closed = ctx.Value("b", 0, lock=False)
        self._histogram = ctx.Array("q", histogram_bins, lock=False)
        self._stale_sum = ctx.Value("q", 0, lock=False)
        self._stale_max = ctx.Value("q", 0, lock=False)
        self._dropped = ctx.Value("q", 0, lock=False)
        # Serializes publishers (also across processes) while backends load weights.
        self._publish_lock = ctx.Lock()
        self._backends: list[WeightsBackend] = []
        self._backends_lock = threading.Lock()

    # -- pickling: only the shared state travels to a child process ----------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_backends"] = []
        del state["_backends_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._backends_lock = threading.Lock()

    # -- versions ---------------------------------------------------------------------------
    @property
    def current_version(self) -> int:
        """The latest published version."""
        with self._cond:
            return int(self._version.value)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (in any process)."""
        with self._cond:
            return bool(self._closed.value)

    def register(self, backend: WeightsBackend) -> None:
        """Hand every future ``publish`` to ``backend.load_weights(weights, version)``."""
        if not callable(getattr(backend, "load_weights", None)):
            raise TypeError(
                f"backend: expected an object with a load_weights(weights, version) method, "
                f"got {type(backend).__name__}"
            )
        with self._backends_lock:
            self._backends.append(backend)

    def unregister(self, backend: WeightsBackend) -> None:
        """Stop handing weights to ``backend``."""
        with self._backends_lock:
            self._backends.remove(backend)

    def publish(self, weights: Any, version: int | None = None) -> int:
        """Load ``weights`` into every registered backend, then bump and return the version.

        Backends receive the new version before waiters see it, so a collector woken by the
        new version finds its backend already updated. ``version``: publish as this version
        instead of the next one (a resumed run goes on with its checkpoint's version in one
        publish); it must be greater than the current one.

        Raises:
            ValueError: ``version`` is not greater than the current version.
            RuntimeError: the manager is closed.
            Exception: whatever a backend's ``load_weights`` raises. The version is bumped
                anyway: earlier backends may hold these weights, and a version number must
                never name two different sets of weights.
        """
        with self._publish_lock:
            with self._cond:
                self._raise_if_closed()
                new_version = int(self._version.value) + 1
                if version is not None:
                    version = _check_int("version", version, minimum=new_version)
                    new_version = version
            with self._backends_lock:
                backends = list(self._backends)
            try:
                for backend in backends:
                    backend.load_weights(weights, new_version)
            finally:
                with self._cond:
                    self._version.value = new_version
                    self._cond.notify_all()
        return new_version

    # -- the max-lag gate -------------------------------------------------------------------
    def lag(self, version_in_use: int) -> int:
        """``current_version - version_in_use``."""
        return self.current_version - _check_int("version_in_use", version_in_use, minimum=0)

    def within_lag(self, version_in_use: int) -> bool:
        """Whether ``version_in_use`` passes the gate now (always true without ``max_lag``)."""
        return self.max_lag is None or self.lag(version_in_use) <= self.max_lag

    def wait_for_lag(self, version_in_use: VersionSource, timeout: float | None = None) -> bool:
        """Block until the version in use is within ``max_lag`` of the current version.

        The current version only grows, so waiting ends well only if the version in use can
        advance meanwhile: pass a callable such as ``lambda: backend.version`` for a backend
        that swaps weights between batches. It is re-read every ``poll_interval``.

        Args:
            version_in_use: an int, or a zero-argument callable returning the version in use.
            timeout: seconds to wait at most; ``None`` waits until ``close()``.

        Returns:
            True when within the lag; False on timeout or when the manager is closed.
        """
        polled = callable(version_in_use)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Read a callable source outside the lock: it is user code.
            in_use = _check_int(
                "version_in_use", version_in_use() if callable(version_in_use) else version_in_use, minimum=0
            )
            with self._cond:
                if self._closed.value:
                    return False
                if self.max_lag is None or self._version.value - in_use <= self.max_lag:
                    return True
                wait = self.poll_interval if polled else None
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    wait = remaining if wait is None else min(wait, remaining)
                self._cond.wait(wait)

    def wait_for_version(self, min_version: int, timeout: float | None = None) -> bool:
        """Block until ``current_version >= min_version``.

        Returns:
            True when reached; False on timeout or when the manager is closed.
        """
        min_version = _check_int("min_version", min_version, minimum=0)
        with self._cond:
            reached = self._cond.wait_for(lambda: self._closed.value or self._version.value >= min_version, timeout)
            return bool(reached) and not self._closed.value

    def admit(self, version_in_use: VersionSource, timeout: float | None = None, count: int = 1) -> bool:
        """Apply the gate with the configured ``on_lag`` policy.

        ``"drop"`` answers at once; ``"wait"`` calls :meth:`wait_for_lag`. A rejection adds
        ``count`` to the dropped-samples counter.

        Returns:
            True if the samples produced with ``version_in_use`` may be used.
        """
        count = _check_int("count", count, minimum=0)
        if self.on_lag == "wait":
            admitted = self.wait_for_lag(version_in_use, timeout)
        else:
            in_use = version_in_use() if callable(version_in_use) else version_in_use
            admitted = self.within_lag(in_use)
        if not admitted:
            self.record_dropped(count)
        return admitted

    # -- statistics ---------------------------------------------------------------------
    def record_staleness(self, staleness: int | Iterable[int]) -> None:
        """Add one staleness value, or many, to the statistics."""
        items: list[Any]
        try:
            items = list(staleness)  # type: ignore[arg-type]
        except TypeError:  # a single number
            items = [staleness]
        try:
            values = list(map(operator.index, items))  # (a learner records a batch per step: keep it C-speed)
        except TypeError:
            values = [_check_int("staleness", value, minimum=0) for value in items]  # raises, naming the field
        if not values:
            return
        if any(isinstance(value, bool) for value in items) or min(values) < 0:
            for value in items:
                _check_int("staleness", value, minimum=0)
        last_bin = len(self._histogram) - 1
        counts = collections.Counter(min(value, last_bin) for value in values)
        total, largest = sum(values), max(values)
        with self._cond:
            for bin_, count in counts.items():
                self._histogram[bin_] += count
            self._stale_sum.value += total
            self._stale_max.value = max(self._stale_max.value, largest)

    def record_dropped(self, count: int = 1) -> None:
        """Count ``count`` samples discarded for staleness."""
        count = _check_int("count", count, minimum=0)
        with self._cond:
            self._dropped.value += count

    def staleness_stats(self) -> StalenessStats:
        """A consistent snapshot of the staleness statistics."""
        with self._cond:
            histogram = list(self._histogram)
            total = self._stale_sum.value
            maximum = self._stale_max.value
            dropped = self._dropped.value
        count = sum(histogram)
        return StalenessStats(
            count=count,
            mean=total / count if count else 0.0,
            max=maximum,
            histogram=histogram,
            dropped=dropped,
        )

    def reset_stats(self) -> None:
        """Zero the staleness statistics and the dropped counter."""
        with self._cond:
            for i in range(len(self._histogram)):
                self._histogram[i] = 0
            self._stale_sum.value = 0
            self._stale_max.value = 0
            self._dropped.value = 0

    # -- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        """Mark the manager closed in every process and wake all waiters (they return False)."""
        with self._cond:
            self._closed.value = 1
            self._cond.notify_all()

    def _raise_if_closed(self) -> None:
        if self._closed.value:
            raise VersionManagerClosedError("VersionManager is closed")

    def __repr__(self) -> str:
        return f"VersionManager(current_version={self.current_version}, max_lag={self.max_lag}, on_lag={self.on_lag!r})"


def adapt_max_staleness(
    current: int,
    *,
    ess: float,
    clipped_fraction: float,
    floor: int,
    ceiling: int,
    min_ess: float = 0.5,
    max_clipped_fraction: float = 0.2,
) -> int:
    """The next ``max_staleness`` from how off-policy the last update's data was (AIMD).

    ``ess`` and ``clipped_fraction`` describe the importance weights ``pi/mu`` of the samples the
    last update used (:func:`asyncvec.losses.truncated_importance_weights` returns both). The rule,
    additive increase / multiplicative decrease as in TCP congestion control::

        healthy = ess >= min_ess and clipped_fraction <= max_clipped_fraction
        next    = min(current + 1, ceiling)      if healthy
                  max(current // 2, floor)       otherwise

    Degenerate weights (few samples carry the weight, or many hit the cap) mean the data is too
    far from the learner's policy to correct for: halve the allowed staleness at once. Healthy
    weights let it grow back one version per update, up to ``ceiling``.

    Example:
        >>> adapt_max_staleness(8, ess=0.3, clipped_fraction=0.05, floor=1, ceiling=8)
        4
        >>> adapt_max_staleness(4, ess=0.9, clipped_fraction=0.05, floor=1, ceiling=8)
        5
        >>> adapt_max_staleness(8, ess=0.9, clipped_fraction=0.05, floor=1, ceiling=8)
        8
    """
    current = _check_int("current", current, minimum=0)
    floor = _check_int("floor", floor, minimum=0)
    ceiling = _check_int("ceiling", ceiling, minimum=floor)
    for name, value in (("ess", ess), ("clipped_fraction", clipped_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")
    healthy = ess >= min_ess and clipped_fraction <= max_clipped_fraction
    proposed = current + 1 if healthy else current // 2
    return min(max(proposed, floor), ceiling)


def per_token_versions(policy_version: int, token_versions: Sequence[int] | None, num_tokens: int) -> tuple[int, ...]:
    """The version of each of a sample's ``num_tokens`` tokens, checked.

    With in-flight weight updates a completion's tokens may come from several versions
    (``PolicyOutput.token_versions``); the sample's ``policy_version`` is its oldest token's,
    the first one's. ``token_versions=None`` means every token has ``policy_version``. Checked:
    one version per token, ints ``>= 0``, never decreasing along the sequence (weights only move
    forward while it is sampled), the first equal to ``policy_version``.

    Raises:
        ValueError: naming ``token_versions`` and what is wrong with it.

    Example:
        >>> per_token_versions(3, None, 2)
        (3, 3)
        >>> per_token_versions(3, [3, 3, 4, 5], 4)
        (3, 3, 4, 5)
        >>> per_token_versions(4, [3, 4], 2)
        Traceback (most recent call last):
        ...
        ValueError: token_versions: the first (oldest) token has version 3, the sample's policy_version is 4
    """
    policy_version = _check_int("policy_version", policy_version, minimum=0)
    num_tokens = _check_int("num_tokens", num_tokens, minimum=0)
    if token_versions is None:
        return (policy_version,) * num_tokens
    try:
        versions = tuple(map(operator.index, token_versions))
    except TypeError:
        raise ValueError(f"token_versions: expected ints (one version per token), got {token_versions!r}") from None
    if len(versions) != num_tokens:
        raise ValueError(f"token_versions: expected one version per token ({num_tokens}), got {len(versions)}")
    if any(isinstance(v, bool) for v in token_versions) or (versions and min(versions) < 0):
        raise ValueError(f"token_versions: expected ints >= 0, got {token_versions!r}")
    if any(later < earlier for earlier, later in zip(versions, versions[1:])):
        raise ValueError(f"token_versions: expected versions that never decrease along the tokens, got {versions}")
    if versions and versions[0] != policy_version:
        raise ValueError(
            f"token_versions: the first (oldest) token has version {versions[0]}, "
            f"the sample's policy_version is {policy_version}"
        )
    return versions


def _check_int(field: str, value: Any, minimum: int) -> int:
    """Return ``value`` as an int (numpy integers welcome), or raise naming ``field``."""
    if isinstance(value, bool):
        raise TypeError(f"{field}: expected an int, got bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{field}: expected an int, got {type(value).__name__}") from None
    if number < minimum:
        raise ValueError(f"{field}: expected an int >= {minimum}, got {number}")
    return number


class LaggedWeights:
    """Delivers each published version to ``backend`` only ``lag`` publications later.

    It plays a slow weight broadcast to a remote inference fleet, so actors act with a policy
    ``lag`` versions behind the learner (forcing staleness for experiments and tests).

    Example:
        >>> class Backend:
        ...     def load_weights(self, weights, version): self.version = version
        >>> backend = Backend(); lagged = LaggedWeights(backend, lag=2)
        >>> for v in (1, 2, 3): lagged.load_weights({}, v)
        >>> backend.version
        1
    """

    def __init__(self, backend: Any, lag: int) -> None:
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        self.backend = backend
        self.lag = lag
        self._queue: collections.deque[tuple[Any, int]] = collections.deque()

    def load_weights(self, weights: Any, version: int) -> None:
        self._queue.append((weights, version))
        while len(self._queue) > self.lag:
            self.backend.load_weights(*self._queue.popleft())


def with_lag(backend: WeightsBackend, lag: int) -> WeightsBackend:
    """What to register so that ``backend`` gets each version ``lag`` publications late: ``backend``
    itself at lag 0 (a publish reaches it straight through), else a :class:`LaggedWeights` around it.

    Example:
        >>> class Backend:
        ...     def load_weights(self, weights, version): self.version = version
        >>> backend = Backend()
        >>> with_lag(backend, 0) is backend, type(with_lag(backend, 2)).__name__
        (True, 'LaggedWeights')
    """
    return backend if lag == 0 else LaggedWeights(backend, lag)


class PinnedWeights:
    """Keeps every published version for ``backend`` and loads the one the acting side asks for.

    The learner's publish only stores the weights; the caller of :meth:`deliver` (a lockstep collector,
    at each segment's first step) decides which version acts. So which version acts on which step is
    fixed by construction, whatever the speeds: with PPO's ``--max-staleness 1`` segment ``k + 1`` is
    acted by the version published after update ``k - 1`` while update ``k`` trains.

    Example:
        >>> class Backend:
        ...     def load_weights(self, weights, version): self.version = version
        >>> backend = Backend(); pinned = PinnedWeights(backend, {"w": 0}, version=0)
        >>> for v in (1, 2): pinned.load_weights({"w": v}, v)  # the learner publishes twice
        >>> pinned.deliver(1); backend.version
        1
    """

    def __init__(self, backend: Any, weights: Any, version: int = 0) -> None:
        self.backend = backend
        self.delivered = version  # ``backend`` acts with this version (it holds ``weights`` already)
        self._kept: dict[int, Any] = {version: weights}
        self._lock = threading.Lock()

    def load_weights(self, weights: Any, version: int) -> None:
        with self._lock:
            self._kept[version] = weights

    def deliver(self, version: int) -> None:
        """Loads ``version`` into the backend (already published) and forgets the older ones."""
        with self._lock:
            if version == self.delivered:
                return
            weights = self._kept[version]
            for old in [v for v in self._kept if v < version]:
                del self._kept[old]
        self.backend.load_weights(weights, version)
        self.delivered = version


class AdmissionControl:
    """Bounds staleness when a sample starts instead of dropping it when trained on (AReaL's rule).

    The learner takes samples in the order they were admitted, ``per_update`` per update, so sample
    ``i`` (0-based) enters update ``i // per_update``. It may start once ``i // per_update -
    max_staleness + lag`` updates are done: at most ``max_staleness`` versions are then published
    between its start and its update, however long it takes (``lag``: the policy receives each
    version that many updates late). Nothing is generated only to be dropped, long samples
    included; with ``max_staleness=0`` each update's samples start after the previous update, as in
    a synchronous loop.

    Example:
        >>> gate = AdmissionControl(per_update=2, max_staleness=0)
        >>> [gate.admitted(i) for i in range(4)]
        [True, True, False, False]
        >>> gate.update_done()
        >>> [gate.admitted(i) for i in range(4)]
        [True, True, True, True]
    """

    def __init__(self, per_update: int, max_staleness: int, lag: int = 0) -> None:
        self.per_update = _check_int("per_update", per_update, minimum=1)
        self.max_staleness = _check_int("max_staleness", max_staleness, minimum=0)
        self.lag = _check_int("lag", lag, minimum=0)
        if self.lag > self.max_staleness:
            raise ValueError(
                f"lag {self.lag} exceeds max_staleness {self.max_staleness}: every sample would be too stale "
                "when trained on, so none could start"
            )
        self._updates_done = 0
        self._cond = threading.Condition()

    @property
    def updates_done(self) -> int:
        """Updates the learner finished (:meth:`update_done` calls)."""
        with self._cond:
            return self._updates_done

    def admitted(self, index: int) -> bool:
        """Whether sample ``index`` may start now."""
        with self._cond:
            return self._admits(_check_int("index", index, minimum=0))

    def wait(self, index: int, timeout: float | None = None) -> bool:
        """Blocks until sample ``index`` may start (True) or ``timeout`` seconds passed (False)."""
        index = _check_int("index", index, minimum=0)
        with self._cond:
            return self._cond.wait_for(lambda: self._admits(index), timeout)

    def update_done(self) -> None:
        """The learner finished an update (published a version or not): admits the next samples."""
        with self._cond:
            self._updates_done += 1
            self._cond.notify_all()

    def _admits(self, index: int) -> bool:
        return self._updates_done >= index // self.per_update - self.max_staleness + self.lag

    def __repr__(self) -> str:
        return (
            f"AdmissionControl(per_update={self.per_update}, max_staleness={self.max_staleness}, lag={self.lag}, "
            f"updates_done={self.updates_done})"
        )
