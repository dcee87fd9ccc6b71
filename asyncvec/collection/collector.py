"""``Collector``: drives an ``AsyncLLMVectorEnv`` with a ``Policy`` in a background thread.

Each env's observation is submitted to the policy as soon as that env is ready (continuous
admission), each answer goes back to its env with ``send`` as soon as it arrives, and every
transition is written with the policy version that chose its action, the behavior log-prob
and the fallback flag. The learner trains meanwhile.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import concatenate, create_empty_array

from asyncvec.buffers import ReplayBuffer, RolloutStore, Transitions, policy_columns
from asyncvec.buffers.rollout import Segment
from asyncvec.collection.base import BackgroundCollector
from asyncvec.inference.requests import zero_action
from asyncvec.inference.types import Policy, PolicyOutput
from asyncvec.metrics import EpisodeStats
from asyncvec.vector.async_llm_vector_env import AsyncLLMVectorEnv
from asyncvec.versioning import PinnedWeights, VersionManager

__all__ = ["Collector", "Sink", "next_segment", "publish_pace"]


Sink = RolloutStore | ReplayBuffer | Callable[[Transitions], None]


def check_sink(sink: Any, num_envs: int, source: str) -> None:
    """Refuses a sink a collector cannot write to; ``source`` says what has ``num_envs`` envs ("the env has").

    Example:
        >>> check_sink(object(), 4, "the env has")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: sink must be a RolloutStore, a ReplayBuffer or a callable, got object
    """
    if isinstance(sink, RolloutStore) and sink.num_envs != num_envs:
        raise ValueError(f"RolloutStore has num_envs={sink.num_envs}, {source} {num_envs}")
    if not isinstance(sink, (RolloutStore, ReplayBuffer)) and not callable(sink):
        raise TypeError(f"sink must be a RolloutStore, a ReplayBuffer or a callable, got {type(sink).__name__}")


def publish_pace(
    versions: VersionManager, steps_per_version: int, lag: int = 0, pinned: PinnedWeights | None = None
) -> Callable[[int], None]:
    """A ``pace`` for a lockstep :class:`Collector` whose learner publishes once per ``steps_per_version`` env steps
    (PPO: once per segment): block ``k`` of steps waits for the ``k - lag``-th publish after this call (until
    ``versions`` closes). ``lag=0``: the next block is acted on by the new version only (the sync loop). With
    ``pinned`` (the policy's only weight receiver), the block is acted on by exactly that version: the learner
    trains block ``k - 1`` while block ``k`` is acted, every sample ``lag`` versions old, whatever the speeds.

    Example:
        >>> versions = VersionManager(max_lag=0)
        >>> pace = publish_pace(versions, steps_per_version=4)
        >>> pace(3)  # within the first block: no wait
        >>> _ = versions.publish({}); pace(4)  # the block is full: the learner has published version 1
        >>> versions.current_version
        1
    """
    first = versions.current_version
    if pinned is not None:
        pinned.deliver(first)

    def pace(written: int) -> None:
        version = max(first, first + written // steps_per_version - lag)
        if versions.wait_for_version(version) and pinned is not None:
            pinned.deliver(version)

    return pace


def next_segment(store: RolloutStore, collector: BackgroundCollector) -> Segment:
    """``store``'s next segment, waited for as long as it takes while ``collector`` fills it; a failure of the
    collector meanwhile is raised (:meth:`BackgroundCollector.check`), so a learner never waits on a dead one."""
    while True:
        try:
            return store.get(timeout=1.0)
        except TimeoutError:
            collector.check()
        except RuntimeError:  # the store was closed: by the collector's failure, if it failed
            collector.check()
            raise


def _write(sink: Sink, t: Transitions) -> None:
    if callable(sink):
        sink(t)
    else:  # both buffers take the record as it is
        sink.add_transitions(t)


def _row(batch: Any, k: int) -> Any:
    """Row ``k`` of a batched observation (arrays, dicts/tuples of arrays, or a tuple of str)."""
    if isinstance(batch, dict):
        return {key: _row(value, k) for key, value in batch.items()}
    if isinstance(batch, tuple) and not isinstance(batch[0], np.ndarray):
        return batch[k]
    if isinstance(batch, tuple):
        return tuple(_row(value, k) for value in batch)
    return batch[k]


class Collector(BackgroundCollector):
    """Steps ``env`` with ``policy`` and writes transitions to ``sink``, in a background thread.

    Args:
        env: an :class:`AsyncLLMVectorEnv` in NEXT_STEP or SAME_STEP autoreset mode; any
            ``batch_size`` works (small ones return ready envs sooner).
        policy: anything with ``submit(obs, env_id=...) -> Future[PolicyOutput]``.
        sink: a :class:`RolloutStore` (on-policy: the collector waits when an env is as far
            ahead as the store allows), a :class:`ReplayBuffer`, or a callable taking
            :class:`Transitions`.
        version_manager: if given, the max-lag rule below holds (the semi-asynchronous gate).
        seed: seed of the first ``async_reset``.
        pace: called with the number of env steps written so far after each write; it may
            block to hold the collector back (e.g. to keep an update-to-data ratio).
        episode_window: how many recent episodes the return/length statistics cover.
        lockstep: every env steps together, as a sync loop does: the collector waits until
            every env has its next observation, writes that step's transitions in env order as
            one record, calls ``pace`` (which may wait for the learner's publish), then asks the
            policy for all the actions in env order, one batch. With ``max_lag=0`` and a ``pace``
            that waits for the learner, the data is a sync loop's, sample for sample (a check
            of the asynchronous path, not a speed-up: docs/agents.md, "Lag 0 is sync").

    The max-lag rule (with a ``version_manager`` whose ``max_lag`` is set): an action is sent to
    its env only if ``current_version - action_version <= max_lag`` at that moment (checked
    immediately before ``send``). An answer that fails the check (computed before the learner
    moved on) is discarded, counted in ``stale_actions_dropped`` and in the manager's dropped
    count, and its observation is submitted again. An observation is submitted only while the
    policy's own version passes the same check; otherwise it waits, counted in ``gate_waits``,
    without blocking the loop: the steps the envs already finished are still written to the
    sink at once (every one of them was sent under the rule), and the envs whose action was
    sent keep stepping. So a written transition's version was within ``max_lag`` of the
    learner's when its action was sent; its staleness when the learner reads it also counts
    the versions published while the env stepped.

    Example:
        >>> import gymnasium as gym, torch
        >>> from asyncvec import AsyncLLMVectorEnv, Collector, RolloutStore
        >>> from asyncvec.inference import TorchPolicy
        >>> envs = AsyncLLMVectorEnv([lambda: gym.make("CartPole-v1")] * 2, batch_size=1)
        >>> policy = TorchPolicy(torch.nn.Linear(4, 2), envs.single_action_space)
        >>> store = RolloutStore(8, 2, envs.single_observation_space, envs.single_action_space)
        >>> with Collector(envs, policy, store, seed=0) as collector:
        ...     segment = store.get(timeout=30)
        >>> segment.reward.shape
        (8, 2)
        >>> policy.close(); envs.close()
    """

    def __init__(
        self,
        env: AsyncLLMVectorEnv,
        policy: Policy,
        sink: Sink,
        *,
        version_manager: VersionManager | None = None,
        seed: int | None = None,
        pace: Callable[[int], None] | None = None,
        episode_window: int = 100,
        lockstep: bool = False,
    ) -> None:
        if not isinstance(env, AsyncLLMVectorEnv):
            raise TypeError(f"Collector needs an AsyncLLMVectorEnv (send/recv), got {type(env).__name__}")
        if env.autoreset_mode == AutoresetMode.DISABLED:
            raise ValueError("Collector needs autoreset_mode NEXT_STEP or SAME_STEP, got DISABLED")
        if not callable(getattr(policy, "submit", None)):
            raise TypeError(f"policy must have submit(obs, env_id=...), got {type(policy).__name__}")
        check_sink(sink, env.num_envs, "the env has")
        super().__init__()
        self.env = env
        self.policy = policy
        self.sink = sink
        self.version_manager = version_manager
        self.seed = seed
        self.pace = pace
        self.lockstep = lockstep
        n = env.num_envs
        self._space = env.single_observation_space
        self._action_space = env.single_action_space
        self._noop = zero_action(self._action_space)
        self._answers: queue.SimpleQueue[tuple[int, Future]] = queue.SimpleQueue()
        self._wakeable = bool(getattr(env, "wakeable", False))
        self._obs: list[Any] = [None] * n  # the observation each env's next action is chosen from
        self._waiting_policy = np.zeros(n, dtype=bool)
        self._resetting = np.zeros(n, dtype=bool)  # NEXT_STEP: the env's next step is its reset
        self._parked: dict[int, PolicyOutput] = {}  # answers held back by the sink's capacity
        self._gated: dict[int, Any] = {}  # observations held back by the max-lag gate, in arrival order
        self._sent: dict[int, PolicyOutput] = {}  # the answer each stepping env is executing
        self._step_rows: list[tuple[Any, ...]] = []  # lockstep: the step's rows, written once every env is in
        self._episodes = EpisodeStats(n, episode_window)
        self._episode_id = np.arange(n, dtype=np.int64)
        self._next_episode_id = n
        self._lock = threading.Lock()
        self._latencies: deque[float] = deque(maxlen=10_000)
        self._counts = {"fallbacks": 0, "gate_waits": 0, "stale_actions_dropped": 0}
        self._started_at = 0.0

    # ------------------------------------------------------------------ control

    def start(self) -> Collector:
        """Starts the background thread (resets the envs first). :meth:`stop` ends it and drains
        the env (answers still in flight are received and dropped)."""
        self._refuse_second_start()
        self._started_at = time.monotonic()
        self._start_thread()
        return self

    def __enter__(self) -> Collector:
        return self.start()

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> dict[str, float]:
        """Counters and rates: env_steps, env_steps_per_s, episodes, episodic return/length over
        the recent window, policy latency p50/p99 (ms), fallback rate, gate_waits and
        stale_actions_dropped (the max-lag rule), and the policy's own stats (batch size, queue
        depth) prefixed with ``policy/``."""
        with self._lock:
            counts = {**self._counts, "env_steps": self._episodes.steps, "episodes": self._episodes.episodes}
            returns = np.array(self._episodes.returns())
            lengths = np.array(self._episodes.lengths())
            latencies = np.array(self._latencies)
        elapsed = max(time.monotonic() - self._started_at, 1e-9) if self._started_at else float("nan")
        out: dict[str, float] = {
            **counts,
            "env_steps_per_s": counts["env_steps"] / elapsed,
            "episodic_return": float(returns.mean()) if returns.size else float("nan"),
            "episodic_length": float(lengths.mean()) if lengths.size else float("nan"),
            "fallback_rate": counts["fallbacks"] / max(counts["env_steps"], 1),
            "policy_latency_p50_ms": float(np.percentile(latencies, 50) * 1000) if latencies.size else float("nan"),
            "policy_latency_p99_ms": float(np.percentile(latencies, 99) * 1000) if latencies.size else float("nan"),
        }
        stats = getattr(self.policy, "stats", None)
        if callable(stats):
            out.update({f"policy/{k}": float(v) for k, v in stats().items() if isinstance(v, (int, float))})
        return out

    def recent_returns(self) -> list[float]:
        """Returns of the episodes in the recent window, oldest first."""
        with self._lock:
            return self._episodes.returns()

    def latencies(self) -> np.ndarray:
        """Recent policy latencies in seconds (for histograms)."""
        with self._lock:
            return np.array(self._latencies)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        self.env.async_reset(seed=self.seed)
        while not self._stopping.is_set():
            self._submit_gated()
            # With nothing stepping, wait for answers (0.05 s at most), or for the gate when
            # only gated observations are left.
            wait_for_gate = bool(self._gated) and not self.env.in_flight and not self._waiting_policy.any()
            self._send_ready_actions(block=not self.env.in_flight and not wait_for_gate)
            if self.env.in_flight:
                try:
                    # Short waits while answers may come back; the policy side needs us too.
                    # A vector env that wake() reaches is woken by each policy answer; others are polled.
                    busy = self._waiting_policy.any() or self._parked or (self._gated and not self.lockstep)
                    # at_least=1: the policy batches the requests; an env that finished is not held
                    # back until batch_size - 1 others finish too
                    result = self.env.recv(timeout=0.002 if busy and not self._wakeable else 0.1, at_least=1)
                except multiprocessing.TimeoutError:
                    continue
                self._handle_results(*result)
            elif wait_for_gate:
                vm = self.version_manager
                if vm is None or vm.closed:  # no publish will come: only the policy's own version can move
                    self._stopping.wait(0.1)
                else:
                    vm.wait_for_lag(lambda: self.policy.policy_version, timeout=0.1)

    def _on_failure(self) -> None:
        if isinstance(self.sink, RolloutStore):
            self.sink.close()  # wake a learner blocked in get()

    def _loop_ended(self) -> None:
        """Drains the env: answers still in flight are received and dropped (within 30 s), so that the next
        collector on the same env starts from idle envs. A late policy answer's wake() ends a wait early: the
        drain goes on (it stopped there, and the next collector's async_reset met envs still in flight)."""
        deadline = time.monotonic() + 30.0
        while not self.env.closed and self.env.in_flight and time.monotonic() < deadline:
            try:
                self.env.recv(timeout=max(0.0, deadline - time.monotonic()))
            except multiprocessing.TimeoutError:
                continue
            except Exception:
                return

    def _room(self, env_id: int) -> bool:
        if not isinstance(self.sink, RolloutStore):
            return True
        return self.sink.steps_per_env[env_id] < self.sink.num_steps + self.sink.max_steps_ahead

    def _send_ready_actions(self, block: bool) -> None:
        ready: list[tuple[int, PolicyOutput]] = []
        for env_id in list(self._parked):
            if self._room(env_id):
                ready.append((env_id, self._parked.pop(env_id)))
        try:
            timeout = 0.05 if block and not ready else None
            while True:
                env_id, future = self._answers.get(timeout=timeout) if timeout else self._answers.get_nowait()
                timeout = None
                output = future.result()  # a policy error stops the collector with that error
                self._waiting_policy[env_id] = False
                with self._lock:
                    self._latencies.append(output.latency_s)
                if self._room(env_id):
                    ready.append((env_id, output))
                else:
                    self._parked[env_id] = output
        except queue.Empty:
            pass
        ready = [(env_id, output) for env_id, output in ready if self._within_lag(env_id, output)]
        if not ready:
            return
        ids = np.array([env_id for env_id, _ in ready], dtype=np.int64)
        actions = [self._executable(output.action) for _, output in ready]
        for env_id, output in ready:
            self._sent[env_id] = output
        self.env.send(self._batch_actions(actions), ids)

    def _executable(self, action: Any) -> Any:
        if isinstance(self._action_space, spaces.Box):
            return np.clip(
                np.asarray(action, dtype=self._action_space.dtype), self._action_space.low, self._action_space.high
            )
        return action

    def _batch_actions(self, actions: list[Any]) -> Any:
        return concatenate(self._action_space, actions, create_empty_array(self._action_space, len(actions)))

    def _within_lag(self, env_id: int, output: PolicyOutput) -> bool:
        """The send-time check of the max-lag rule; a stale answer is dropped and its observation
        submitted again (see the class docstring)."""
        vm = self.version_manager
        if vm is None or vm.within_lag(output.policy_version):
            return True
        vm.record_dropped(1)
        with self._lock:
            self._counts["stale_actions_dropped"] += 1
        self._submit(env_id, self._obs[env_id])
        return False

    def _gate_open(self) -> bool:
        vm = self.version_manager
        return vm is None or vm.within_lag(self.policy.policy_version)

    def _submit_gated(self) -> None:
        """Submits the observations the gate held back, once the policy is within the lag (lockstep: once
        every env is in, after writing the step's transitions, in env order)."""
        if self.lockstep:
            if len(self._gated) < self.env.num_envs:
                return
            self._write_step()  # pace runs here, and may wait for the learner's publish
            if self._stopping.is_set():  # the learner's last update: no step past it (stop_soon)
                return
        if self._gated and self._gate_open():
            gated, self._gated = self._gated, {}
            for env_id in sorted(gated) if self.lockstep else gated:
                self._ask_policy(env_id, gated[env_id])

    def _submit(self, env_id: int, obs: Any) -> None:
        """Asks the policy for env ``env_id``'s next action, or holds ``obs`` while the gate is closed
        (lockstep: until every env has its observation)."""
        if self.lockstep or not self._gate_open():
            if not self.lockstep:
                with self._lock:
                    self._counts["gate_waits"] += 1
            self._gated[env_id] = obs
            return
        self._ask_policy(env_id, obs)

    def _ask_policy(self, env_id: int, obs: Any) -> None:
        self._obs[env_id] = obs
        self._waiting_policy[env_id] = True
        future = self.policy.submit(obs, env_id=env_id)
        future.add_done_callback(lambda f, e=env_id: self._answered(e, f))

    def _answered(self, env_id: int, future: Future) -> None:
        """The policy's callback: queue the answer and end the loop's wait for envs, so that the
        action goes out at once (not after the next env result or poll)."""
        self._answers.put((env_id, future))
        if self._wakeable:
            self.env.wake()

    def _handle_results(
        self, obs: Any, rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray, info: dict
    ) -> None:
        env_ids = info["env_id"]
        same_step = self.env.autoreset_mode == AutoresetMode.SAME_STEP
        rows, next_obs, reset_sends = [], [], []
        for k, env_id in enumerate(env_ids.tolist()):
            observation = _row(obs, k)
            if self._resetting[env_id]:
                self._resetting[env_id] = False
                self._submit(env_id, observation)
                continue
            output = self._sent.pop(env_id, None)
            if output is None:  # the first observation after async_reset
                self._submit(env_id, observation)
                continue
            done = bool(terminated[k] or truncated[k])
            final = info["final_obs"][k] if same_step and done else observation
            rows.append((k, env_id, output, self._obs[env_id]))
            next_obs.append(final)
            if done and not same_step:
                self._resetting[env_id] = True
                reset_sends.append(env_id)
            else:
                self._submit(env_id, observation)
        if rows and self.lockstep:
            self._step_rows += [
                (env_id, output, row_obs, final, rewards[k], terminated[k], truncated[k])
                for (k, env_id, output, row_obs), final in zip(rows, next_obs)
            ]
        elif rows:
            self._write_rows(rows, next_obs, rewards, terminated, truncated)
        if reset_sends:
            self.env.send(self._batch_actions([self._noop] * len(reset_sends)), np.array(reset_sends))

    def _write_step(self) -> None:
        """Lockstep: writes the step's transitions in env order, as one record (the order a sync loop adds them)."""
        if not self._step_rows:
            return
        step, self._step_rows = sorted(self._step_rows, key=lambda row: row[0]), []
        columns = list(zip(*step))
        self._write_rows(
            [(k, env_id, output, row_obs) for k, (env_id, output, row_obs, *_) in enumerate(step)],
            list(columns[3]),
            np.array(columns[4]),
            np.array(columns[5]),
            np.array(columns[6]),
        )

    def _write_rows(self, rows: list, next_obs: list, rewards, terminated, truncated) -> None:
        ks = np.array([row[0] for row in rows])
        ids = np.array([row[1] for row in rows], dtype=np.int64)
        outputs = [row[2] for row in rows]
        n = len(rows)
        batch = Transitions(
            env_id=ids,
            obs=concatenate(self._space, [row[3] for row in rows], create_empty_array(self._space, n)),
            action=concatenate(
                self._action_space, [o.action for o in outputs], create_empty_array(self._action_space, n)
            ),
            reward=rewards[ks],
            next_obs=concatenate(self._space, next_obs, create_empty_array(self._space, n)),
            terminated=terminated[ks],
            truncated=truncated[ks],
            **policy_columns(outputs),
            episode_id=self._episode_id[ids].copy(),
        )
        _write(self.sink, batch)
        with self._lock:
            self._episodes.update(ids, batch.reward, batch.terminated | batch.truncated)
            self._counts["fallbacks"] += int(batch.fallback.sum())
            written = self._episodes.steps
        if self.pace is not None:
            self.pace(written)
        for env_id, done in zip(ids, terminated[ks] | truncated[ks]):
            if done:
                self._episode_id[env_id] = self._next_episode_id
                self._next_episode_id += 1
