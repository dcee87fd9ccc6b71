"""The :class:`RewardService`: scores ``(prompt, response)`` pairs on background threads while the policy
keeps generating, batching for reward models, caching by version, flagging timeouts and errors.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import inspect
import logging
import math
import numbers
import os
import threading
import time
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from asyncvec.lifecycle import ClosesOnExit
from asyncvec.lm.rewards.models import BatchScorer, HFRewardModel
from asyncvec.lm.rewards.registry import RewardFn, _acall, _call, _resolve, check_reward

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """The outcome of one :meth:`RewardService.submit`.

    Attributes:
        reward: The score, or the service's ``timeout_reward`` when flagged.
        flagged: True when the score is a stand-in (timeout or scorer error).
        latency: Seconds from submit to result.
        rm_version: Reward-model version that produced (or would have produced) the score.
        cached: True when served from the cache.
        reason: Why the result is flagged (None otherwise).
    """

    reward: float
    flagged: bool
    latency: float
    rm_version: int
    cached: bool
    reason: str | None = None

    @property
    def usable(self) -> bool:
        """Whether the sample may be trained on (flagged samples must not be)."""
        return not self.flagged


@dataclasses.dataclass(frozen=True)
class RewardServiceStats:
    """Counters of a :class:`RewardService`.

    Every request ends in exactly one of ``cache_hits``, ``scored``, ``timeouts``, ``errors``
    (or is still pending). ``batches`` counts ``score_batch`` calls (batch scorers only);
    ``cache_size`` is the number of cached scores.
    """

    requests: int
    cache_hits: int
    scored: int
    timeouts: int
    errors: int
    batches: int
    cache_size: int


@dataclasses.dataclass(eq=False)
class _Request:
    prompt: str
    response: str
    info: dict[str, Any]
    cache_key: Hashable | None  # without the version; None when info is unhashable
    start: float
    future: concurrent.futures.Future[RewardResult]
    timer: asyncio.TimerHandle | None = None


class RewardServiceClosedError(RuntimeError):
    """A :class:`RewardService` was given a request after ``close()``, or closed before a request was scored."""


class RewardService(ClosesOnExit):
    """Scores ``(prompt, response)`` pairs in the background, in parallel with generation.

    Requests go to an asyncio loop on a worker thread. Batch scorers (:class:`HFRewardModel`)
    get batches of up to ``max_batch_size`` requests gathered for at most ``max_wait_s``; plugin
    callables score each request on its own (async ones on the loop, sync ones on a pool of
    ``num_workers`` threads). Results are cached (LRU) by prompt, response, info (for plugins)
    and reward-model version, so a new version never serves old scores.

    A request that is not scored within ``timeout_s`` of :meth:`submit`, or whose scorer
    raises or returns a non-finite/non-numeric value, resolves to ``timeout_reward`` with
    ``flagged=True`` (see :attr:`RewardResult.usable`); the service keeps running. A score
    that arrives after its request timed out still fills the cache.

    Args:
        scorer: A plugin name, a reward callable (sync/async plugin, :class:`CombinedReward`),
            or a :class:`BatchScorer` such as :class:`HFRewardModel`.
        timeout_s: Seconds from submit until a request is flagged as timed out.
        timeout_reward: Reward of flagged results (timeouts and scorer errors).
        cache_size: Most cached results (0 disables the cache).
        max_batch_size: Most requests per ``score_batch`` call.
        max_wait_s: Longest wait for a batch to fill after its first request.
        num_workers: Scorer calls (or batches) running at once.
        version: Initial reward-model version.

    Example:
        >>> from asyncvec.lm.rewards import RewardService
        >>> with RewardService("exact_answer", timeout_s=5.0) as service:
        ...     first = service.submit("2+3=", "5").result(timeout=5.0)
        ...     again = service.submit("2+3=", "5").result(timeout=5.0)
        >>> first.reward, first.cached, again.cached
        (1.0, False, True)
    """

    def __init__(
        self,
        scorer: str | RewardFn | BatchScorer,
        *,
        timeout_s: float = 30.0,
        timeout_reward: float = 0.0,
        cache_size: int = 4096,
        max_batch_size: int = 32,
        max_wait_s: float = 0.005,
        num_workers: int = 4,
        version: int = 0,
    ) -> None:
        if isinstance(scorer, BatchScorer):
            self._name, self._scorer = type(scorer).__name__, scorer
            self._batched = True
        elif isinstance(scorer, str) or callable(scorer):
            self._name, self._scorer = _resolve(scorer)
            self._batched = False
        else:
            raise TypeError(
                "scorer must be a plugin name, a callable f(prompt, completion, **info) or an "
                f"object with score_batch(prompts, responses), got {type(scorer).__name__}"
            )
        _check_positive("timeout_s", timeout_s)
        _check_positive("max_wait_s", max_wait_s, allow_zero=True)
        self.timeout_s = float(timeout_s)
        self.timeout_reward = check_reward(timeout_reward, "timeout_reward")
        self.cache_size = _check_count("cache_size", cache_size, minimum=0)
        self.max_batch_size = _check_count("max_batch_size", max_batch_size, minimum=1)
        self.max_wait_s = float(max_wait_s)
        self.num_workers = _check_count("num_workers", num_workers, minimum=1)
        self._version = _check_version(version)
        self._async = not self._batched and inspect.iscoroutinefunction(self._scorer)

        self._lock = threading.Lock()  # guards the fields below, the cache and the counters
        self._weights_lock = threading.Lock()  # version label matches the weights used
        self._cache: collections.OrderedDict[Hashable, float] = collections.OrderedDict()
        self._counts: collections.Counter[str] = collections.Counter()
        self._closed = False

        self._executor = concurrent.futures.ThreadPoolExecutor(self.num_workers, thread_name_prefix="asyncvec-reward")
        self._loop = asyncio.new_event_loop()
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._pending: set[_Request] = set()  # touched on the loop thread only
        self._tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references
        self._slots = asyncio.Semaphore(self.num_workers)
        self._thread = threading.Thread(target=self._loop.run_forever, name="asyncvec-reward-loop", daemon=True)
        self._thread.start()
        self._dispatcher = asyncio.run_coroutine_threadsafe(self._dispatch(), self._loop)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> RewardService:
        """A service over ``HFRewardModel.from_pretrained(path)``; kwargs go to the service."""
        return cls(HFRewardModel.from_pretrained(path, device=device), **kwargs)

    # -- public API -----------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The current reward-model version."""
        with self._lock:
            return self._version

    def submit(self, prompt: str, response: str, **info: Any) -> concurrent.futures.Future[RewardResult]:
        """Queue one pair for scoring; ``info`` is passed to plugin scorers.

        Returns:
            A future resolving to a :class:`RewardResult` (never to a scorer exception).

        Raises:
            TypeError: ``prompt`` or ``response`` is not a str.
            RewardServiceClosedError: the service is closed (a ``RuntimeError``).
        """
        _check_text("prompt", prompt)
        _check_text("response", response)
        start = time.perf_counter()
        future: concurrent.futures.Future[RewardResult] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # only the service resolves it
        cache_key = self._cache_key(prompt, response, info)
        with self._lock:
            if self._closed:
                raise RewardServiceClosedError("RewardService is closed; create a new one to submit requests")
            self._counts["requests"] += 1
            version = self._version
            cached = self._cache_get((version, cache_key)) if cache_key is not None else None
            if cached is None:
                request = _Request(prompt, response, dict(info), cache_key, start, future)
                self._loop.call_soon_threadsafe(self._admit, request)
                return future
            self._counts["cache_hits"] += 1
        future.set_result(RewardResult(cached, False, time.perf_counter() - start, version, cached=True))
        return future

    def set_version(self, version: int) -> None:
        """Switch to a new reward-model version; cached scores of older versions are dropped."""
        version = _check_version(version)
        with self._lock:
            self._version = version
            self._cache.clear()

    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor] | str | os.PathLike[str],
        version: int | None = None,
    ) -> int:
        """Load new reward-model weights and switch version (default: current + 1).

        Batches already scoring finish with the old weights and are labelled with the old
        version; no cached score of the old version is served afterwards.

        Returns:
            The new version.

        Raises:
            TypeError: the scorer has no ``load_weights`` (plugins: use :meth:`set_version`).
            ValueError: ``version`` equals the current version.
        """
        load = getattr(self._scorer, "load_weights", None)
        if load is None:
            raise TypeError(f"scorer {self._name!r} has no load_weights(); use set_version() for plugin scorers")
        with self._weights_lock:
            new_version = self.version + 1 if version is None else _check_version(version)
            if new_version == self.version:
                raise ValueError(f"version must differ from the current version {new_version} after new weights")
            load(weights)
            self.set_version(new_version)
        return new_version

    def stats(self) -> RewardServiceStats:
        """A snapshot of the counters."""
        with self._lock:
            return RewardServiceStats(
                requests=self._counts["requests"],
                cache_hits=self._counts["cache_hits"],
                scored=self._counts["scored"],
                timeouts=self._counts["timeouts"],
                errors=self._counts["errors"],
                batches=self._counts["batches"],
                cache_size=len(self._cache),
            )

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the service; unfinished requests fail with :class:`RewardServiceClosedError` (a RuntimeError).

        Waits for scorer calls already running on worker threads, then joins every thread.
        Calling it again does nothing.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._thread.is_alive():  # bare RuntimeError: _shutdown ended every task, so only a bug keeps it
            raise RuntimeError(f"RewardService loop thread did not stop within {timeout_s}s")
        self._loop.close()

    def __repr__(self) -> str:
        return f"RewardService({self._name!r}, version={self.version}, closed={self._closed})"

    # -- cache (call with self._lock held) --------------------------------------------------

    def _cache_key(self, prompt: str, response: str, info: Mapping[str, Any]) -> Hashable | None:
        if self.cache_size == 0:
            return None
        if self._batched:  # reward models see only the pair
            return (prompt, response)
        key = (prompt, response, tuple(sorted(info.items())))
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def _cache_get(self, key: Hashable) -> float | None:
        value = self._cache.get(key)
        if value is not None:
            self._cache.move_to_end(key)
        return value

    def _cache_put(self, key: Hashable, value: float) -> None:
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    # -- loop thread ------------------------------------------------------------------------

    def _admit(self, request: _Request) -> None:
        delay = self.timeout_s - (time.perf_counter() - request.start)
        request.timer = self._loop.call_later(max(delay, 0.0), self._expire, request)
        self._pending.add(request)
        self._queue.put_nowait(request)

    def _expire(self, request: _Request) -> None:
        with self._lock:
            version = self._version
        self._flag(request, "timeouts", version, f"timed out after {self.timeout_s:g}s")

    def _flag(self, request: _Request, outcome: str, version: int, reason: str) -> None:
        if request.future.done():
            return
        with self._lock:
            self._counts[outcome] += 1
        self._resolve(request, RewardResult(self.timeout_reward, True, 0.0, version, False, reason))

    def _resolve(self, request: _Request, result: RewardResult) -> None:
        if request.timer is not None:
            request.timer.cancel()
        self._pending.discard(request)
        latency = time.perf_counter() - request.start
        request.future.set_result(dataclasses.replace(result, latency=latency))

    async def _dispatch(self) -> None:
        while True:
            batch = [await self._queue.get()]
            if self._batched:
                deadline = self._loop.time() + self.max_wait_s
                while len(batch) < self.max_batch_size:
                    remaining = deadline - self._loop.time()
                    if remaining <= 0:
                        break
                    try:
                        batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                    except asyncio.TimeoutError:
                        break
            batch = [request for request in batch if not request.future.done()]
            groups = [batch] if self._batched else [[request] for request in batch]
            for group in groups:
                if not group:
                    continue
                await self._slots.acquire()
                task = self._loop.create_task(self._score(group))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _score(self, batch: list[_Request]) -> None:
        try:
            if self._batched:
                version, values = await self._loop.run_in_executor(
                    self._executor,
                    self._score_batch,
                    [r.prompt for r in batch],
                    [r.response for r in batch],
                )
            else:
                (request,) = batch
                with self._lock:
                    version = self._version
                if self._async:
                    values = [await _acall(self._name, self._scorer, request.prompt, request.response, request.info)]
                else:
                    call = functools.partial(
                        _call,
                        self._name,
                        self._scorer,
                        request.prompt,
                        request.response,
                        request.info,
                    )
                    values = [await self._loop.run_in_executor(self._executor, call)]
        except Exception as exc:  # scorer failures flag the requests; the service keeps going
            logger.warning("reward scorer %r failed on %d request(s): %r", self._name, len(batch), exc)
            with self._lock:
                version = self._version
            for request in batch:
                self._flag(request, "errors", version, f"scorer error: {exc!r}")
        else:
            self._finish(batch, values, version)
        finally:
            self._slots.release()

    def _score_batch(self, prompts: list[str], responses: list[str]) -> tuple[int, list[float]]:
        with self._weights_lock:
            with self._lock:
                version = self._version
            values = list(self._scorer.score_batch(prompts, responses))
        with self._lock:
            self._counts["batches"] += 1
        if len(values) != len(prompts):
            raise ValueError(f"{self._name}.score_batch returned {len(values)} scores for {len(prompts)} pairs")
        return version, values

    def _finish(self, batch: list[_Request], values: list[Any], version: int) -> None:
        for request, value in zip(batch, values, strict=True):
            try:
                reward = check_reward(value, self._name)
            except (TypeError, ValueError) as exc:
                logger.warning("%s", exc)
                self._flag(request, "errors", version, f"scorer error: {exc}")
                continue
            with self._lock:
                if request.cache_key is not None and version == self._version:
                    self._cache_put((version, request.cache_key), reward)
                if not request.future.done():
                    self._counts["scored"] += 1
            if not request.future.done():
                self._resolve(request, RewardResult(reward, False, 0.0, version, False))

    async def _shutdown(self) -> None:
        tasks = [task for task in asyncio.all_tasks(self._loop) if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for request in list(self._pending):
            if request.timer is not None:
                request.timer.cancel()
            if not request.future.done():
                closed = RewardServiceClosedError("RewardService was closed before the request was scored")
                request.future.set_exception(closed)
        self._pending.clear()


def _check_text(field: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {type(value).__name__}")


def _check_positive(field: str, value: object, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{field} must be a finite number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{field} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _check_count(field: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{field} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value!r}")
    return int(value)


def _check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, numbers.Integral):
        raise TypeError(f"version must be an int, got {version!r} of type {type(version).__name__}")
    return int(version)
