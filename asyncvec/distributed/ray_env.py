"""Env workers as Ray actors: ``AsyncLLMVectorEnv(env_fns, backend=RayBackend(...))``.

Same API and semantics as worker processes (the vector env holds them; this module only moves
messages): each worker is one Ray actor hosting ``envs_per_worker`` envs, each message one
actor call, and partial batches come from ``ray.wait`` over the oldest outstanding call of
every busy actor.

Faults: actors are created with ``max_restarts=-1`` and ``max_task_retries=0``. A ``step`` is
never retried (it is not idempotent): when an actor dies (its process is killed, its node
leaves the cluster) or hangs past ``step_timeout`` (then it is killed), Ray re-runs its
constructor, on another node if its own is gone, and the envs it hosted come back truncated,
as with worker processes; ``max_restarts`` of the vector env bounds how often. If no alive
node can host the actor any more (e.g. it was pinned to the removed node), the vector env
raises a ``WorkerError`` saying which resources are missing, instead of waiting.

Example:
    >>> import gymnasium as gym
    >>> from asyncvec import AsyncLLMVectorEnv
    >>> from asyncvec.distributed.ray_env import RayBackend
    >>> envs = AsyncLLMVectorEnv(  # doctest: +SKIP
    ...     [lambda: gym.make("CartPole-v1")] * 8,
    ...     batch_size=4,
    ...     backend=RayBackend(address="auto", num_cpus=0.5),
    ... )
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gymnasium import Env
from gymnasium.vector.vector_env import AutoresetMode

from asyncvec.distributed.runtime import connect, feasible_nodes, required_resources
from asyncvec.vector.transport import Backend, Transport, WorkerSpec
from asyncvec.vector.worker import BuildFailureError, EnvGroup

__all__ = ["RayBackend", "RayTransport"]

# Options the backend owns: restarts are counted by the vector env and a step is never retried.
_RESERVED = ("max_restarts", "max_task_retries")
_POLL_S = 1.0  # how often a worker that is not ready yet is checked for being unschedulable


class _EnvWorker:
    """The actor: an :class:`EnvGroup` of envs; build failures are answered by ``ready``."""

    def __init__(self, env_fns: Sequence[Callable[[], Env]], indices: Sequence[int], autoreset_mode: AutoresetMode):
        self.group: EnvGroup | None = None
        self.failure = None
        try:
            self.group = EnvGroup(env_fns, indices, autoreset_mode)
        except BuildFailureError as exc:
            self.failure = exc.failure

    def ready(self) -> tuple[bool, Any]:
        import ray

        if self.failure is not None:
            return False, self.failure
        return True, {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def handle(self, items: list[tuple[int, str, Any]]) -> list[Any]:
        return self.group.handle(items)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


@dataclass
class RayBackend(Backend):
    """Workers as Ray actors on a cluster (see the module docstring).

    Args:
        address: the cluster to join (``"auto"``, ``"ray://host:10001"``, a GCS address). ``None``:
            the Ray already initialized in this process, else ``$RAY_ADDRESS`` if set, else a
            new local Ray, which the last env using it shuts down on ``close()``.
        num_cpus: CPUs each worker reserves (``None``: Ray's actor default, 1 CPU to be placed
            and 0 while running, so any number of workers fit on a node with a CPU).
        resources: custom resources each worker needs (e.g. ``{"simulator": 1}``).
        actor_options: more ``.options(...)`` per worker: a dict for all, or a function of
            the worker index (``scheduling_strategy`` for node affinity or spreading,
            ``memory``, ``runtime_env``...). Its ``resources`` add to ``resources``.

    Example:
        >>> from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        >>> backend = RayBackend(num_cpus=0.5, actor_options={"scheduling_strategy": "SPREAD"})
        >>> backend.options(0)["scheduling_strategy"]
        'SPREAD'
    """

    address: str | None = None
    num_cpus: float | None = None
    resources: Mapping[str, float] | None = None
    actor_options: Mapping[str, Any] | Callable[[int], Mapping[str, Any]] | None = None

    local = False

    def options(self, worker: int) -> dict[str, Any]:
        """The ``.options(...)`` of worker ``worker``'s actor."""
        extra = self.actor_options(worker) if callable(self.actor_options) else dict(self.actor_options or {})
        reserved = [key for key in _RESERVED if key in extra]
        if reserved:
            raise ValueError(
                f"actor_options must not set {reserved}: restarts are bounded by AsyncLLMVectorEnv(max_restarts=...) "
                "and a step is never retried"
            )
        options: dict[str, Any] = {**extra, "max_restarts": -1, "max_task_retries": 0}
        if self.num_cpus is not None:
            options.setdefault("num_cpus", self.num_cpus)
        resources = {**(self.resources or {}), **(extra.get("resources") or {})}
        if resources:
            options["resources"] = resources
        return options

    def create(self, spec: WorkerSpec) -> RayTransport:
        return RayTransport(spec, self)


# Envs alive in this process on a Ray that one of them started: the last to close shuts it down.
_local_ray_users = 0


class RayTransport(Transport):
    """One Ray actor per worker; a FIFO of outstanding calls per actor."""

    def __init__(self, spec: WorkerSpec, backend: RayBackend) -> None:
        global _local_ray_users
        import ray

        self._owns_ray = connect(backend.address) or _local_ray_users > 0
        if self._owns_ray:
            _local_ray_users += 1
        self._actors: list[Any] = []
        self._refs: list[deque[Any]] = [deque() for _ in spec.groups]
        self._info: list[dict[str, Any]] = [{} for _ in spec.groups]
        self._closed = False
        try:
            self._options = [backend.options(w) for w in range(len(spec.groups))]
            actor_class = ray.remote(_EnvWorker)
            for w, group in enumerate(spec.groups):
                options = actor_class.options(**self._options[w])
                self._actors.append(options.remote([spec.env_fns[i] for i in group], list(group), spec.autoreset_mode))
        except BaseException:
            self.close(timeout=0, terminate=True)
            raise

    def await_ready(self, worker: int, timeout: float) -> tuple[bool, Any]:
        import time

        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = time.monotonic() + timeout
        ref = self._actors[worker].ready.remote()
        while True:
            try:
                ok, info = ray.get(ref, timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
            except GetTimeoutError:
                ok, info = None, None
            except RayActorError:  # still restarting: ask the next incarnation
                ok, info = None, None
                time.sleep(0.1)
                ref = self._actors[worker].ready.remote()
            if ok is not None:
                if ok:
                    self._info[worker] = info
                return ok, info
            if not feasible_nodes(self._options[worker]):
                return False, (
                    "Unschedulable",
                    f"no alive node of the Ray cluster can host this worker: it needs "
                    f"{required_resources(self._options[worker])} and "
                    f"options {({k: v for k, v in self._options[worker].items() if k not in _RESERVED})}",
                    "",
                    None,
                )
            if time.monotonic() >= deadline:
                return False, ("StartTimeout", f"the Ray actor did not build its envs within {timeout} s", "", None)

    def send(self, worker: int, message: list[tuple[int, str, Any]]) -> None:
        self._refs[worker].append(self._actors[worker].handle.remote(message))

    def wait(self, workers: Sequence[int], timeout: float | None) -> list[int]:
        import ray

        heads = {self._refs[w][0]: w for w in workers}
        refs = list(heads)
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready and len(refs) > 1:  # take every reply that is already there, not just the first
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return [heads[ref] for ref in ready]

    def read(self, worker: int) -> tuple[bool, Any]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        ref = self._refs[worker].popleft()
        try:
            return True, ray.get(ref)
        except RayActorError as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return False, ("WorkerDied", f"Ray actor died ({type(exc).__name__}: {reason})", "", None)
        except RayTaskError as exc:  # the actor raised outside any env (e.g. an unpicklable answer)
            cause = exc.cause if exc.cause is not None else exc
            return False, (type(cause).__name__, str(cause), str(exc), None)

    def read_many(self, workers: Sequence[int]) -> list[tuple[bool, Any]]:
        import ray

        if len(workers) < 2:
            return [self.read(worker) for worker in workers]
        refs = [self._refs[w][0] for w in workers]
        try:
            replies = ray.get(refs)  # one call for the whole batch
        except Exception:
            return [self.read(worker) for worker in workers]  # find out which one failed, and how
        for worker in workers:
            self._refs[worker].popleft()
        return [(True, reply) for reply in replies]

    def kill(self, worker: int) -> None:
        import ray

        ray.kill(self._actors[worker], no_restart=False)  # Ray re-runs the constructor
        self._refs[worker].clear()

    def restart(self, worker: int) -> None:
        # Ray re-runs the constructor of a dead actor by itself. An actor that was only
        # unreachable keeps its envs, which is still consistent: the vector env restarts every
        # env of the worker with commands that end or redo its episode.
        self._refs[worker].clear()

    def close(self, timeout: float | None, terminate: bool) -> None:
        global _local_ray_users
        if self._closed:
            return
        self._closed = True
        import ray

        if not ray.is_initialized():
            if self._owns_ray:
                _local_ray_users -= 1
            return
        if not terminate:  # let envs close (a simulator may hold resources), then kill
            closing = [actor.close.remote() for actor in self._actors]
            ray.wait(closing, num_returns=len(closing), timeout=timeout)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass  # already gone
        if self._owns_ray:
            _local_ray_users -= 1
            if _local_ray_users == 0:
                ray.shutdown()

    def pid(self, worker: int) -> int | None:
        return self._info[worker].get("pid")

    def node(self, worker: int) -> str | None:
        return self._info[worker].get("node_id")
