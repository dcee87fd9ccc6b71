"""Distributed collection: collector actors on several Ray nodes feed the learner's buffer.

Each collector actor hosts a slice of the envs in worker processes (an `AsyncLLMVectorEnv`), its
own policy client, and runs the ordinary `Collector` on them. Its transitions stream to the
learner process through Ray, where they are committed to the learner's `RolloutStore` or
`ReplayBuffer` as the local `Collector` would commit them:

* **Back-pressure**: each actor buffers at most ``max_buffered_steps`` transitions and the
  learner keeps one pull in flight per actor; a transition that does not fit the learner's
  `RolloutStore` yet waits here and that actor is not pulled meanwhile. A learner that stops
  taking data stops the envs.
* **Versions**: every transition carries the version that chose its action. The learner's
  `VersionManager` version reaches every actor, whose collector submits only while its policy
  is within ``max_lag`` of it; registered with the manager, `DistributedCollector` publishes
  the weights to every actor (one object-store copy).
* **Faults**: a collector whose node dies is rebuilt by Ray on another node that can host it,
  then restarted with the latest weights; what reached the learner stays, the episodes the
  fault interrupted end truncated, and a collector that nothing can host is a
  `CollectorError` naming what it needs.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from asyncvec.buffers import ReplayBuffer, RolloutStore, Transitions
from asyncvec.collection.base import BackgroundCollector, CollectorError
from asyncvec.collection.collector import Sink, check_sink
from asyncvec.distributed.collector_actor import CollectorActor
from asyncvec.distributed.runtime import connect, feasible_nodes, placement_problem, required_resources
from asyncvec.inference.types import Policy
from asyncvec.lifecycle import ClosesOnExit
from asyncvec.versioning import VersionManager

__all__ = ["DistributedCollector", "RayCollectors"]

logger = logging.getLogger(__name__)

# Episode ids are made unique across collectors and their restarts: a collector incarnation's
# local id ``e`` becomes ``incarnation * EPISODE_STRIDE + e``.
EPISODE_STRIDE = 1 << 40


class RayCollectors(ClosesOnExit):
    """Collector actors on a Ray cluster, each hosting a contiguous slice of the envs.

    This is the env side of distributed collection; a `DistributedCollector` drives it with a
    policy and a sink, as `Collector` drives an `AsyncLLMVectorEnv`. Env ``j`` of the whole
    set keeps its index in every transition (``env_id``), whichever collector hosts it.

    Args:
        env_fns: one function per env (they travel with cloudpickle).
        num_collectors: collector actors; the envs are split among them as evenly as possible.
        address: the cluster to join when this process is not connected to Ray yet (default
            ``$RAY_ADDRESS``, else a new local Ray that `close` shuts down).
        actor_options: Ray ``.options(...)`` of every collector actor (default ``num_cpus=1``,
            ``scheduling_strategy="SPREAD"``), or one dict per collector (e.g. to pin them to
            nodes with custom resources). ``max_restarts`` defaults to ``-1``: Ray rebuilds a
            collector whose process or node died, wherever the options allow.
        batch_size: ``recv`` batch of each collector's env (default: half its envs).
        autoreset_mode: NEXT_STEP or SAME_STEP (default, what the agents use).
        env_options: more `AsyncLLMVectorEnv` arguments for every collector (``max_restarts``,
            ``step_timeout``, ``context``...).
        start_timeout_s: how long the actors may take to start. A collector that no alive node
            can host (or whose nodes are taken by the other collectors, each holding its CPUs
            while it runs) is a `CollectorError` at once, naming the resources it needs.

    Example:
        >>> import gymnasium as gym  # doctest: +SKIP
        >>> collectors = RayCollectors([lambda: gym.make("CartPole-v1")] * 4, num_collectors=2)  # doctest: +SKIP
        >>> collectors.num_envs, collectors.slices  # doctest: +SKIP
        (4, [(0, 2), (2, 4)])
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any]],
        *,
        num_collectors: int = 2,
        address: str | None = None,
        actor_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        batch_size: int | None = None,
        autoreset_mode: AutoresetMode | str = AutoresetMode.SAME_STEP,
        env_options: Mapping[str, Any] | None = None,
        start_timeout_s: float = 180.0,
    ) -> None:
        import ray

        env_fns = list(env_fns)
        if isinstance(num_collectors, bool) or not isinstance(num_collectors, int) or num_collectors < 1:
            raise ValueError(f"RayCollectors: num_collectors must be an int >= 1, got {num_collectors!r}")
        if len(env_fns) < num_collectors:
            raise ValueError(f"RayCollectors: {len(env_fns)} envs cannot be split over {num_collectors} collectors")
        if isinstance(actor_options, Sequence) and len(actor_options) != num_collectors:
            raise ValueError(f"RayCollectors: got {len(actor_options)} actor_options for {num_collectors} collectors")
        if AutoresetMode(autoreset_mode) == AutoresetMode.DISABLED:
            raise ValueError("RayCollectors: the collectors need autoreset_mode NEXT_STEP or SAME_STEP, got DISABLED")
        self.num_envs = len(env_fns)
        bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(self.num_envs), num_collectors)])
        self.slices: list[tuple[int, int]] = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        per_actor = actor_options if isinstance(actor_options, Sequence) else [actor_options or {}] * num_collectors
        self.actor_options = [
            {"num_cpus": 1, "scheduling_strategy": "SPREAD", "max_restarts": -1, **dict(options)}
            for options in per_actor
        ]
        self.start_timeout_s = float(start_timeout_s)
        self._started_ray = connect(address)
        self._closed = False
        self.actors: list[Any] = []
        #: collectors that died for good (close() does not wait for them)
        self.lost: set[int] = set()
        try:
            for index, options in enumerate(self.actor_options):
                self._check_placeable(index)
            remote = ray.remote(CollectorActor)
            for (start, stop), options in zip(self.slices, self.actor_options, strict=True):
                size = stop - start
                local = {
                    "batch_size": max(1, size // 2) if batch_size is None else min(int(batch_size), size),
                    "autoreset_mode": AutoresetMode(autoreset_mode),
                    **dict(env_options or {}),
                }
                # A threaded actor: take() may block while weights and versions keep arriving.
                self.actors.append(remote.options(max_concurrency=4, **options).remote(env_fns[start:stop], local))
            infos = self._await_started()
        except BaseException:
            self.close()
            raise
        self.single_observation_space = infos[0]["observation_space"]
        self.single_action_space = infos[0]["action_space"]
        for index, info in enumerate(infos):
            if (
                info["observation_space"] != self.single_observation_space
                or info["action_space"] != self.single_action_space
            ):
                self.close()
                raise ValueError(
                    f"RayCollectors: collector {index} has spaces {info['observation_space']}, {info['action_space']}; "
                    f"collector 0 has {self.single_observation_space}, {self.single_action_space}"
                )
        self.infos = infos

    def _check_placeable(self, index: int, placed: Sequence[tuple[str, str, Mapping[str, Any]]] = ()) -> None:
        problem = placement_problem(self.actor_options[index], placed)
        if problem is not None:
            raise CollectorError(
                f"collector {index} (envs {self.slices[index]}) cannot start: Unschedulable: {problem}"
            )

    def _await_started(self) -> list[dict[str, Any]]:
        """Every collector's `describe()` once its actor runs; checks every second that the
        ones still waiting can be placed at all."""
        import ray

        pending = {actor.describe.remote(): index for index, actor in enumerate(self.actors)}
        infos: list[dict[str, Any] | None] = [None] * len(self.actors)
        deadline = time.monotonic() + self.start_timeout_s
        while pending:
            timeout = max(0.0, min(1.0, deadline - time.monotonic()))
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
            for ref in done:
                infos[pending.pop(ref)] = ray.get(ref)
            if not pending:
                break
            placed = [
                (f"collector {i}", info["node_id"], self.actor_options[i]) for i, info in enumerate(infos) if info
            ]
            for index in sorted(pending.values()):
                self._check_placeable(index, placed)
            if time.monotonic() >= deadline:
                waiting = sorted(pending.values())
                needs = {i: required_resources(self.actor_options[i], placement=True) for i in waiting}
                raise CollectorError(
                    f"collectors {waiting} did not start within start_timeout_s={self.start_timeout_s} s: they need "
                    f"{needs} on a node, the cluster has {ray.available_resources()} free now"
                )
        return infos

    @property
    def num_collectors(self) -> int:
        return len(self.actors)

    @property
    def closed(self) -> bool:
        return self._closed

    def describe(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Each collector's node id, process id, env worker pids and incarnation (one RPC each)."""
        import ray

        return ray.get([actor.describe.remote() for actor in self.actors], timeout=timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Stop every collector, close its envs and policy, end the actors, and shut Ray down
        if `RayCollectors` started it. Idempotent."""
        import ray

        if self._closed:
            return
        self._closed = True
        if self.actors:
            closing = [actor.close.remote() for i, actor in enumerate(self.actors) if i not in self.lost]
            ray.wait(closing, num_returns=len(closing), timeout=timeout)
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
        if self._started_ray:
            ray.shutdown()

    def __repr__(self) -> str:
        return f"RayCollectors(num_envs={self.num_envs}, slices={self.slices}, closed={self._closed})"


class DistributedCollector(BackgroundCollector):
    """Drives `RayCollectors` with a policy and commits their transitions to ``sink`` here.

    The counterpart of `Collector` across a cluster, with the same control and metrics API
    (``start``/``stop``/``check``/``metrics``/``recent_returns``/``latencies``).

    Args:
        collectors: the collector actors and their envs.
        policy_fn: builds each collector's policy inside its actor (a local copy of the model,
            or a client of shared inference servers such as a `RoutedPolicy`).
        sink: a `RolloutStore` over all envs, a `ReplayBuffer`, or a callable taking
            `Transitions` (with global env ids and episode ids unique across collectors).
            A `RolloutStore` receives each env's transition once the next one of that env
            arrived, so that when a collector dies its envs' last transitions are committed
            truncated: no segment ever joins two episodes.
        version_manager: the learner's manager. Its version reaches every collector, which
            submits only while its policy is within ``max_lag`` of it. Register this object
            with it (``version_manager.register(collector)``) to publish weights to the
            collectors' policies.
        seed: seeds env ``j`` with ``seed + j`` (a rebuilt collector adds ``num_envs`` per restart).
        pace: called with the number of transitions committed so far after each commit; it may
            block (e.g. to keep an update-to-data ratio), which in turn stops the collectors.
        max_buffered_steps: transitions each collector may hold before its envs wait for the
            learner (default: 4 per env for a `RolloutStore`, to keep the samples fresh; 64 per
            env otherwise).
        restart_timeout_s: how long a collector whose node died may take to come back.

    Example:
        >>> from asyncvec.distributed import RayCollectors, DistributedCollector  # doctest: +SKIP
        >>> collector = DistributedCollector(collectors, policy_fn, store, version_manager=versions)  # doctest: +SKIP
        >>> versions.register(collector)  # doctest: +SKIP
        >>> with collector:  # doctest: +SKIP
        ...     segment = store.get()
    """

    thread_name = "asyncvec-distributed-collector"
    failure_message = "distributed collection stopped"

    def __init__(
        self,
        collectors: RayCollectors,
        policy_fn: Callable[[], Policy],
        sink: Sink,
        *,
        version_manager: VersionManager | None = None,
        seed: int | None = None,
        pace: Callable[[int], None] | None = None,
        max_buffered_steps: int | None = None,
        restart_timeout_s: float = 60.0,
        episode_window: int = 100,
    ) -> None:
        if not isinstance(collectors, RayCollectors):
            raise TypeError(f"DistributedCollector needs RayCollectors, got {type(collectors).__name__}")
        if collectors.closed:
            raise ValueError("DistributedCollector: the RayCollectors are closed")
        if not callable(policy_fn):
            raise TypeError(f"policy_fn must be a function building a policy, got {type(policy_fn).__name__}")
        check_sink(sink, collectors.num_envs, "the collectors have")
        if max_buffered_steps is not None and max_buffered_steps < 1:
            raise ValueError(f"max_buffered_steps must be >= 1, got {max_buffered_steps}")
        super().__init__()
        self.collectors = collectors
        self.policy_fn = policy_fn
        self.sink = sink
        self.version_manager = version_manager
        self.seed = seed
        self.pace = pace
        self.max_buffered_steps = max_buffered_steps
        self.restart_timeout_s = float(restart_timeout_s)
        n = collectors.num_collectors
        self._incarnation: list[str | None] = [None] * n
        self._episode_base = list(range(n))  # incarnation number, for globally unique episode ids
        self._next_episode_base = n
        self._restarts = [0] * n
        self._steps = [0] * n
        # RolloutStore: each env's received transitions, in order, as (batch, row); the first is
        # held back until the env's next one shows that it was not the last before a fault
        self._queues: list[deque[Any]] = [deque() for _ in range(collectors.num_envs)]
        self._latest: tuple[Any, int] | None = None  # (weights ObjectRef, version)
        self._learner_sent = -1
        self._returns: deque[float] = deque(maxlen=episode_window)
        self._episodes = 0
        self._committed = 0
        self._lock = threading.Lock()
        self._started_at = 0.0
        self._policy_ref: Any = None
        # names this collector's run to the actors: a late stop, pull or sync of an earlier
        # DistributedCollector on the same RayCollectors must not reach this one's run
        self._run = uuid.uuid4().hex

    # ------------------------------------------------------------------ control
    def start(self) -> DistributedCollector:
        """Start every collector (with the latest weights) and the thread that pulls from them."""
        import ray

        self._refuse_second_start()
        self._policy_ref = ray.put(self.policy_fn)
        self._started_at = time.monotonic()
        for index in range(self.collectors.num_collectors):
            self._start_actor(index)
        self._start_thread()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop pulling and stop the collectors' loops (the actors stay until `RayCollectors.close`)."""
        import ray

        super().stop(timeout)
        actors = [a for i, a in enumerate(self.collectors.actors) if i not in self.collectors.lost]
        stopping = [actor.stop.remote(self._run) for actor in actors]
        timeout = self.stop_timeout_s if timeout is None else timeout
        _, waiting = ray.wait(stopping, num_returns=len(stopping), timeout=timeout)
        if waiting:
            logger.warning("%d of %d collectors did not stop within %s s", len(waiting), len(stopping), timeout)

    def __enter__(self) -> DistributedCollector:
        return self.start()

    def load_weights(self, weights: Any, version: int) -> None:
        """Publish ``weights`` as ``version`` to every collector's policy (as a `VersionManager`
        backend). One copy goes to the object store; the actors load it without the learner
        waiting. A collector that is down gets the latest weights when it comes back."""
        import ray

        ref = ray.put(weights)
        with self._lock:
            self._latest = (ref, int(version))
            self._learner_sent = max(self._learner_sent, int(version))
        for actor in self.collectors.actors:
            actor.sync.remote(ref, int(version), int(version), self._run)

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float]:
        """env_steps (committed), env_steps_per_s, episodes, episodic_return/length (recent window),
        policy latency p50/p99 (ms, over every collector's recent answers), fallback_rate,
        gate_waits, restarts, and ``policy/*`` (the collectors' policy stats: batch size and
        version averaged, queue depth summed) and ``collector<i>/env_steps``."""
        import ray

        replies = []
        for actor in self.collectors.actors:
            replies.append(actor.metrics.remote())
        rows = []
        for ref in replies:
            try:
                rows.append(ray.get(ref, timeout=10))
            except (ray.exceptions.RayError, TimeoutError):
                rows.append({})
        latencies = np.concatenate([row.get("latencies", np.zeros(0)) for row in rows] + [np.zeros(0)])
        with self._lock:
            committed, returns, episodes = self._committed, list(self._returns), self._episodes
            steps, restarts = list(self._steps), sum(self._restarts)
        elapsed = max(time.monotonic() - self._started_at, 1e-9) if self._started_at else float("nan")
        remote_steps = sum(row.get("env_steps", 0) for row in rows)
        out: dict[str, float] = {
            "env_steps": committed,
            "env_steps_per_s": committed / elapsed,
            "episodes": episodes,
            "episodic_return": float(np.mean(returns)) if returns else float("nan"),
            "fallback_rate": sum(row.get("fallbacks", 0) for row in rows) / max(remote_steps, 1),
            "gate_waits": sum(row.get("gate_waits", 0) for row in rows),
            "restarts": restarts,
            "policy_latency_p50_ms": float(np.percentile(latencies, 50) * 1000) if latencies.size else float("nan"),
            "policy_latency_p99_ms": float(np.percentile(latencies, 99) * 1000) if latencies.size else float("nan"),
        }
        for key in ("policy/mean_batch_size", "policy/policy_version"):
            values = [row[key] for row in rows if key in row]
            if values:
                out[key] = float(np.mean(values))
        out["policy/queue_depth"] = float(sum(row.get("policy/queue_depth", 0.0) for row in rows))
        for index, count in enumerate(steps):
            out[f"collector{index}/env_steps"] = count
        return out

    def recent_returns(self) -> list[float]:
        """Returns of the recent finished episodes, in the order they reached the learner."""
        with self._lock:
            return list(self._returns)

    def latencies(self) -> np.ndarray:
        """Recent policy latencies in seconds, over every collector."""
        import ray

        rows = ray.get([actor.metrics.remote() for actor in self.collectors.actors], timeout=30)
        return np.concatenate([row["latencies"] for row in rows] + [np.zeros(0)])

    # ------------------------------------------------------------------ the pull loop
    def _config(self, index: int) -> dict[str, Any]:
        start, stop = self.collectors.slices[index]
        seed = None if self.seed is None else self.seed + start + self._restarts[index] * self.collectors.num_envs
        vm = self.version_manager
        return {
            "seed": seed,
            "max_lag": None if vm is None else vm.max_lag,
            "max_buffered_steps": self.max_buffered_steps
            or (4 if isinstance(self.sink, RolloutStore) else 64) * (stop - start),
        }

    def _start_actor(self, index: int) -> None:
        import ray

        with self._lock:
            weights, version = self._latest if self._latest is not None else (None, 0)
        learner = self.version_manager.current_version if self.version_manager is not None else version
        actor = self.collectors.actors[index]
        self._incarnation[index] = ray.get(
            actor.start.remote(self._policy_ref, self._config(index), weights, version, learner, self._run),
            timeout=self.collectors.start_timeout_s,
        )
        with self._lock:
            latest = self._latest
        if latest is not None and latest[1] > version:  # published while the actor started
            actor.sync.remote(latest[0], latest[1], latest[1], self._run)

    def _loop(self) -> None:
        import ray

        pulls: dict[Any, int] = {}
        while not self._stopping.is_set():
            self._send_learner_version()
            self._stage_rollout()
            busy = set(pulls.values())
            for index, actor in enumerate(self.collectors.actors):
                if index not in busy and not self._all_envs_full(index):
                    pulls[actor.take.remote(0.2, self._run)] = index
            if not pulls:
                self._stopping.wait(0.01)
                continue
            ready, _ = ray.wait(list(pulls), num_returns=1, timeout=0.1)
            for ref in ready:
                index = pulls.pop(ref)
                try:
                    reply = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._recover(index, exc)
                    continue
                if not reply["started"] or reply["incarnation"] != self._incarnation[index]:
                    self._recover(index, None)  # rebuilt since the last pull
                    continue
                if reply["run"] != self._run:
                    raise CollectorError(
                        f"collector {index} was started by another DistributedCollector: one RayCollectors "
                        "serves one DistributedCollector at a time (stop the first before starting the next)"
                    )
                self._commit(index, reply)

    def _on_failure(self) -> None:
        if isinstance(self.sink, RolloutStore):
            self.sink.close()  # wake a learner blocked in get()

    def _send_learner_version(self) -> None:
        if self.version_manager is None:
            return
        version = self.version_manager.current_version
        with self._lock:
            if version <= self._learner_sent:
                return
            self._learner_sent = version
            latest = self._latest
        weights, weights_version = latest if latest is not None else (None, 0)
        for actor in self.collectors.actors:
            actor.sync.remote(None if weights is None else weights, weights_version, version, self._run)

    def _commit(self, index: int, reply: dict[str, Any]) -> None:
        with self._lock:
            self._returns.extend(reply["returns"])
            self._episodes += len(reply["returns"])
        offset = self.collectors.slices[index][0]
        base = self._episode_base[index] * EPISODE_STRIDE
        for batch in reply["chunk"]:
            batch.env_id = batch.env_id + offset
            batch.episode_id = batch.episode_id + base
            if isinstance(self.sink, RolloutStore):
                batch.truncated = batch.truncated.copy()  # writable: a fault may end its episodes
                for row, env in enumerate(batch.env_id.tolist()):
                    self._queues[env].append((batch, row))
            elif isinstance(self.sink, ReplayBuffer):
                self.sink.add_transitions(batch)
                self._count(index, len(batch.env_id))
            else:
                self.sink(batch)
                self._count(index, len(batch.env_id))
        self._stage_rollout()

    def _all_envs_full(self, index: int) -> bool:
        """RolloutStore: whether no env of collector ``index`` can take a transition now (then it
        is not pulled, and its envs stop once its outbox is full)."""
        if not isinstance(self.sink, RolloutStore):
            return False
        start, stop = self.collectors.slices[index]
        steps, limit = self.sink.steps_per_env, self.sink.num_steps + self.sink.max_steps_ahead
        return all(steps[env] >= limit and len(self._queues[env]) > 1 for env in range(start, stop))

    def _stage_rollout(self) -> None:
        """RolloutStore: commit each env's transitions in order while the store has room for
        them, always keeping the env's latest one back (see ``sink``). Each round adds at most
        one transition per env, so every env's order survives the grouping by batch."""
        if not isinstance(self.sink, RolloutStore):
            return
        limit = self.sink.num_steps + self.sink.max_steps_ahead
        while True:
            steps = self.sink.steps_per_env
            ready = []
            for env, queue in enumerate(self._queues):
                while queue and queue[0] is _TRUNCATE:  # nothing of the lost incarnation was held
                    queue.popleft()
                if len(queue) > 1 and steps[env] < limit:
                    batch, row = queue.popleft()
                    if queue[0] is _TRUNCATE:  # its collector died after this transition
                        batch.truncated[row] = not batch.terminated[row]
                        queue.popleft()
                    ready.append((batch, row))
            if not ready:
                return
            self._add_rows(ready)
            for index, (start, stop) in enumerate(self.collectors.slices):
                count = sum(start <= int(batch.env_id[row]) < stop for batch, row in ready)
                if count:
                    self._count(index, count)

    def _add_rows(self, rows: list[tuple[Transitions, int]]) -> None:
        """Add held transitions to the RolloutStore, one ``add`` per batch they came from."""
        groups: dict[int, tuple[Transitions, list[int]]] = {}
        for batch, row in rows:
            groups.setdefault(id(batch), (batch, []))[1].append(row)
        for batch, picked in groups.values():
            self.sink.add_transitions(batch.take(np.asarray(picked)))

    def _count(self, index: int, steps: int) -> None:
        with self._lock:
            self._steps[index] += steps
            self._committed += steps
            committed = self._committed
        if self.pace is not None:
            self.pace(committed)

    def _recover(self, index: int, error: BaseException | None) -> None:
        """A collector died or was rebuilt: wait until Ray has it running again (or say why it
        cannot), then start it with the latest weights."""
        try:
            self._await_restart(index, error)
        except CollectorError:
            self.collectors.lost.add(index)
            raise

    def _await_restart(self, index: int, error: BaseException | None) -> None:
        import ray

        actor = self.collectors.actors[index]
        options = self.collectors.actor_options[index]
        logger.warning("collector %d is down (%r); waiting for Ray to rebuild it", index, error)
        deadline = time.monotonic() + self.restart_timeout_s
        while True:
            if self._stopping.is_set():
                return
            if not feasible_nodes(options):
                alive = [(n["NodeID"][:8], n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
                raise CollectorError(
                    f"collector {index} (envs {self.collectors.slices[index]}) lost its node and no alive node can "
                    f"host it: it needs {required_resources(options)}; alive nodes offer {alive}"
                )
            try:
                info = ray.get(actor.describe.remote(), timeout=2.0)
                break
            except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
                pass
            except ray.exceptions.RayActorError as exc:
                limit = options.get("max_restarts", 0)
                if limit != -1 and self._restarts[index] >= limit:
                    raise CollectorError(f"collector {index} died and max_restarts={limit} is used up: {exc}") from exc
                time.sleep(0.2)
            if time.monotonic() > deadline:
                raise CollectorError(
                    f"collector {index} (envs {self.collectors.slices[index]}) did not come back within "
                    f"{self.restart_timeout_s} s after {error!r}; the cluster may lack free "
                    f"{required_resources(options)}"
                )
        if info["incarnation"] == self._incarnation[index]:
            return  # it was unreachable for a moment, not rebuilt
        with self._lock:
            self._restarts[index] += 1
            self._episode_base[index] = self._next_episode_base
            self._next_episode_base += 1
        if isinstance(self.sink, RolloutStore):
            start, stop = self.collectors.slices[index]
            for env in range(start, stop):
                self._queues[env].append(_TRUNCATE)
        self._start_actor(index)
        logger.warning("collector %d is back on node %s", index, info["node_id"])


_TRUNCATE = object()  # marks, in an env's queue, where the incarnation of its collector ended
