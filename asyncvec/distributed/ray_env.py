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

Each constructor run (incarnation) draws a token; every message carries the token of the
incarnation it is meant for, and an actor refuses a message meant for another one. So an
actor that Ray rebuilt between two messages is a worker loss (its envs are new), never a
silent reset; and after a loss only a new incarnation is accepted as ready, not a process
left running on a crashed node (Ray sees a crash only through its health checks, ~15 s).
A loss whose node is gone is reported as ``NodeLost``, otherwise ``WorkerDied``.

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
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gymnasium import Env
from gymnasium.vector.vector_env import AutoresetMode

from asyncvec.distributed.runtime import connect, placement_problem, required_resources
from asyncvec.extras import check_installed
from asyncvec.vector.transport import Backend, Transport, WorkerSpec
from asyncvec.vector.worker import BuildFailureError, EnvGroup

__all__ = ["RayBackend", "RayTransport"]

# Options the backend owns: restarts are counted by the vector env and a step is never retried.
_RESERVED = ("max_restarts", "max_task_retries")
_POLL_S = 1.0  # how often a worker that is not ready yet is checked for being unschedulable
_PROBE_S = 1.0  # how long a node's raylet may take to accept a connection before it counts as lost


class _Rebuilt:
    """An actor's answer to a message meant for an earlier incarnation: nothing was run."""

    def __init__(self, incarnation: str) -> None:
        self.incarnation = incarnation


class _EnvWorker:
    """The actor: an :class:`EnvGroup` of envs; build failures are answered by ``ready``."""

    def __init__(self, env_fns: Sequence[Callable[[], Env]], indices: Sequence[int], autoreset_mode: AutoresetMode):
        self.incarnation = uuid.uuid4().hex
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
        node_id = ray.get_runtime_context().get_node_id()
        return True, {"pid": os.getpid(), "node_id": node_id, "incarnation": self.incarnation}

    def handle(self, incarnation: str, items: list[tuple[int, str, Any]]) -> list[Any] | _Rebuilt:
        if incarnation != self.incarnation:
            return _Rebuilt(self.incarnation)
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
        num_cpus: CPUs each worker holds while it runs. ``None``: none, so any number of
            workers fit on a node (Ray's actor default: 1 CPU to be placed, 0 while running;
            when ``resources``, ``num_gpus`` or a pin by custom resource is set, where Ray would
            hold 1 CPU for the actor's life, the backend asks for ``num_cpus=0`` instead).
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

    def __post_init__(self) -> None:
        check_installed("ray", extra="ray", feature="AsyncLLMVectorEnv(backend='ray') (RayBackend)")

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
        if options.get("num_cpus") is None and (resources or options.get("num_gpus")):
            # Ray holds 1 CPU for the life of an actor that asks for any resource but no CPUs:
            # keep the documented default (no CPU while running) in that case too.
            options["num_cpus"] = 0
        return options

    def parallelism(self) -> int:
        """The cluster's CPUs when Ray is already running in this process, else this machine's cores."""
        import ray

        if ray.is_initialized():
            return max(1, int(ray.cluster_resources().get("CPU", 1)))
        return super().parallelism()

    def create(self, spec: WorkerSpec) -> RayTransport:
        return RayTransport(spec, self)


# Envs alive in this process on a Ray that one of them started: the last to close shuts it down.
_local_ray_users = 0


class RayTransport(Transport):
    """One Ray actor per worker; a FIFO of outstanding calls per actor."""

    def __init__(self, spec: WorkerSpec, backend: RayBackend) -> None:
        global _local_ray_users

        self._owns_ray = connect(backend.address) or _local_ray_users > 0  # ray.init: in this (the main) thread
        if self._owns_ray:
            _local_ray_users += 1
        self._actors: list[Any] = []
        self._refs: list[deque[Any]] = [deque() for _ in spec.groups]
        self._info: list[dict[str, Any]] = [{} for _ in spec.groups]
        # The incarnation each worker's messages are meant for (None until it is ready), the
        # ones never to accept again, and each worker's outstanding ``ready`` call.
        self._incarnation: list[str | None] = [None] * len(spec.groups)
        self._stale: list[set[str]] = [set() for _ in spec.groups]
        self._ready_refs: list[Any] = [None] * len(spec.groups)
        self._closed = False
        try:
            self._options = [backend.options(w) for w in range(len(spec.groups))]
            _within(spec.start_timeout, "creating its actors (Ray's GCS did not answer)", self._create_actors, spec)
        except BaseException:
            self.close(timeout=0, terminate=True)
            raise

    def _create_actors(self, spec: WorkerSpec) -> None:
        import ray

        actor_class = ray.remote(_EnvWorker)
        for w, group in enumerate(spec.groups):
            options = actor_class.options(**self._options[w])
            actor = options.remote([spec.env_fns[i] for i in group], list(group), spec.autoreset_mode)
            if self._closed:  # the start gave up waiting for this call (_within): leave no actor behind
                ray.kill(actor)
                return
            self._actors.append(actor)
            self._ready_refs[w] = self._actors[w].ready.remote()

    def await_ready(self, worker: int, timeout: float) -> tuple[bool, Any]:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = time.monotonic() + timeout
        checked_at = float("-inf")
        killed_stale = False
        while True:
            if self._ready_refs[worker] is None:
                self._ready_refs[worker] = self._actors[worker].ready.remote()
            try:
                ok, info = ray.get(
                    self._ready_refs[worker], timeout=max(0.0, min(_POLL_S, deadline - time.monotonic()))
                )
            except GetTimeoutError:
                ok, info = None, None
            except RayActorError:  # still restarting: ask the next incarnation
                ok, info = None, None
                self._ready_refs[worker] = None
                time.sleep(0.1)
            if ok is not None:
                self._ready_refs[worker] = None
                if not (ok and info["incarnation"] in self._stale[worker]):
                    if ok:
                        self._incarnation[worker] = info["incarnation"]
                        self._info[worker] = info
                    return ok, info
                # The incarnation that failed still answers: a process left on a crashed node
                # (until Ray's health checks notice), or one that was only unreachable. Its envs
                # are not to be trusted: end it, so that Ray builds a new one.
                if not killed_stale:
                    killed_stale = True
                    try:
                        ray.kill(self._actors[worker], no_restart=False)
                    except Exception:
                        pass
                time.sleep(0.2)
            if time.monotonic() - checked_at >= _POLL_S:
                checked_at = time.monotonic()
                problem = placement_problem(self._options[worker], self._placed(exclude=worker))
                if problem is not None:
                    options = {k: v for k, v in self._options[worker].items() if k not in _RESERVED}
                    return False, ("Unschedulable", f"{problem} (the worker's actor options: {options})", "", None)
            if time.monotonic() >= deadline:
                need = required_resources(self._options[worker], placement=True)
                return False, (
                    "StartTimeout",
                    f"the Ray actor did not build its envs within {timeout} s; it needs {need} on a node, "
                    f"the cluster has {ray.available_resources()} free now",
                    "",
                    None,
                )

    def _placed(self, exclude: int) -> list[tuple[str, str, dict[str, Any]]]:
        """(label, node id, options) of the other workers' actors known to run (they hold their
        resources while they do), looking at the answers of those still starting without waiting."""
        import ray

        placed = []
        for other, options in enumerate(self._options):
            if other == exclude:
                continue
            node = self._info[other].get("node_id") if self._incarnation[other] is not None else None
            ref = self._ready_refs[other]
            if node is None and ref is not None and ray.wait([ref], timeout=0)[0]:
                try:
                    ok, info = ray.get(ref)
                except Exception:
                    ok, info = False, None
                if ok and info["incarnation"] not in self._stale[other]:
                    node = info["node_id"]
            if node is not None:
                placed.append((f"worker {other}", node, options))
        return placed

    def send(self, worker: int, message: list[tuple[int, str, Any]]) -> None:
        self._refs[worker].append(self._actors[worker].handle.remote(self._incarnation[worker], message))

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
            return self._reply(worker, ray.get(ref))
        except RayActorError as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return False, self._loss(worker, f"{type(exc).__name__}: {reason}")
        except RayTaskError as exc:  # the actor raised outside any env (e.g. an unpicklable answer)
            cause = exc.cause if exc.cause is not None else exc
            return False, (type(cause).__name__, str(cause), str(exc), None)

    def _reply(self, worker: int, reply: Any) -> tuple[bool, Any]:
        if isinstance(reply, _Rebuilt):
            return False, self._loss(worker, "Ray rebuilt it since its last message, so its envs are new")
        return True, reply

    def _loss(self, worker: int, what: str) -> tuple[str, str, str, None]:
        """The failure payload of a lost actor, naming its node if the node is gone."""
        node = self._info[worker].get("node_id")
        gone = _node_gone(node) if node is not None else None
        if gone is not None:
            return "NodeLost", f"the Ray actor's node {node} {gone} ({what})", "", None
        return "WorkerDied", f"Ray actor died ({what})", "", None

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
        return [self._reply(worker, reply) for worker, reply in zip(workers, replies, strict=True)]

    def kill(self, worker: int) -> None:
        import ray

        ray.kill(self._actors[worker], no_restart=False)  # Ray re-runs the constructor
        self._refs[worker].clear()

    def restart(self, worker: int) -> None:
        # Ray re-runs the constructor of a dead actor by itself; await_ready accepts only a new
        # incarnation (and ends the old one if it still answers).
        self._refs[worker].clear()
        if self._incarnation[worker] is not None:
            self._stale[worker].add(self._incarnation[worker])
        self._incarnation[worker] = None
        self._info[worker] = {}
        self._ready_refs[worker] = None

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


def _within(seconds: float, stage: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Runs ``fn(*args)``, which calls into Ray and may block without a deadline of its own (an actor's
    creation exports its class through the GCS: seen waiting for 17 minutes on a GCS that no longer
    answered); raises ``TimeoutError`` naming the backend and ``stage`` if it takes longer than ``seconds``
    (the call is left in a daemon thread: Ray offers no way to cancel it)."""
    failure: list[BaseException] = []
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(fn(*args))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"asyncvec-ray-{stage.split()[0]}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(
            f"backend='ray': {stage}: no answer within start_timeout={seconds} s; `ray status` shows whether "
            f"the cluster answers (a local Ray: ray.shutdown() and start again)"
        )
    if failure:
        raise failure[0]
    return result[0]


def _node_gone(node_id: str) -> str | None:
    """How node ``node_id`` left the cluster, or ``None`` if it is still there.

    Ray marks a crashed node dead only after its health checks fail (about 15 s by default);
    meanwhile a raylet that refuses connections tells the loss at once.
    """
    import ray

    for node in ray.nodes():
        if node["NodeID"] != node_id:
            continue
        if not node.get("Alive"):
            return f"left the cluster ({node.get('DeathReasonMessage') or 'marked dead by Ray'})"
        address = (node["NodeManagerAddress"], int(node["NodeManagerPort"]))
        try:
            socket.create_connection(address, timeout=_PROBE_S).close()
        except OSError as exc:
            return f"is lost: its raylet at {address[0]}:{address[1]} does not answer ({exc})"
        return None
    return "left the cluster"
