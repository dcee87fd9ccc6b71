"""The actor side of distributed collection: what runs inside each Ray collector actor.

Each `CollectorActor` hosts a slice of the envs in worker processes (an `AsyncLLMVectorEnv`),
its own policy and a local `Collector` whose sink is a bounded outbox; the learner's
`DistributedCollector` (:mod:`asyncvec.distributed.collection`) pulls the outbox through Ray.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from asyncvec.buffers import Transitions
from asyncvec.collection.collector import Collector
from asyncvec.inference.types import Policy
from asyncvec.metrics import EpisodeStats
from asyncvec.versioning import VersionManager

__all__ = ["CollectorActor"]


class CollectorActor:
    """Runs in a Ray actor: envs in worker processes, a policy, a `Collector`, a bounded outbox.

    `RayCollectors` makes one actor of it per slice of the envs; `DistributedCollector` starts,
    feeds (weights, learner version) and drains them (``take``).

    Each ``start`` names its run (a token of the `DistributedCollector` that started it) and
    ``take``, ``sync`` and ``stop`` carry it: the actor runs its calls in a thread pool, so a
    stop, pull or weight update of an earlier run can arrive after the next run started, and
    it must not stop, drain or re-version that run. Start and stop never interleave.
    """

    def __init__(self, env_fns: Sequence[Callable[[], Any]], env_options: Mapping[str, Any]) -> None:
        import ray

        from asyncvec.vector.async_llm_vector_env import AsyncLLMVectorEnv

        self.env = AsyncLLMVectorEnv(env_fns, **env_options)
        self.incarnation = uuid.uuid4().hex
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.pid = os.getpid()
        self.collector: Collector | None = None
        self.policy: Policy | None = None
        self.versions: VersionManager | None = None
        self._outbox: list[Transitions] = []
        self._outbox_steps = 0
        self._max_outbox_steps = 0
        self._cond = threading.Condition()
        self._weights_lock = threading.Lock()
        self._stopping = False
        self._run: str | None = None
        self._control = threading.RLock()  # start and stop, one at a time
        self._episodes = EpisodeStats(self.env.num_envs, window=10_000)  # of the transitions in the outbox
        self._episodes_reported = 0

    def describe(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "node_id": self.node_id,
            "pid": self.pid,
            "env_pids": [pid for pid in self.env.worker_pids if pid is not None],
            "num_envs": self.env.num_envs,
            "observation_space": self.env.single_observation_space,
            "action_space": self.env.single_action_space,
            "started": self.collector is not None,
        }

    def start(
        self,
        policy_fn: Callable[[], Policy],
        config: dict[str, Any],
        weights: Any,
        version: int,
        learner: int,
        run: str,
    ) -> str:
        """Start collecting as ``run`` with a new policy and sink (ending a previous run, if any)."""
        with self._control:
            self.stop()
            with self._cond, self._weights_lock:
                if self.policy is not None:
                    self.policy.close()
                self._stopping = False
                self._run = run
                self._outbox, self._outbox_steps, self._episodes_reported = [], 0, 0
                self._episodes = EpisodeStats(self.env.num_envs, window=10_000)
                self.policy = policy_fn()
                self.versions = VersionManager(max_lag=config["max_lag"]) if config["max_lag"] is not None else None
            self.sync(weights, version, learner, run)
            self._max_outbox_steps = config["max_buffered_steps"]
            self.collector = Collector(
                self.env, self.policy, self._put, version_manager=self.versions, seed=config["seed"]
            )
            self.collector.start()
            return self.incarnation

    def sync(self, weights: Any, version: int, learner: int, run: str) -> None:
        """Load weights newer than the policy's (calls may arrive out of order) and move the
        local gate's version up to the learner's; a call meant for another run does nothing."""
        with self._weights_lock:
            if self.policy is None or run != self._run:
                return
            if weights is not None and version > self.policy.policy_version:
                self.policy.load_weights(weights, version)
            if self.versions is not None and not self.versions.closed:
                while self.versions.current_version < learner:
                    self.versions.publish(None)  # no backends here: only the counter moves

    def _put(self, batch: Transitions) -> None:
        """The collector's sink: blocks while the outbox is full (back-pressure)."""
        with self._cond:
            while self._outbox_steps >= self._max_outbox_steps and not self._stopping:
                self._cond.wait(0.1)
            self._outbox.append(batch)
            self._outbox_steps += len(batch.env_id)
            self._episodes.update(batch.env_id, batch.reward, batch.terminated | batch.truncated)
            self._cond.notify_all()

    def take(self, timeout: float, run: str) -> dict[str, Any]:
        """The transition batches collected since the last call (waiting up to ``timeout`` for
        one), and the returns of the episodes finished meanwhile. ``run`` says which run asks:
        another run's pull gets nothing (``"run"`` in the reply names the actor's run)."""
        if self.collector is None:
            return {"incarnation": self.incarnation, "started": False}
        with self._cond:
            self._cond.wait_for(lambda: self._outbox or self._stopping, timeout)
            if run != self._run:
                return {"incarnation": self.incarnation, "started": True, "run": self._run, "chunk": [], "returns": []}
            chunk, self._outbox, self._outbox_steps = self._outbox, [], 0
            new, self._episodes_reported = self._episodes.episodes - self._episodes_reported, self._episodes.episodes
            returns = self._episodes.returns(new) if new else []
            self._cond.notify_all()
        if not self._stopping:
            self.collector.check()  # an env or policy failure ends the run with its error
        return {"incarnation": self.incarnation, "started": True, "run": run, "chunk": chunk, "returns": returns}

    def metrics(self) -> dict[str, Any]:
        out = dict(self.collector.metrics()) if self.collector is not None else {}
        out["latencies"] = self.collector.latencies() if self.collector is not None else np.zeros(0)
        return out

    def stop(self, run: str | None = None) -> None:
        """End the current run's collector (only if it is ``run``, when given)."""
        with self._control:
            if run is not None and run != self._run:
                return
            with self._cond:
                self._stopping = True  # frees a collector blocked on a full outbox
                self._cond.notify_all()
            if self.collector is not None:
                self.collector.stop()
            if self.versions is not None:
                self.versions.close()

    def close(self) -> None:
        self.stop()
        if self.policy is not None:
            self.policy.close()
        self.env.close()
