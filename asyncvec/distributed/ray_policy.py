"""`RayPolicy`: a policy replica that lives in a Ray actor (on any node of the cluster).

The actor builds the policy from a function (e.g. a `TorchPolicy` on the node's GPU) and
serves ``submit`` calls concurrently, so its own `DynamicBatcher` batches the requests that
arrive from every client, as an inference server does. Several of them behind a
`RoutedPolicy` make a fleet of inference replicas.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from asyncvec.distributed.router import act_via_submit
from asyncvec.distributed.runtime import RayStateError
from asyncvec.inference.types import BackendError, Policy, PolicyClosedError, PolicyOutput
from asyncvec.lifecycle import ClosesOnExit

__all__ = ["RayPolicy"]

logger = logging.getLogger(__name__)


class _PolicyServer:
    """The actor: one policy, answering every caller's requests concurrently (an async actor)."""

    def __init__(self, policy_fn: Callable[[], Policy]) -> None:
        import ray

        self.policy = policy_fn()
        self.node_id = ray.get_runtime_context().get_node_id()

    async def submit(self, obs: Any, env_id: int | None, priority: int) -> PolicyOutput:
        return await asyncio.wrap_future(self.policy.submit(obs, env_id=env_id, priority=priority))

    async def load_weights(self, weights: Any, version: int) -> int:
        await asyncio.to_thread(self.policy.load_weights, weights, version)
        return self.policy.policy_version

    async def describe(self) -> dict[str, Any]:
        return {"policy_version": self.policy.policy_version, "node_id": self.node_id}

    async def stats(self) -> dict[str, float]:
        return self.policy.stats()

    async def close(self) -> None:
        await asyncio.to_thread(self.policy.close)


class RayPolicy(ClosesOnExit):
    """A `Policy` whose model runs in a Ray actor; one RPC per request, batched in the actor.

    Args:
        policy_fn: builds the policy inside the actor (it travels with cloudpickle).
        name: a name for errors and metrics (default ``RayPolicy``).
        actor_options: Ray ``.options(...)`` of the actor: ``num_cpus``, ``num_gpus``,
            ``resources``, ``scheduling_strategy``, ``max_restarts`` (default ``-1``: Ray
            rebuilds the actor when it or its node dies; behind a `RoutedPolicy` the
            rebuilt replica is probed back in and given the latest weights).
        timeout_s: how long `load_weights`, `stats` and `close` wait for the actor.

    Answers carry the version of the actor's policy. ``policy_version`` is the version of
    the latest answer or weight load this client saw (it drops when a rebuilt actor answers
    with its initial weights). Ray must be initialized (see `asyncvec.distributed.connect`).

    Errors: the actor's ``ValueError``/``TypeError`` (a bad observation) reach the caller as
    they are; a dead or unreachable actor fails the request with a `BackendError`.

    Example:
        >>> import ray, gymnasium as gym, torch
        >>> from asyncvec.inference import TorchPolicy
        >>> _ = ray.init(num_cpus=1, log_to_driver=False)  # doctest: +SKIP
        >>> policy = RayPolicy(lambda: TorchPolicy(torch.nn.Linear(4, 2), gym.spaces.Discrete(2)))  # doctest: +SKIP
        >>> policy.submit([0.0] * 4, env_id=0).result(timeout=30).policy_version  # doctest: +SKIP
        0
    """

    def __init__(
        self,
        policy_fn: Callable[[], Policy],
        *,
        name: str | None = None,
        actor_options: Mapping[str, Any] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        import ray

        if not callable(policy_fn):
            raise TypeError(
                f"RayPolicy: policy_fn must be a function building a policy, got {type(policy_fn).__name__}"
            )
        if not ray.is_initialized():
            raise RayStateError("RayPolicy needs Ray: call asyncvec.distributed.connect() or ray.init() first")
        self.name = name or "RayPolicy"
        self.timeout_s = float(timeout_s)
        self.actor_options = {"max_restarts": -1, "num_cpus": 0, **(actor_options or {})}
        self._actor = ray.remote(_PolicyServer).options(**self.actor_options).remote(policy_fn)
        self._version = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def actor(self) -> Any:
        """The Ray actor handle (e.g. for ``ray.kill`` in fault tests)."""
        return self._actor

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def closed(self) -> bool:
        return self._closed

    def describe(self) -> dict[str, Any]:
        """The actor's current ``policy_version`` and ``node_id`` (one RPC)."""
        import ray

        return ray.get(self._actor.describe.remote(), timeout=self.timeout_s)

    def submit(self, obs: Any, *, env_id: int | None = None, priority: int = 0) -> Future:
        """Send one observation to the actor; the future resolves to its `PolicyOutput`."""
        if self._closed:
            raise PolicyClosedError(f"{self.name} is closed")
        outer: Future = Future()
        inner = self._actor.submit.remote(obs, env_id, priority).future()
        inner.add_done_callback(lambda done: self._deliver(done, outer, env_id))
        return outer

    def _deliver(self, done: Future, outer: Future, env_id: int | None) -> None:
        import ray

        exc = done.exception()
        if exc is None:
            output = done.result()
            with self._lock:
                self._version = int(output.policy_version)
            outer.set_result(output)
            return
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.as_instanceof_cause()
            if isinstance(cause, (ValueError, TypeError, BackendError, PolicyClosedError)):
                outer.set_exception(cause)
                return
        error = BackendError(f"{self.name}: env_id={env_id}: the policy actor failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        outer.set_exception(error)

    def act(
        self, obs_batch: Any, *, env_ids: Sequence[int] | None = None, timeout: float | None = None
    ) -> list[PolicyOutput]:
        """Submit a batch and wait for all answers."""
        return act_via_submit(self, obs_batch, env_ids, timeout)

    def load_weights(self, weights: Any, version: int) -> None:
        """Load ``weights`` (a value or a ``ray.ObjectRef``) as ``version`` in the actor.

        Raises:
            ValueError: the version does not increase or the weights do not fit (from the actor).
            BackendError: the actor is dead or did not answer in ``timeout_s``.
        """
        import ray

        if self._closed:
            raise PolicyClosedError(f"{self.name} is closed")
        try:
            loaded = ray.get(self._actor.load_weights.remote(weights, version), timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise BackendError(
                f"{self.name}: load_weights(version={version}) failed: {type(exc).__name__}: {exc}"
            ) from exc
        with self._lock:
            self._version = int(loaded)

    def stats(self) -> dict[str, float]:
        """The actor's policy stats (one RPC); empty when the actor is unreachable."""
        import ray

        try:
            return ray.get(self._actor.stats.remote(), timeout=self.timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            return {}

    def close(self) -> None:
        """Close the policy in the actor and end the actor. Idempotent."""
        import ray

        if self._closed:
            return
        self._closed = True
        try:
            ray.get(self._actor.close.remote(), timeout=min(self.timeout_s, 10.0))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            logger.debug("%s: closing the actor's policy failed: %r", self.name, exc)
        ray.kill(self._actor, no_restart=True)

    def __repr__(self) -> str:
        return f"{self.name}(policy_version={self._version}, closed={self._closed})"
