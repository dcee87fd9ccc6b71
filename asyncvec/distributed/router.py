"""`RoutedPolicy`: one `Policy` over several inference servers or policy replicas.

Requests go to the healthy replica with the fewest outstanding requests. A replica that fails
is ejected (its request is retried on another one) and probed back in the background; weights
are published to every healthy replica, and a replica that comes back is brought to the latest
weights before it serves again. Answers pass through untouched, so each carries the version of
the replica that computed it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np

from asyncvec.inference.requests import submit_all
from asyncvec.inference.types import BackendError, Policy, PolicyClosedError, PolicyOutput
from asyncvec.lifecycle import ClosesOnExit

__all__ = ["EndpointStats", "RoutedPolicy", "act_via_submit"]

logger = logging.getLogger(__name__)

Replica = Policy | Callable[[], Policy]


def act_via_submit(
    policy: Any, obs_batch: Any, env_ids: Sequence[int] | None, timeout: float | None
) -> list[PolicyOutput]:
    """`Policy.act` for a policy that only knows ``submit``: submit each row (its env id as an int), wait for all.

    Example:
        >>> import gymnasium as gym, torch
        >>> from asyncvec.inference import TorchPolicy
        >>> with TorchPolicy(torch.nn.Linear(2, 2), gym.spaces.Discrete(2)) as policy:
        ...     len(act_via_submit(policy, np.zeros((3, 2)), None, timeout=10))
        3
    """
    ids = None if env_ids is None else [int(i) for i in env_ids]
    return submit_all(policy, obs_batch, ids, timeout, label="act")


def _is_request_fault(exc: BaseException) -> bool:
    """Whether an error is the request's fault (bad input), which another replica cannot fix."""
    cause = exc.__cause__ if isinstance(exc, BackendError) and exc.__cause__ is not None else exc
    return isinstance(cause, (ValueError, TypeError))


@dataclasses.dataclass(frozen=True)
class EndpointStats:
    """What `RoutedPolicy.endpoints` reports for one replica.

    Attributes:
        name: the replica's name (its URL for `RoutedPolicy.from_urls`).
        healthy: whether it receives requests now.
        outstanding: requests sent to it and not answered yet.
        requests, answered, errors: counts of requests routed to it and of their outcomes.
        fallbacks: answers that were the replica's fallback action (deadline or parse failure).
        ejections, readmissions: how often it was taken out of and put back into rotation.
        policy_version: the version it last answered with or loaded.
        latency_p50_ms, latency_p99_ms: latency of its answers, as the router saw them.
        last_error: why it was last ejected ("" if never).
    """

    name: str
    healthy: bool
    outstanding: int
    requests: int
    answered: int
    errors: int
    fallbacks: int
    ejections: int
    readmissions: int
    policy_version: int
    latency_p50_ms: float
    latency_p99_ms: float
    last_error: str


class _Endpoint:
    def __init__(self, name: str, policy: Policy, factory: Callable[[], Policy] | None) -> None:
        self.name = name
        self.policy = policy
        self.factory = factory
        self.healthy = True
        self.outstanding = 0
        self.counts = dict.fromkeys(("requests", "answered", "errors", "fallbacks", "ejections", "readmissions"), 0)
        self.failures_in_row = 0
        self.version = int(getattr(policy, "policy_version", 0))
        self.latencies: deque[float] = deque(maxlen=10_000)
        self.last_error = ""
        self.next_probe = 0.0


@dataclasses.dataclass(eq=False)
class _Routed:
    obs: Any
    env_id: int | None
    priority: int
    future: Future
    expected: int = 0  # the version the replica was known to have when the request was sent
    tried: list[_Endpoint] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)


class RoutedPolicy(ClosesOnExit):
    """Routes each request to the healthy replica with the fewest outstanding requests.

    Args:
        replicas: policies (anything with ``submit``/``load_weights``/``policy_version``/
            ``close``), or zero-argument functions that build one. A replica given as a
            function is rebuilt each time it is probed after an ejection (a fresh client for a
            restarted server); one given as a policy is probed as it is.
        names: one name per replica for metrics and errors (default: the replica's
            ``base_url`` if it has one, else ``replica<i>``).
        max_failures: consecutive failed requests after which a replica is ejected.
        probe_interval_s: how often an ejected replica is probed.
        probe_timeout_s: how long a probe answer may take.
        probe_obs: the observation probes send (default: the last observation a replica's model
            answered, a completion the action parser rejected included).
        publish_timeout_s: how long `load_weights` waits for each replica.
        close_replicas: whether `close` closes the replicas (False: the caller owns them;
            replicas rebuilt from a function are always closed).

    Failures: a request whose replica fails (the replica gave up after its own retries, or it
    is closed or unreachable) is sent to the next healthy replica it has not tried; when none
    is left its future gets a `BackendError` naming every replica and its error. Bad input
    (``ValueError``/``TypeError``, an HTTP 4xx) is the request's fault: it is reported at once
    and ejects nothing. A replica with ``deadline_ms`` answers with fallback actions instead of
    failing, so it is never ejected; the router counts its fallbacks.

    Versions: `load_weights` loads the weights into every healthy replica in parallel; a
    replica that fails to load them is ejected, and a replica is readmitted only after it has
    the latest weights. Answers are passed on unchanged: each carries the version its replica
    computed it with. A replica that answers with an older version than it had loaded (it
    restarted with its initial weights) is ejected too, and caught up when probed.
    ``policy_version`` is the oldest version among the healthy replicas, which is what the
    max-lag gate must assume.

    Example:
        >>> import gymnasium as gym, torch
        >>> from asyncvec.inference import TorchPolicy
        >>> replicas = [lambda: TorchPolicy(torch.nn.Linear(4, 2), gym.spaces.Discrete(2)) for _ in range(2)]
        >>> with RoutedPolicy(replicas) as policy:
        ...     outs = policy.act(np.zeros((4, 4)), timeout=10)
        ...     policy.load_weights(torch.nn.Linear(4, 2).state_dict(), version=1)
        ...     after = policy.submit(np.zeros(4), env_id=0).result(timeout=10)
        >>> len(outs), after.policy_version, [e.healthy for e in policy.endpoints()]
        (4, 1, [True, True])
    """

    def __init__(
        self,
        replicas: Sequence[Replica],
        *,
        names: Sequence[str] | None = None,
        max_failures: int = 1,
        probe_interval_s: float = 1.0,
        probe_timeout_s: float = 10.0,
        probe_obs: Any = None,
        publish_timeout_s: float = 60.0,
        close_replicas: bool = True,
    ) -> None:
        if isinstance(replicas, (str, bytes)) or not isinstance(replicas, Sequence) or not replicas:
            raise ValueError(f"RoutedPolicy: replicas must be a non-empty sequence, got {replicas!r}")
        if names is not None and len(names) != len(replicas):
            raise ValueError(f"RoutedPolicy: got {len(names)} names for {len(replicas)} replicas")
        if isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 1:
            raise ValueError(f"RoutedPolicy: max_failures must be an int >= 1, got {max_failures!r}")
        for field, value in (
            ("probe_interval_s", probe_interval_s),
            ("probe_timeout_s", probe_timeout_s),
            ("publish_timeout_s", publish_timeout_s),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"RoutedPolicy: {field} must be a number > 0, got {value!r}")
        self.max_failures = max_failures
        self.probe_interval_s = float(probe_interval_s)
        self.probe_timeout_s = float(probe_timeout_s)
        self.publish_timeout_s = float(publish_timeout_s)
        self.close_replicas = bool(close_replicas)
        self._probe_obs = probe_obs
        self._fixed_probe_obs = probe_obs is not None
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()  # a publish and a readmission never interleave
        self._latest: tuple[Any, int] | None = None
        self._closed = False
        self._rotation = itertools.count()
        self._retried = 0
        self._endpoints: list[_Endpoint] = []
        try:
            for index, replica in enumerate(replicas):
                factory = None if _is_policy(replica) else replica
                if factory is not None and not callable(factory):
                    raise TypeError(
                        f"RoutedPolicy: replicas[{index}] must be a policy or a function building one, "
                        f"got {type(replica).__name__}"
                    )
                policy = replica if factory is None else factory()
                if not _is_policy(policy):
                    raise TypeError(
                        f"RoutedPolicy: replicas[{index}] built a {type(policy).__name__}, "
                        "which has no submit/load_weights"
                    )
                name = names[index] if names is not None else getattr(policy, "base_url", None) or f"replica{index}"
                self._endpoints.append(_Endpoint(str(name), policy, factory))
        except BaseException:
            self._close_replicas()
            raise
        self._wake = threading.Condition(self._lock)
        self._prober = threading.Thread(target=self._probe_loop, name="asyncvec-router-probe", daemon=True)
        self._prober.start()
        self._publisher = ThreadPoolExecutor(
            max_workers=len(self._endpoints), thread_name_prefix="asyncvec-router-publish"
        )

    @classmethod
    def from_urls(
        cls,
        urls: Sequence[str],
        model: str,
        action_parser: Callable[[str], Any],
        *,
        router_options: dict[str, Any] | None = None,
        **policy_options: Any,
    ) -> RoutedPolicy:
        """A router over OpenAI-compatible servers (``asyncvec serve``, vLLM, ...), one
        `OpenAIPolicy` per URL, rebuilt whenever an ejected server is probed.

        ``policy_options`` go to each `OpenAIPolicy` (default ``max_attempts=1``: the router
        retries on another server rather than the same one); ``router_options`` to this class.

        Example:
            >>> router = RoutedPolicy.from_urls(["http://127.0.0.1:9"], "tiny", int, fallback=lambda o, e: 0)
            >>> [e.name for e in router.endpoints()]
            ['http://127.0.0.1:9']
            >>> router.close()
        """
        from asyncvec.inference import OpenAIPolicy

        policy_options.setdefault("max_attempts", 1)
        factories = [functools.partial(OpenAIPolicy, url, model, action_parser, **policy_options) for url in urls]
        return cls(factories, names=list(urls), **(router_options or {}))

    # ------------------------------------------------------------------ the Policy API
    @property
    def policy_version(self) -> int:
        """The oldest version among the healthy replicas (all replicas if none is healthy)."""
        with self._lock:
            pool = [e for e in self._endpoints if e.healthy] or self._endpoints
            return min(e.version for e in pool)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, obs: Any, *, env_id: int | None = None, priority: int = 0) -> Future:
        """Send one observation to the least busy healthy replica; the future resolves to its
        `PolicyOutput` (or to a `BackendError` once every healthy replica failed it).

        Raises:
            PolicyClosedError: after `close`.
            ValueError, TypeError: the chosen replica refused the observation.
        """
        if self._closed:
            raise PolicyClosedError("RoutedPolicy is closed")
        request = _Routed(obs, env_id, priority, Future())
        self._dispatch(request, raise_bad_input=True)
        return request.future

    def act(
        self, obs_batch: Any, *, env_ids: Sequence[int] | None = None, timeout: float | None = None
    ) -> list[PolicyOutput]:
        """Submit a batch (a list, a stacked array or a dict of stacked arrays) and wait for all."""
        return act_via_submit(self, obs_batch, env_ids, timeout)

    def load_weights(self, weights: Any, version: int) -> None:
        """Load ``weights`` as ``version`` into every healthy replica, in parallel.

        A replica that fails to load them is ejected; it gets them when it is readmitted.

        Raises:
            ValueError: ``version`` does not increase, or a replica refused the weights as
                invalid (``ValueError``/``TypeError``; nothing is ejected then).
            BackendError: no replica took the weights.
        """
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"RoutedPolicy: version must be an int >= 0, got {version!r}")
        if self._closed:
            raise PolicyClosedError("RoutedPolicy is closed")
        version = int(version)
        with self._publish_lock:
            if self._latest is not None and version <= self._latest[1]:
                raise ValueError(
                    f"RoutedPolicy: version must be greater than the last published version {self._latest[1]}, "
                    f"got {version}"
                )
            with self._lock:
                targets = [e for e in self._endpoints if e.healthy]
            jobs = {e: self._publisher.submit(e.policy.load_weights, weights, version) for e in targets}
            wait_futures(list(jobs.values()), timeout=self.publish_timeout_s)
            loaded, refused, failed = [], [], []
            for endpoint, job in jobs.items():
                exc = (
                    job.exception(timeout=0) if job.done() else TimeoutError(f"no answer in {self.publish_timeout_s} s")
                )
                if exc is None:
                    loaded.append(endpoint)
                elif isinstance(exc, (ValueError, TypeError)):
                    refused.append(f"{endpoint.name}: {type(exc).__name__}: {exc}")
                else:
                    failed.append((endpoint, exc))
            if not refused:  # weights that replicas refuse as invalid are never handed out again
                self._latest = (weights, version)
            with self._lock:
                for endpoint in loaded:
                    endpoint.version = version
                for endpoint, exc in failed:
                    self._eject_locked(endpoint, f"load_weights(version={version}) failed: {type(exc).__name__}: {exc}")
        if refused:
            raise ValueError(f"RoutedPolicy: replicas refused the weights of version {version}: " + "; ".join(refused))
        if not loaded:
            reasons = "; ".join(f"{e.name}: {type(x).__name__}: {x}" for e, x in failed) or "no healthy replica"
            raise BackendError(f"RoutedPolicy: no replica took the weights of version {version} ({reasons})")

    def endpoints(self) -> list[EndpointStats]:
        """Per-replica health, load, counts, version and latency."""
        with self._lock:
            rows = []
            for e in self._endpoints:
                latencies = np.asarray(e.latencies, dtype=np.float64)
                p50, p99 = np.percentile(latencies, [50, 99]) * 1000.0 if latencies.size else (float("nan"),) * 2
                rows.append(
                    EndpointStats(
                        name=e.name,
                        healthy=e.healthy,
                        outstanding=e.outstanding,
                        **e.counts,
                        policy_version=e.version,
                        latency_p50_ms=float(p50),
                        latency_p99_ms=float(p99),
                        last_error=e.last_error,
                    )
                )
            return rows

    def stats(self) -> dict[str, float]:
        """Totals (requests, answered, errors, retried, healthy_endpoints, policy_version) and,
        per replica ``i``, ``endpoint<i>/<field>`` for the numeric fields of `EndpointStats`."""
        rows = self.endpoints()
        out: dict[str, float] = {
            "requests": sum(r.requests for r in rows),
            "answered": sum(r.answered for r in rows),
            "errors": sum(r.errors for r in rows),
            "retried": self._retried,
            "healthy_endpoints": sum(r.healthy for r in rows),
            "policy_version": self.policy_version,
        }
        for index, row in enumerate(rows):
            for key, value in dataclasses.asdict(row).items():
                if isinstance(value, (bool, int, float)):
                    out[f"endpoint{index}/{key}"] = float(value)
        return out

    def close(self) -> None:
        """Stop probing and close every replica (their unanswered requests fail with
        `PolicyClosedError`; failures that closing causes eject nothing). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        self._prober.join(self.probe_timeout_s + 5.0)
        self._publisher.shutdown(wait=False, cancel_futures=True)
        self._close_replicas()

    def __repr__(self) -> str:
        healthy = sum(e.healthy for e in self._endpoints)
        return f"RoutedPolicy({healthy}/{len(self._endpoints)} healthy, policy_version={self.policy_version})"

    # ------------------------------------------------------------------ routing
    def _pick_locked(self, tried: list[_Endpoint]) -> _Endpoint | None:
        candidates = [e for e in self._endpoints if e.healthy and e not in tried]
        if not candidates:
            return None
        least = min(e.outstanding for e in candidates)
        idle = [e for e in candidates if e.outstanding == least]
        return idle[next(self._rotation) % len(idle)]  # rotate among equally loaded replicas

    def _dispatch(self, request: _Routed, raise_bad_input: bool = False) -> None:
        while True:
            with self._lock:
                if self._closed:
                    request.future.set_exception(PolicyClosedError("RoutedPolicy was closed before answering"))
                    return
                endpoint = self._pick_locked(request.tried)
                if endpoint is None:
                    break
                endpoint.outstanding += 1
                endpoint.counts["requests"] += 1
                request.expected = endpoint.version
            request.tried.append(endpoint)
            started = time.monotonic()
            try:
                future = endpoint.policy.submit(request.obs, env_id=request.env_id, priority=request.priority)
            except (ValueError, TypeError) as exc:
                self._settle(endpoint)
                if raise_bad_input:
                    raise
                request.future.set_exception(exc)
                return
            except Exception as exc:  # closed or unreachable: try the next replica
                self._record_failure(endpoint, request, exc)
                continue
            future.add_done_callback(functools.partial(self._on_answer, request, endpoint, started))
            return
        with self._lock:
            states = "; ".join(f"{e.name}: {'healthy' if e.healthy else 'ejected'}" for e in self._endpoints)
        tried = "; ".join(request.errors) if request.errors else "none tried"
        request.future.set_exception(
            BackendError(
                f"RoutedPolicy: no healthy replica left for env_id={request.env_id} (errors: {tried}; {states})"
            )
        )

    def _settle(self, endpoint: _Endpoint) -> None:
        with self._lock:
            endpoint.outstanding -= 1

    def _on_answer(self, request: _Routed, endpoint: _Endpoint, started: float, future: Future) -> None:
        exc = future.exception()
        if exc is None:
            output: PolicyOutput = future.result()
            with self._lock:
                endpoint.outstanding -= 1
                endpoint.counts["answered"] += 1
                endpoint.counts["fallbacks"] += bool(output.fallback)
                endpoint.latencies.append(time.monotonic() - started)
                if output.policy_version < request.expected:
                    # Honest but older than what it had loaded: it lost its weights (a restart).
                    endpoint.version = int(output.policy_version)
                    self._eject_locked(
                        endpoint,
                        f"answered with version {output.policy_version} after loading {request.expected} "
                        "(restarted without its weights?)",
                    )
                else:
                    endpoint.failures_in_row = 0
                    endpoint.version = max(endpoint.version, int(output.policy_version))
                    if not self._fixed_probe_obs and _computed_by_replica(output):
                        self._probe_obs = request.obs
            request.future.set_result(output)  # the answer is honest: it carries its own version
            return
        if _is_request_fault(exc):
            with self._lock:
                endpoint.outstanding -= 1
                endpoint.counts["errors"] += 1
            request.future.set_exception(exc)
            return
        if self._closed:
            # close() ended the replicas (RayPolicy.close kills its actor): this failure says nothing about the
            # replica's health, so it ejects nothing (a warning "ejected ...: killed by ray.kill" after a timed-out
            # request once read as if the replica had died by itself)
            with self._lock:
                endpoint.outstanding -= 1
                endpoint.counts["errors"] += 1
            request.future.set_exception(PolicyClosedError("RoutedPolicy was closed before answering"))
            return
        self._record_failure(endpoint, request, exc)
        with self._lock:
            self._retried += 1
        try:
            self._dispatch(request)
        except BaseException as error:  # never leave the caller's future unresolved
            if not request.future.done():
                request.future.set_exception(error)

    def _record_failure(self, endpoint: _Endpoint, request: _Routed, exc: BaseException) -> None:
        request.errors.append(f"{endpoint.name}: {type(exc).__name__}: {exc}")
        with self._lock:
            endpoint.outstanding -= 1
            endpoint.counts["errors"] += 1
            endpoint.failures_in_row += 1
            if endpoint.healthy and endpoint.failures_in_row >= self.max_failures:
                self._eject_locked(endpoint, f"{type(exc).__name__}: {exc}")

    def _eject_locked(self, endpoint: _Endpoint, reason: str) -> None:
        if not endpoint.healthy:
            return
        endpoint.healthy = False
        endpoint.counts["ejections"] += 1
        endpoint.last_error = reason
        endpoint.next_probe = time.monotonic() + self.probe_interval_s
        logger.warning("RoutedPolicy: ejected %s: %s", endpoint.name, reason)
        self._wake.notify_all()

    # ------------------------------------------------------------------ probing
    def _probe_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                due = [e for e in self._endpoints if not e.healthy and e.next_probe <= now]
                if not due:
                    waits = [e.next_probe - now for e in self._endpoints if not e.healthy]
                    self._wake.wait(min(waits) if waits else None)
                    continue
            for endpoint in due:
                if self._closed:
                    return
                self._probe(endpoint)

    def _probe(self, endpoint: _Endpoint) -> None:
        try:
            if self._probe_obs is None:
                raise BackendError("nothing to probe with yet (pass probe_obs=...)")
            if endpoint.factory is not None:  # a fresh client: a restarted server starts from scratch
                old, endpoint.policy = endpoint.policy, endpoint.factory()
                _close_quietly(old)
            answer = endpoint.policy.submit(self._probe_obs).result(timeout=self.probe_timeout_s)
            if not _computed_by_replica(answer):
                raise BackendError("the probe got a deadline or error fallback, not a model answer")
            with self._publish_lock:
                version = int(answer.policy_version)
                if self._latest is not None and version < self._latest[1]:
                    endpoint.policy.load_weights(*self._latest)
                    version = self._latest[1]
                with self._lock:
                    endpoint.version = version
                    endpoint.healthy = True
                    endpoint.failures_in_row = 0
                    endpoint.counts["readmissions"] += 1
            logger.warning("RoutedPolicy: readmitted %s at version %d", endpoint.name, version)
        except Exception as exc:
            with self._lock:
                endpoint.last_error = f"probe failed: {type(exc).__name__}: {exc}"
                endpoint.next_probe = time.monotonic() + self.probe_interval_s

    def _close_replicas(self) -> None:
        for endpoint in self._endpoints:
            if self.close_replicas or endpoint.factory is not None:
                _close_quietly(endpoint.policy)


def _computed_by_replica(output: PolicyOutput) -> bool:
    """The replica's model computed this answer: not a deadline or error fallback. A text
    completion its action parser rejected is a fallback too, but the model wrote it."""
    return not output.fallback or output.text is not None


def _is_policy(obj: Any) -> bool:
    return callable(getattr(obj, "submit", None)) and callable(getattr(obj, "load_weights", None))


def _close_quietly(policy: Any) -> None:
    try:
        policy.close()
    except Exception as exc:
        logger.debug("closing %r failed: %r", policy, exc)
