"""`BatchedPolicy`: the future, deadline, retry, cache and version machinery every backend stands on.

Every backend (torch module, HF model, OpenAI-compatible server, vLLM engine, latency
wrapper) subclasses `BatchedPolicy` and only implements how a batch of observations turns
into answers (`_forward_batch`) and how weights are swapped (`_apply_weights`).
"""

from __future__ import annotations

import abc
import dataclasses
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from typing import Any

import gymnasium as gym
import numpy as np

from asyncvec.inference.batcher import DynamicBatcher
from asyncvec.inference.requests import (
    LRUCache,
    Request,
    VersionLock,
    observation_key,
    submit_all,
    zero_action,
)
from asyncvec.inference.types import (
    BackendError,
    BackendResult,
    PolicyClosedError,
    PolicyOutput,
    ReentrantCallError,
)
from asyncvec.lifecycle import ClosesOnExit

logger = logging.getLogger(__name__)

FallbackSpec = str | Callable[[Any, int | None], Any]
FALLBACK_MODES = ("zero", "repeat")

# Set while a policy thread resolves futures: done-callbacks run there and must not call
# load_weights (it would wait for the very batch that is delivering).
_delivery = threading.local()


class BatchedPolicy(ClosesOnExit):  # an abc.ABC, as ClosesOnExit is
    """Base of every backend: futures, dynamic batching, deadlines, retries, cache, versions.

    A subclass implements ``_forward_batch(obs_list) -> list[BackendResult]`` (one backend
    call for a batch of checked observations), ``_apply_weights(weights, version)``, and
    optionally ``_check_obs(obs, env_id)`` (validate/convert one observation at submit time)
    and ``_close_backend()``.

    Behaviour shared by all backends:

    * **Batching**: requests go through a `DynamicBatcher` (``max_batch_size``,
      ``max_wait_ms``, ``max_inflight_batches``, ``adaptive_batching``, and its hold:
      ``batch_hold_ms``, ``batch_hold_below``, off by default).
    * **Deadlines**: with ``deadline_ms`` set, a request not answered in time gets the
      fallback action (``"zero"``: the action space's no-op, ``"repeat"``: the last action
      delivered to that ``env_id``, zero if none, or a function ``fallback(obs, env_id)``)
      with ``fallback=True`` and ``behavior_logp=0.0`` (the fallback rule is deterministic:
      it picked its action with probability 1; the learner can mask or down-weight these
      steps with the flag). A late answer is dropped and counted, never delivered.
    * **Retries**: backend errors are retried ``max_attempts`` times in total with
      exponential back-off (``retry_backoff_ms``, doubling, capped at 2 s), except
      ``ValueError``/``TypeError`` which a retry cannot fix. Then a `BackendError` is set on
      the batch's futures, or, with ``fallback_on_error=True``, they get the fallback action
      (``fallback=True``, ``behavior_logp=0.0``, counted in ``error_fallbacks``): a dead
      server then slows the envs down instead of stopping them.
    * **Cache** (``cache_size > 0``): LRU of answers keyed by (observation hash, policy
      version). A stochastic policy then repeats its sampled action for a repeated
      observation until the next weight update.
    * **Versions**: `load_weights` waits for in-flight batches, blocks new ones, swaps the
      weights and publishes the version. A batch runs and delivers its answers under one
      version, so after `load_weights` returns every answer reports the new version and no
      answer computed with old weights claims it. Versions must increase.
    * **In-flight updates** (``inflight_updates=True``, backends that decode step by step
      only: `HFTextPolicy`, `VLLMPolicy`, `OpenAIPolicy` on a vLLM server): `load_weights`
      waits for one decoding step instead of the whole batch; the batch goes on with the new weights from its next step (the backend recomputes
      what it cached under the old ones). Each answer then carries ``token_versions`` (the
      version that sampled each token) and ``policy_version`` is its oldest token's version.
      Every token sampled after `load_weights` returns has the new version. Off by default:
      a consumer that reads only ``policy_version`` then sees single-version completions.

    Futures are resolved on the policy's threads; done-callbacks must be quick and must not
    call `load_weights` (that raises `ReentrantCallError`, a RuntimeError).
    """

    #: whether `_forward_batch` may return rejected results (text parsers), which need a fallback
    _can_reject = False
    #: whether the backend can take weights between two decoding steps of a batch (``inflight_updates=True``)
    _supports_inflight_updates = False

    def __init__(
        self,
        *,
        action_space: gym.Space | None = None,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        max_inflight_batches: int = 1,
        adaptive_batching: bool = False,
        batch_hold_ms: float = 0.0,
        batch_hold_below: int = 2,
        deadline_ms: float | None = None,
        fallback: FallbackSpec = "zero",
        cache_size: int = 0,
        max_attempts: int = 3,
        retry_backoff_ms: float = 20.0,
        fallback_on_error: bool = False,
        version: int = 0,
        inflight_updates: bool = False,
        name: str | None = None,
    ) -> None:
        self._label = name or type(self).__name__
        if not isinstance(inflight_updates, bool):
            raise TypeError(f"{self._label}: inflight_updates must be a bool, got {type(inflight_updates).__name__}")
        if inflight_updates and not self._supports_inflight_updates:
            raise ValueError(
                f"{self._label}: inflight_updates=True is not supported by this backend (it cannot take weights "
                "between two decoding steps); leave it False: load_weights then waits for in-flight batches"
            )
        #: whether `load_weights` lands between two decoding steps of a running batch (see the class docstring)
        self.inflight_updates = inflight_updates
        if action_space is not None and not isinstance(action_space, gym.Space):
            raise TypeError(f"{self._label}: action_space must be a gymnasium.Space, got {type(action_space).__name__}")
        if deadline_ms is not None and (not isinstance(deadline_ms, (int, float)) or not deadline_ms > 0):
            raise ValueError(f"{self._label}: deadline_ms must be a number > 0 or None, got {deadline_ms!r}")
        if not isinstance(cache_size, int) or cache_size < 0:
            raise ValueError(f"{self._label}: cache_size must be an int >= 0, got {cache_size!r}")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"{self._label}: max_attempts must be an int >= 1, got {max_attempts!r}")
        if not isinstance(retry_backoff_ms, (int, float)) or retry_backoff_ms < 0:
            raise ValueError(f"{self._label}: retry_backoff_ms must be a number >= 0, got {retry_backoff_ms!r}")
        self._check_version(version, None)
        self.action_space = action_space
        self._fallback = fallback
        self._zero_action = self._resolve_zero_action(fallback, action_space, deadline_ms)
        self._deadline_s = None if deadline_ms is None else float(deadline_ms) / 1000.0
        self.max_attempts = max_attempts
        self.fallback_on_error = bool(fallback_on_error)
        if self.fallback_on_error:
            self._zero_action = self._resolve_zero_action(fallback, action_space, 1.0)  # needs a fallback too
        self._retry_backoff_s = float(retry_backoff_ms) / 1000.0
        self._cache = LRUCache(cache_size) if cache_size else None
        self._version = int(version)
        self._version_lock = VersionLock()
        # Held only while reading/publishing the version and resolving that answer. Reentrant: a
        # done-callback may submit again, and a cache hit resolves under it.
        self._publish_mutex = threading.RLock()
        self._update_mutex = threading.Lock()  # one load_weights at a time
        self._stats_lock = threading.Lock()
        self._closing = threading.Event()
        self._closed = False
        self._last_action: dict[int, Any] = {}
        self._latencies: deque[float] = deque(maxlen=10_000)
        self._counts = dict.fromkeys(
            (
                "requests",
                "answered",
                "errors",
                "timeouts",
                "error_fallbacks",
                "parse_failures",
                "late_dropped",
                "retries",
                "cache_hits",
                "inflight_swaps",
            ),
            0,
        )
        self._batcher: DynamicBatcher[Request] = DynamicBatcher(
            self._run_batch,
            max_batch_size=max_batch_size,
            max_wait_ms=max_wait_ms,
            max_inflight_batches=max_inflight_batches,
            adaptive=adaptive_batching,
            hold_ms=batch_hold_ms,
            hold_below=batch_hold_below,
            drop_if=lambda request: request.completed,
            name=f"asyncvec-{self._label}",
        )
        self._deadline_cond = threading.Condition()
        self._deadline_heap: list[tuple[float, int, Request]] = []
        self._deadline_seq = itertools.count()
        self._watchdog: threading.Thread | None = None

    def _resolve_zero_action(self, fallback: FallbackSpec, space: gym.Space | None, deadline_ms: float | None) -> Any:
        if callable(fallback):
            return None
        if fallback not in FALLBACK_MODES:
            expected = f"one of {FALLBACK_MODES} or a function(obs, env_id) -> action"
            raise ValueError(f"{self._label}: fallback must be {expected}, got {fallback!r}")
        if space is None:
            if deadline_ms is not None or self._can_reject:
                raise ValueError(
                    f"{self._label}: fallback={fallback!r} needs action_space to build the no-op action; "
                    "pass action_space=... or fallback=<function(obs, env_id) -> action>"
                )
            return None
        return zero_action(space)

    # ------------------------------------------------------------------ hooks for backends
    def _check_obs(self, obs: Any, env_id: int | None) -> Any:
        """Validate and convert one observation at submit time (raise ValueError/TypeError)."""
        return obs

    @abc.abstractmethod
    def _forward_batch(self, obs_list: list[Any]) -> list[BackendResult]:
        """One backend call: one `BackendResult` per checked observation, in order."""

    def _prepare_weights(self, weights: Any, version: int) -> Any:
        """What `load_weights` can do before it holds batches back (e.g. write and check a
        checkpoint); its result goes to `_apply_weights`."""
        return weights

    @abc.abstractmethod
    def _apply_weights(self, weights: Any, version: int) -> None:
        """Swap in new weights (from `_prepare_weights`); called with no batch running."""

    def _close_backend(self) -> None:
        """Release backend resources (clients, engines); called once by `close`."""

    @contextmanager
    def _decoding_step(self) -> Iterator[int]:
        """One decoding step of a batch; yields the version of the weights it runs with.

        With ``inflight_updates`` the weights are held still for this step only (a waiting
        `load_weights` swaps them before the next step starts); otherwise the whole batch
        already holds them and the version is the batch's.
        """
        if not self.inflight_updates:
            yield self._version
            return
        with self._version_lock.read():
            yield self._version

    def _count_inflight_swap(self) -> None:
        """Count one weight update that landed while generation was running (``stats()["inflight_swaps"]``):
        once per update, however many batches or requests it reached."""
        with self._stats_lock:
            self._counts["inflight_swaps"] += 1

    def _batch_lock(self) -> Any:
        """What a whole batch holds: the version lock's read side, or nothing with in-flight updates."""
        return nullcontext() if self.inflight_updates else self._version_lock.read()

    def _is_transient(self, exc: BaseException) -> bool:
        """Whether a backend error is worth retrying."""
        return not isinstance(exc, (ValueError, TypeError))

    def _attempt_obs(self, request: Request) -> Any:
        """What an attempt sends the backend for ``request`` (text policies: the prompt continued by
        what a failed attempt had generated)."""
        return request.obs

    def _keep_partial(self, requests: list[Request], error: BaseException) -> list[tuple[Request, BackendResult]]:
        """After a failed attempt: keep what ``error`` says each request had generated; returns the
        requests that are complete already, with their results (delivered at once)."""
        return []

    def _finish(self, request: Request, result: BackendResult, version: int) -> BackendResult:
        """An attempt's result for ``request`` (text policies: joined to what earlier attempts generated)."""
        return result

    # ------------------------------------------------------------------------- public API
    @property
    def policy_version(self) -> int:
        """Version of the weights currently answering."""
        return self._version

    @property
    def updates_waiting(self) -> int:
        """How many `load_weights` calls are waiting for a batch (or, with in-flight updates, a
        decoding step) to end; new batches and steps wait meanwhile."""
        return self._version_lock.writers_waiting

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    def check_observation(self, obs: Any, env_id: int | None = None) -> Any:
        """Validate one observation the way `submit` does and return its converted form."""
        return self._check_obs(obs, env_id)

    def submit(self, obs: Any, *, env_id: int | None = None, priority: int = 0) -> Future:
        """Queue one observation; the returned future resolves to a `PolicyOutput`.

        Args:
            obs: one observation (validated now: a wrong type or shape raises ValueError here).
            env_id: which env asks; used by the ``"repeat"`` fallback and in error messages.
            priority: larger is served first; equal priorities are served oldest first.

        Raises:
            PolicyClosedError: after `close`.
            ValueError, TypeError: bad observation, env_id or priority.
        """
        if self._closed:
            raise PolicyClosedError(f"{self._label} is closed")
        if env_id is not None and (isinstance(env_id, bool) or not isinstance(env_id, (int, np.integer))):
            raise TypeError(f"{self._label}: env_id must be an int or None, got {type(env_id).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise TypeError(f"{self._label}: priority must be an int, got {type(priority).__name__}")
        env_id = None if env_id is None else int(env_id)
        checked = self._check_obs(obs, env_id)
        request = Request(raw_obs=obs, obs=checked, env_id=env_id, submitted=time.monotonic(), future=Future())
        with self._stats_lock:
            self._counts["requests"] += 1
        if self._cache is not None:
            request.cache_key = observation_key(checked)
            with self._publish_mutex:
                hit = self._cache.get((request.cache_key, self._version))
                if hit is not None:
                    latency = time.monotonic() - request.submitted
                    self._complete(request, dataclasses.replace(hit, latency_s=latency), cache_hit=True)
                    return request.future
        if self._deadline_s is not None:
            self._watch_deadline(request)
        try:
            self._batcher.put(request, int(priority))
        except PolicyClosedError:
            self._complete(request, error=PolicyClosedError(f"{self._label} is closed"))
            raise
        return request.future

    def act(
        self,
        obs_batch: Any,
        *,
        env_ids: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> list[PolicyOutput]:
        """Submit a batch of observations and wait for all answers.

        Args:
            obs_batch: a list of observations, a stacked array, or a dict of stacked arrays.
            env_ids: one id per observation; defaults to the positions 0..n-1.
            timeout: seconds to wait for all answers (None: until each resolves; with a
                deadline or a failing backend every future resolves).

        Raises:
            TimeoutError: not all answers arrived within ``timeout``.
            BackendError: the backend gave up on one of the requests.
        """
        return submit_all(self, obs_batch, env_ids, timeout, label=self._label)

    def forward_batch(self, obs_list: Sequence[Any]) -> list[BackendResult]:
        """Run the backend once, synchronously, on observations from `check_observation`.

        No batching, deadline, retry or cache: this is the raw backend call that wrappers
        such as `LatencyModel` build on. Results carry the version that computed them.
        """
        with self._batch_lock():
            version = self._version
            results = self._forward_checked(list(obs_list))
        return [r if r.policy_version is not None else dataclasses.replace(r, policy_version=version) for r in results]

    def load_weights(self, weights: Any, version: int, *, timeout_s: float = 60.0) -> None:
        """Publish new weights; answers delivered after this returns report ``version``.

        Waits (at most ``timeout_s``) for in-flight batches, holds new ones back, swaps the
        weights and publishes ``version``. Requests keep queueing meanwhile. With
        ``inflight_updates`` it waits for the running decoding step only: running batches go on
        with the new weights, every token they sample from then on carries ``version`` (in
        ``token_versions``), and their ``policy_version`` stays their oldest token's.

        Raises:
            ValueError: ``version`` is not an int greater than the current one, or the
                weights do not fit the model.
            TimeoutError: in-flight batches did not finish in time (nothing changed).
            ReentrantCallError: called from a future's done-callback (a ``RuntimeError``).
        """
        if getattr(_delivery, "active", False):
            raise ReentrantCallError(f"{self._label}.load_weights cannot be called from a future's done-callback")
        if self._closed:
            raise PolicyClosedError(f"{self._label} is closed")
        with self._update_mutex:
            self._check_version(version, self._version)
            prepared = self._prepare_weights(weights, int(version))  # batches still run meanwhile
            with self._version_lock.write(timeout_s):
                self._apply_weights(prepared, int(version))
                with self._publish_mutex:
                    self._version = int(version)
            if self._cache is not None:
                self._cache.clear()  # entries of older versions can never hit again

    def _check_version(self, version: Any, current: int | None) -> None:
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"{self._label}: version must be an int >= 0, got {version!r}")
        if current is not None and version <= current:
            raise ValueError(
                f"{self._label}: version must be greater than the current policy_version {current}, got {version}"
            )

    def stats(self) -> dict[str, float]:
        """Counters and latencies.

        Keys: requests, answered, errors, timeouts (deadline fallbacks), error_fallbacks (backend
        failures answered with the fallback, ``fallback_on_error``), parse_failures,
        fallbacks (both), late_dropped, retries, cache_hits, cache_misses, inflight_swaps (weight
        updates that landed while a batch was generating, which went on under the new weights:
        one per update, however many batches or requests it reached; ``inflight_updates``), batches,
        mean_batch_size, queue_depth, inflight_batches, latency_p50_ms, latency_p99_ms,
        policy_version, and the batcher's batch_threshold / arrival_rate_hz / fit_a_ms /
        fit_b_ms.
        """
        with self._stats_lock:
            counts = dict(self._counts)
            latencies = np.asarray(self._latencies, dtype=np.float64)
        batcher = self._batcher.stats()
        p50, p99 = (np.percentile(latencies, [50, 99]) * 1000.0) if latencies.size else (float("nan"), float("nan"))
        return {
            **counts,
            "fallbacks": counts["timeouts"] + counts["error_fallbacks"] + counts["parse_failures"],
            "cache_misses": counts["requests"] - counts["cache_hits"] if self._cache is not None else 0,
            "batches": batcher["batches"],
            "mean_batch_size": batcher["mean_batch_size"],
            "queue_depth": batcher["queue_depth"],
            "inflight_batches": batcher["inflight_batches"],
            "batch_threshold": batcher["batch_threshold"],
            "arrival_rate_hz": batcher["arrival_rate_hz"],
            "fit_a_ms": batcher["fit_a_ms"],
            "fit_b_ms": batcher["fit_b_ms"],
            "latency_p50_ms": float(p50),
            "latency_p99_ms": float(p99),
            "policy_version": self._version,
        }

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the threads, fail unanswered requests with `PolicyClosedError`, free the backend.

        In-flight batches finish first (at most ``timeout_s``). Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._closing.set()  # interrupts retry back-off
        leftover = self._batcher.close(timeout_s)
        with self._deadline_cond:
            self._deadline_cond.notify_all()
        if self._watchdog is not None:
            self._watchdog.join(timeout_s)
        error = PolicyClosedError(f"{self._label} was closed before answering")
        for request in leftover:
            self._complete(request, error=error)
        self._close_backend()

    def __repr__(self) -> str:
        return f"{self._label}(policy_version={self._version}, closed={self._closed})"

    # ------------------------------------------------------------------------ internals
    def _forward_checked(self, obs_list: list[Any]) -> list[BackendResult]:
        results = self._forward_batch(obs_list)
        if not isinstance(results, list) or len(results) != len(obs_list):
            got = len(results) if isinstance(results, list) else type(results).__name__
            raise TypeError(f"{self._label}._forward_batch returned {got} results for {len(obs_list)} observations")
        for result in results:
            if not isinstance(result, BackendResult):
                raise TypeError(
                    f"{self._label}._forward_batch must return BackendResult items, got {type(result).__name__}"
                )
        return results

    def _run_batch(self, batch: list[Request]) -> float | None:
        """Batcher handler: call the backend with retries and deliver the answers."""
        try:
            return self._run_batch_with_retries(batch)
        except BaseException as exc:  # a bug in delivery must not leave futures unresolved
            failure = BackendError(
                f"{self._label}: internal error while answering a batch: {type(exc).__name__}: {exc}"
            )
            failure.__cause__ = exc
            for request in batch:
                self._complete(request, error=failure)
            raise

    def _run_batch_with_retries(self, batch: list[Request]) -> float | None:
        live = [request for request in batch if not request.completed]
        error: BaseException | None = None
        attempt = 0
        while live and attempt < self.max_attempts:
            attempt += 1
            with self._batch_lock():
                version = self._version
                started = time.perf_counter()
                try:
                    results = self._forward_checked([self._attempt_obs(request) for request in live])
                except Exception as exc:  # every backend failure is either retried or reported on the futures
                    error = exc
                    ready = self._keep_partial(live, exc)  # what the next attempt continues from
                    if ready:
                        self._deliver_batch([request for request, _ in ready], [result for _, result in ready], version)
                else:
                    elapsed = time.perf_counter() - started
                    results = [
                        self._finish(request, result, version) for request, result in zip(live, results, strict=True)
                    ]
                    self._deliver_batch(live, results, version)
                    return elapsed
            if not self._is_transient(error) or attempt == self.max_attempts:
                break
            with self._stats_lock:
                self._counts["retries"] += 1
            logger.debug("%s: attempt %d failed (%r); retrying", self._label, attempt, error)
            if self._closing.wait(min(self._retry_backoff_s * 2 ** (attempt - 1), 2.0)):
                break
            live = [request for request in live if not request.completed]
        live = [request for request in live if not request.completed]  # e.g. delivered from a finished prefix
        if live and error is not None:
            failure = BackendError(
                f"{self._label}: backend failed after {attempt} attempt(s) on a batch of {len(live)}: "
                f"{type(error).__name__}: {error}"
            )
            failure.__cause__ = error
            for request in live:
                if self.fallback_on_error and not self._closing.is_set():
                    logger.warning("%s: answering with the fallback action: %s", self._label, failure)
                    self._deliver_fallback(request, error=True)
                else:
                    self._complete(request, error=failure)
        return None

    def _deliver_batch(self, requests: list[Request], results: list[BackendResult], version: int) -> None:
        now = time.monotonic()
        for request, result in zip(requests, results, strict=True):
            action = result.action
            if result.rejected:
                try:
                    action = self._fallback_action(request)
                except Exception as exc:
                    self._complete(request, error=exc)
                    continue
            output = PolicyOutput(
                action=action,
                behavior_logp=float(result.logp),
                policy_version=version if result.policy_version is None else int(result.policy_version),
                latency_s=now - request.submitted,
                fallback=result.rejected,
                text=result.text,
                token_ids=result.token_ids,
                token_logps=result.token_logps,
                top_logprobs=result.top_logprobs,
                token_versions=result.token_versions,
            )
            delivered = self._complete(request, output, parse_failure=result.rejected)
            if delivered and self._cache is not None and not result.rejected:
                self._cache.put((request.cache_key, output.policy_version), output)

    def _fallback_action(self, request: Request) -> Any:
        if callable(self._fallback):
            try:
                return self._fallback(request.raw_obs, request.env_id)
            except Exception as exc:
                raise BackendError(
                    f"{self._label}: fallback function raised for env_id={request.env_id}: {exc!r}"
                ) from exc
        if self._fallback == "repeat" and request.env_id in self._last_action:
            return self._last_action[request.env_id]
        if self._zero_action is None:
            raise BackendError(f"{self._label}: a fallback is needed but no action_space was given to build it")
        return self._zero_action.copy() if isinstance(self._zero_action, np.ndarray) else self._zero_action

    def _complete(
        self,
        request: Request,
        output: PolicyOutput | None = None,
        *,
        error: BaseException | None = None,
        timeout: bool = False,
        backend_error: bool = False,
        parse_failure: bool = False,
        cache_hit: bool = False,
    ) -> bool:
        """Resolve a request's future exactly once; returns False (and counts) when too late."""
        with self._stats_lock:
            if request.completed:
                if output is not None:
                    self._counts["late_dropped"] += 1
                return False
            request.completed = True
            if output is None:
                self._counts["errors"] += 1
            else:
                self._counts["answered"] += 1
                self._counts["timeouts"] += timeout
                self._counts["error_fallbacks"] += backend_error
                self._counts["parse_failures"] += parse_failure
                self._counts["cache_hits"] += cache_hit
                self._latencies.append(output.latency_s)
                if request.env_id is not None:
                    self._last_action[request.env_id] = output.action
        _delivery.active = True
        try:
            if output is None:
                request.future.set_exception(error)
            else:
                request.future.set_result(output)
        finally:
            _delivery.active = False
        return True

    # ------------------------------------------------------------------------ deadlines
    def _watch_deadline(self, request: Request) -> None:
        deadline = request.submitted + self._deadline_s
        with self._deadline_cond:
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watchdog_loop, name=f"asyncvec-{self._label}-deadlines", daemon=True
                )
                self._watchdog.start()
            heapq.heappush(self._deadline_heap, (deadline, next(self._deadline_seq), request))
            if self._deadline_heap[0][2] is request:
                self._deadline_cond.notify()

    def _watchdog_loop(self) -> None:
        while True:
            with self._deadline_cond:
                while True:
                    if self._closed:
                        return
                    if not self._deadline_heap:
                        self._deadline_cond.wait()
                        continue
                    remaining = self._deadline_heap[0][0] - time.monotonic()
                    if remaining > 0:
                        self._deadline_cond.wait(remaining)
                        continue
                    break
                now = time.monotonic()
                expired = []
                while self._deadline_heap and self._deadline_heap[0][0] <= now:
                    expired.append(heapq.heappop(self._deadline_heap)[2])
            for request in expired:
                if not request.completed:
                    self._deliver_fallback(request)

    def _deliver_fallback(self, request: Request, error: bool = False) -> None:
        try:
            action = self._fallback_action(request)
        except Exception as exc:
            self._complete(request, error=exc)
            return
        with self._publish_mutex:
            output = PolicyOutput(
                action=action,
                behavior_logp=0.0,
                policy_version=self._version,
                latency_s=time.monotonic() - request.submitted,
                fallback=True,
            )
            self._complete(request, output, timeout=not error, backend_error=error)
