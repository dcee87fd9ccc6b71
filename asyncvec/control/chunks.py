"""Action chunks at a control rate: play H actions per policy call while the next call runs.

A slow policy (a VLA, 100-400 ms a call) on a fast controller (50 Hz, a 20 ms period) can
act at most once per call; the ticks in between have no fresh action. With chunks, each
call returns the next ``H`` actions and the `ChunkExecutor` plays them one per tick, at the
env's control period, while it already asks for the next chunk.

The rules (docs/robots.md has the picture):

* **Timing.** A chunk's action ``j`` is played ``j`` ticks after the chunk *arrives* (the
  first tick at or after the answer). Each env has its own chunk stream and at most one
  request in flight.
* **When to ask.** The next chunk is requested, with the latest observation, once at most
  ``k`` actions of the newest chunk remain, where ``k = min(H, ceil(p95 latency / period) +
  margin)``: the policy's measured 95th-percentile latency in ticks plus a margin (default 1
  tick), over the last ``latency_window`` answers. Before the first answer ``k = H`` (ask at
  once). ``request_at=k`` fixes it instead.
* **Overlap.** When a new chunk arrives while the older one still has actions, ``"newest"``
  (default) plays the new chunk and drops the rest of the older one (counted in
  ``overlap_dropped``); ``"ensemble"`` averages, for each tick, the actions of every chunk that
  has one for that tick, with ACT's weights ``w_i = exp(-m * i)`` (``i = 0`` the oldest chunk,
  ``m = ensemble_decay``). A blended action is not any chunk's sample: it is marked
  ``"ensemble"``.
* **Fallback.** A tick with no chunk action (the chunk ran out before the next arrived) plays
  the fallback (``"hold"``: the last executed action of the episode, zero at its start;
  ``"zero"``; or ``fallback(obs, env_id) -> action``), marked ``"fallback"`` and counted as a
  missed tick. A policy answer with ``fallback=True`` (its own deadline) is played but marked
  ``"fallback"`` too.
* **Safety.** With ``safety=SafetyFilter(...)`` every action passes the filter before the
  env; a replaced action is marked (``safety_replaced``). Without one, actions are executed
  clipped into the action space, as the `Collector` does (the chunk's unclipped sample, to
  which its log-prob belongs, is kept in ``ChunkRollout.proposed``).
* **Clock.** By default ticks follow the wall clock (``period_s`` apart) and a chunk arrives
  when the policy answers, so how many ticks a call spans, and so which ticks fall back,
  depends on the machine's load. With ``latency_ticks=L`` the clock is simulated: ticks run
  back to back, unpaced, and a chunk requested at tick ``t`` arrives at tick ``t + L`` exactly:
  the executor waits for the tick's answers after its env step (so the policy computes while
  the envs step, and with the weights it held at that tick) and holds each chunk until its
  tick. The chunk schedule (which tick plays which chunk's action, which ticks fall back,
  which actions are dropped) is then a function of the ticks alone: the same at any load,
  replayed exactly from the same seeds (with a seeded policy, e.g. `GaussianChunkPolicy`'s
  ``seed``). ``k`` is ``min(H, L + margin)``. This is for learning and tests in simulation;
  a robot runs on the wall clock.
* **Episodes.** When an episode ends, the env's chunks and its pending request are dropped
  (they belong to the old episode); in NEXT_STEP autoreset mode the env's reset step is
  marked ``"reset"`` and counts neither as met nor as missed.

Every executed action is recorded in a `ChunkRollout` with the policy version, the chunk's
behavior log-prob, the chunk id and index, its source and the safety flag, so a learner can
train on the policy's own choices only (`ChunkRollout.policy_choice`).

**Per-action log-probs.** A policy may report the log-prob of each action of its chunk in
``PolicyOutput.token_logps``: ``H`` entries (one per action, e.g. a factorized Gaussian,
`GaussianChunkPolicy`) or ``H * m`` entries (``m`` action tokens per action, summed per
action). The executed action's own log-prob is then in ``ChunkRollout.action_logp`` (NaN where
the policy reported none), and ``ChunkRollout.chunk_obs`` holds the observation each chunk was
requested with, so a learner can recompute the log-prob of action ``j`` of a chunk
(agents/ppo_chunks.py). ``record_obs=True`` also keeps every tick's observation.

Example:
    >>> import gymnasium as gym, numpy as np, torch
    >>> from asyncvec.inference import LatencyModel, TorchPolicy
    >>> envs = gym.vector.SyncVectorEnv([lambda: gym.make("Pendulum-v1")] * 2)
    >>> class ChunkNet(torch.nn.Module):  # a Gaussian over a chunk of H=8 actions of size 1
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.mean = torch.nn.Linear(3, 8)
    ...     def forward(self, obs):
    ...         return self.mean(obs), torch.full((8,), -1.0)
    >>> chunk_space = gym.spaces.Box(-2, 2, (8, 1))
    >>> policy = LatencyModel(TorchPolicy(ChunkNet(), chunk_space), a_ms=60, b_ms=0)
    >>> executor = ChunkExecutor(envs, policy, period_s=0.02, horizon=8)
    >>> obs = executor.reset(seed=0)
    >>> rollout = executor.run(ticks=30)
    >>> rollout.actions.shape, int(executor.stats()["ticks"])
    ((30, 2, 1), 30)
    >>> policy.close(); envs.close()
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.error import ResetNeeded
from gymnasium.vector import AutoresetMode

from asyncvec.control.safety import SafetyFilter
from asyncvec.inference.requests import split_batch, zero_action
from asyncvec.inference.types import Policy, PolicyOutput

__all__ = [
    "SOURCES",
    "action_logps_from_tokens",
    "Chunk",
    "ChunkExecutor",
    "ChunkExecutorError",
    "ChunkRollout",
    "ChunkStream",
    "request_threshold",
    "ticks_met_bound",
]

logger = logging.getLogger(__name__)


class ChunkExecutorError(RuntimeError):
    """The policy behind a :class:`ChunkExecutor` failed on a request or did not answer it."""


#: where an executed action came from (``ChunkRollout.source`` holds the index)
SOURCES = ("policy", "ensemble", "fallback", "reset")
POLICY, ENSEMBLE, FALLBACK, RESET = range(len(SOURCES))
OVERLAP_RULES = ("newest", "ensemble")
#: with ``latency_ticks`` (a simulated clock), how long the executor waits for an answer before it raises
ANSWER_TIMEOUT_S = 300.0


def request_threshold(latencies_s: Sequence[float], period_s: float, horizon: int, margin: int = 1) -> int:
    """How many actions may remain in the newest chunk when the next one is requested.

    ``k = min(H, ceil(p95(latency) / period) + margin)``; ``H`` (ask at once) without a
    measured latency.

    Example:
        >>> request_threshold([0.1, 0.2, 0.3], period_s=0.02, horizon=32)
        16
        >>> request_threshold([], period_s=0.02, horizon=32)
        32
    """
    if len(latencies_s) == 0:
        return int(horizon)
    p95 = float(np.percentile(np.asarray(latencies_s, dtype=np.float64), 95))
    return int(min(horizon, math.ceil(p95 / period_s - 1e-9) + margin))


def action_logps_from_tokens(token_logps: Sequence[float] | None, horizon: int) -> np.ndarray | None:
    """Per-action log-probs of a chunk from a policy's ``token_logps``, or None.

    ``H`` entries are one log-prob per action; ``H * m`` entries are ``m`` tokens per action,
    summed per action. Any other length (or none) gives None: the chunk has only its joint
    log-prob.

    Example:
        >>> action_logps_from_tokens([-1.0, -2.0, -0.5, -0.5], horizon=2).tolist()
        [-3.0, -1.0]
        >>> action_logps_from_tokens(None, horizon=2) is None
        True
    """
    if token_logps is None or len(token_logps) == 0 or len(token_logps) % horizon:
        return None
    return np.asarray(token_logps, dtype=np.float64).reshape(horizon, -1).sum(axis=1)


def ticks_met_bound(latencies_s: Sequence[float], period_s: float, horizon: int) -> float:
    """The largest fraction of ticks that can get a policy action: ``min(1, H / mean(ceil(L / period)))``.

    With one request in flight per env, each call occupies at least ``ceil(L / period)`` ticks
    (its answer is playable from the first tick after it arrives) and yields at most ``H``
    actions. One action per call (``H = 1``) meets 1 tick in ``ceil(L / period)``: a 300 ms
    policy on a 20 ms controller meets 1 tick in 16 (15 if the answer lands exactly on a tick).

    Example:
        >>> round(ticks_met_bound([0.3], period_s=0.02, horizon=1), 3)
        0.067
        >>> ticks_met_bound([0.3], period_s=0.02, horizon=16)
        1.0
    """
    ticks = np.ceil(np.asarray(latencies_s, dtype=np.float64) / period_s - 1e-9)
    return float(min(1.0, horizon / max(1.0, float(ticks.mean()))))


@dataclass(frozen=True)
class Chunk:
    """One policy answer: ``actions[j]`` plays at tick ``start_tick + j``.

    Attributes:
        actions: ``(H, *action_shape)``.
        policy_version, behavior_logp: of the policy call that produced the chunk (the
            log-prob of the whole chunk, as the policy reports it).
        chunk_id: a running number per executor.
        start_tick: the tick of its first action (the tick it arrived at).
        policy_fallback: the policy answered with its own fallback (deadline, error).
        action_logps: ``(H,)`` log-prob of each action on its own (`action_logps_from_tokens`),
            or None when the policy reported only the joint one.
        obs: the observation the chunk was requested with.
    """

    actions: np.ndarray
    policy_version: int
    behavior_logp: float
    chunk_id: int
    start_tick: int
    policy_fallback: bool = False
    action_logps: np.ndarray | None = None
    obs: Any = None

    @property
    def end_tick(self) -> int:
        """The first tick after its last action."""
        return self.start_tick + len(self.actions)


class ChunkStream:
    """One env's chunks and the overlap rule: which action plays at a tick.

    Example:
        >>> stream = ChunkStream(overlap="newest")
        >>> stream.install(Chunk(np.zeros((4, 1)), 0, -1.0, chunk_id=0, start_tick=0))
        0
        >>> stream.install(Chunk(np.ones((4, 1)), 1, -2.0, chunk_id=1, start_tick=2))  # drops 2 actions
        2
        >>> action, chunk, index, blended = stream.action_at(3)
        >>> action.tolist(), chunk.chunk_id, index, blended
        ([1.0], 1, 1, 1)
        >>> stream.remaining(3)
        2
    """

    def __init__(self, overlap: str = "newest", ensemble_decay: float = 0.01) -> None:
        if overlap not in OVERLAP_RULES:
            raise ValueError(f"overlap must be one of {OVERLAP_RULES}, got {overlap!r}")
        self.overlap = overlap
        self.ensemble_decay = float(ensemble_decay)
        self.chunks: list[Chunk] = []  # oldest first

    def clear(self) -> None:
        self.chunks = []

    def install(self, chunk: Chunk) -> int:
        """Adds a chunk; returns how many unplayed actions of older chunks the rule drops."""
        live = [c for c in self.chunks if c.end_tick > chunk.start_tick]
        if self.overlap == "newest":
            dropped = sum(c.end_tick - max(c.start_tick, chunk.start_tick) for c in live)
            self.chunks = [chunk]
            return dropped
        self.chunks = [*live, chunk]
        return 0

    def action_at(self, tick: int) -> tuple[np.ndarray, Chunk, int, int] | None:
        """``(action, newest contributing chunk, its index, number of chunks blended)``, or None."""
        self.chunks = [c for c in self.chunks if c.end_tick > tick]
        candidates = [c for c in self.chunks if c.start_tick <= tick]
        if not candidates:
            return None
        newest = candidates[-1]
        index = tick - newest.start_tick
        if len(candidates) == 1:
            return newest.actions[index], newest, index, 1
        weights = np.exp(-self.ensemble_decay * np.arange(len(candidates)))  # ACT: w_0 for the oldest
        stacked = np.stack([c.actions[tick - c.start_tick] for c in candidates]).astype(np.float64)
        blended = np.tensordot(weights / weights.sum(), stacked, axes=1)
        return blended.astype(newest.actions.dtype), newest, index, len(candidates)

    def remaining(self, tick: int) -> int:
        """Actions of the newest chunk left after ``tick`` (0 without a chunk)."""
        if not self.chunks:
            return 0
        return max(0, self.chunks[-1].end_tick - tick - 1)


@dataclass
class ChunkRollout:
    """What `ChunkExecutor.run` executed, one row per tick and env (leading dims ``(T, num_envs)``).

    ``actions`` are the executed actions (after the safety filter), ``proposed`` the actions
    before it (the chunk's action, the blend or the fallback). ``policy_version``,
    ``chunk_id`` and ``chunk_index`` are -1 where no chunk supplied the action;
    ``behavior_logp`` is the chunk's log-prob (0.0 there). ``source`` indexes `SOURCES`.

    For learners: ``action_logp`` is the behavior log-prob of the executed action on its own
    (action ``chunk_index`` of its chunk; NaN where the policy reported no per-action
    log-probs or no chunk supplied the action), ``chunk_obs`` maps each chunk id in the rollout
    to the (single env's) observation it was requested with, and with
    ``ChunkExecutor(record_obs=True)`` ``observations[t]`` is the batched observation the envs
    were in at tick ``t`` and ``next_obs`` the one after the last tick.
    """

    actions: np.ndarray
    proposed: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    policy_version: np.ndarray
    behavior_logp: np.ndarray
    chunk_id: np.ndarray
    chunk_index: np.ndarray
    source: np.ndarray
    safety_replaced: np.ndarray
    late: np.ndarray  # (T,): the tick's step ended after the next tick was due
    tick_time: np.ndarray  # (T,): when each tick started (time.perf_counter() seconds)
    action_logp: np.ndarray | None = None  # (T, num_envs)
    chunk_obs: dict[int, Any] = field(default_factory=dict)
    observations: list[Any] | None = None
    next_obs: Any = None

    @property
    def replaced(self) -> np.ndarray:
        """True where the executed action is not the policy's own sample (overlap rule, fallback, safety, reset)."""
        return (self.source != POLICY) | self.safety_replaced

    @property
    def policy_choice(self) -> np.ndarray:
        """True where the executed action is exactly the chunk's action: the samples to train on."""
        return ~self.replaced

    def count(self, source: str) -> int:
        """How many executed actions came from ``source`` (one of `SOURCES`)."""
        return int((self.source == SOURCES.index(source)).sum())


class ChunkExecutor:
    """Plays action chunks from ``policy`` on ``envs`` at one action per ``period_s`` (module docstring).

    Args:
        envs: a gymnasium ``VectorEnv`` stepped in lockstep (``AsyncLLMVectorEnv``,
            ``SyncVectorEnv``...), with a ``Box`` action space and autoreset mode NEXT_STEP or
            SAME_STEP. One step of all envs must fit in a period (late ticks are counted).
        policy: anything with ``submit(obs, env_id=...) -> Future[PolicyOutput]`` whose action
            is a chunk of shape ``(horizon, *action_shape)`` (with ``horizon=1`` a single
            action of ``action_shape`` also works).
        period_s: the control period in seconds (0.02 for 50 Hz).
        horizon: ``H``, the number of actions per chunk.
        overlap: ``"newest"`` or ``"ensemble"`` (with ``ensemble_decay``).
        fallback: ``"hold"``, ``"zero"`` or ``fallback(obs, env_id) -> action``.
        request_at: a fixed ``k`` (ask when at most ``k`` actions remain) instead of the measured rule.
        request_margin: ticks added to the measured p95 latency in the rule for ``k``.
        latency_window: how many recent answers the p95 latency covers.
        safety: a `SafetyFilter` every executed action passes.
        on_bad_chunk: ``"raise"`` (ValueError naming the env, the shape and the expected
            shape) or ``"fallback"`` (drop it, count it in ``bad_chunks``, ask again).
        latency_ticks: a simulated clock (module docstring, "Clock"): every chunk arrives exactly
            this many ticks (>= 1) after its request and ticks are not paced; None: the wall clock.
        record_obs: keep every tick's observation in ``ChunkRollout.observations`` (for a
            learner's value targets); off by default (images cost memory).

    Raises:
        ValueError: bad arguments, or a chunk of the wrong shape with ``on_bad_chunk="raise"``.
    """

    def __init__(
        self,
        envs: gym.vector.VectorEnv,
        policy: Policy,
        *,
        period_s: float,
        horizon: int,
        overlap: str = "newest",
        ensemble_decay: float = 0.01,
        fallback: str | Callable[[Any, int], Any] = "hold",
        request_at: int | None = None,
        request_margin: int = 1,
        latency_window: int = 100,
        safety: SafetyFilter | None = None,
        on_bad_chunk: str = "raise",
        record_obs: bool = False,
        latency_ticks: int | None = None,
    ) -> None:
        space = envs.single_action_space
        if not isinstance(space, gym.spaces.Box):
            raise TypeError(f"ChunkExecutor needs a Box single_action_space, got {space!r}")
        if isinstance(horizon, bool) or not isinstance(horizon, (int, np.integer)) or horizon < 1:
            raise ValueError(f"horizon must be an int >= 1, got {horizon!r}")
        if not isinstance(period_s, (int, float)) or not period_s > 0:
            raise ValueError(f"period_s must be a number > 0, got {period_s!r}")
        if overlap not in OVERLAP_RULES:
            raise ValueError(f"overlap must be one of {OVERLAP_RULES}, got {overlap!r}")
        if not (callable(fallback) or fallback in ("hold", "zero")):
            raise ValueError(f"fallback must be 'hold', 'zero' or a function(obs, env_id) -> action, got {fallback!r}")
        if request_at is not None and not 0 <= int(request_at) <= horizon:
            raise ValueError(f"request_at must be in [0, horizon={horizon}], got {request_at!r}")
        if latency_ticks is not None and (
            isinstance(latency_ticks, bool) or not isinstance(latency_ticks, (int, np.integer)) or latency_ticks < 1
        ):
            raise ValueError(f"latency_ticks must be None (the wall clock) or an int >= 1, got {latency_ticks!r}")
        if on_bad_chunk not in ("raise", "fallback"):
            raise ValueError(f"on_bad_chunk must be 'raise' or 'fallback', got {on_bad_chunk!r}")
        mode = AutoresetMode(envs.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
        if mode == AutoresetMode.DISABLED:
            raise ValueError("ChunkExecutor needs an autoreset mode of NEXT_STEP or SAME_STEP, got DISABLED")
        self.envs, self.policy, self.autoreset_mode = envs, policy, mode
        self.action_space: gym.spaces.Box = space
        self.num_envs = int(envs.num_envs)
        self.period_s = float(period_s)
        self.horizon = int(horizon)
        self.fallback = fallback
        self.request_at = None if request_at is None else int(request_at)
        self.request_margin = int(request_margin)
        self.safety = safety
        self.on_bad_chunk = on_bad_chunk
        self.record_obs = bool(record_obs)
        self.latency_ticks = None if latency_ticks is None else int(latency_ticks)
        self._request_tick = [0] * self.num_envs
        self._pending_obs: list[Any] = [None] * self.num_envs
        self._zero = zero_action(space)
        self._streams = [ChunkStream(overlap, ensemble_decay) for _ in range(self.num_envs)]
        self._pending: list[Future | None] = [None] * self.num_envs
        self._last_action: list[np.ndarray | None] = [None] * self.num_envs
        self._reset_step = [False] * self.num_envs
        self._latencies: deque[float] = deque(maxlen=int(latency_window))
        self._all_latencies: list[float] = []
        self._obs: Any = None
        self._tick = 0
        self._next_chunk_id = 0
        self._counts = dict.fromkeys(
            (
                "ticks",
                "env_ticks",
                "met",
                "missed",
                "reset_ticks",
                "late_ticks",
                "requests",
                "chunks",
                "policy_fallbacks",
                "bad_chunks",
                "discarded_chunks",
                "overlap_dropped",
                "ensembled",
                "safety_replaced",
            ),
            0,
        )

    # ------------------------------------------------------------------ public API
    def reset(self, *, seed: int | Sequence[int | None] | None = None) -> Any:
        """Resets the envs and forgets every chunk and pending request; returns the observations."""
        self._obs, _ = self.envs.reset(seed=seed)
        for env_id in range(self.num_envs):
            self._end_episode(env_id, reset_step=False)
        return self._obs

    @property
    def threshold(self) -> int:
        """The current ``k``: a request goes out when at most this many actions remain."""
        if self.request_at is not None:
            return self.request_at
        if self.latency_ticks is not None:
            return request_threshold(
                [self.latency_ticks * self.period_s], self.period_s, self.horizon, self.request_margin
            )
        return request_threshold(self._latencies, self.period_s, self.horizon, self.request_margin)

    def run(self, ticks: int) -> ChunkRollout:
        """Runs ``ticks`` control ticks (one env step each) and returns what was executed.

        On the wall clock the ticks are ``period_s`` apart; with ``latency_ticks`` they run back to
        back (module docstring, "Clock").
        """
        if self._obs is None:
            raise ResetNeeded("ChunkExecutor: call reset() before run()")
        shape = self.action_space.shape
        n = self.num_envs
        actions = np.zeros((ticks, n, *shape), dtype=self.action_space.dtype)
        proposed = np.zeros_like(actions)
        rewards = np.zeros((ticks, n))
        terminated = np.zeros((ticks, n), dtype=bool)
        truncated = np.zeros((ticks, n), dtype=bool)
        versions = np.full((ticks, n), -1, dtype=np.int64)
        logps = np.zeros((ticks, n))
        chunk_ids = np.full((ticks, n), -1, dtype=np.int64)
        chunk_index = np.full((ticks, n), -1, dtype=np.int64)
        source = np.zeros((ticks, n), dtype=np.int8)
        safety_replaced = np.zeros((ticks, n), dtype=bool)
        late = np.zeros(ticks, dtype=bool)
        tick_time = np.zeros(ticks)
        action_logp = np.full((ticks, n), np.nan)
        chunk_obs: dict[int, Any] = {}
        observations: list[Any] | None = [] if self.record_obs else None
        simulated = self.latency_ticks is not None
        next_time = time.perf_counter()
        for row in range(ticks):
            delay = next_time - time.perf_counter()
            if delay > 0 and not simulated:
                time.sleep(delay)
            tick_time[row] = time.perf_counter()
            tick = self._tick
            if observations is not None:
                observations.append(copy.deepcopy(self._obs))
            per_env_obs = split_batch(self._obs)
            resetting = [env_id for env_id in range(n) if self._reset_step[env_id]]
            k = self.threshold
            for env_id in range(n):
                obs = per_env_obs[env_id]
                self._receive(env_id, tick)
                if self._reset_step[env_id]:  # NEXT_STEP: this step only resets the env; its action is ignored
                    source[row, env_id] = RESET
                    actions[row, env_id] = proposed[row, env_id] = self._zero
                    self._counts["reset_ticks"] += 1
                    continue
                pick = self._streams[env_id].action_at(tick)
                if pick is None or pick[1].policy_fallback:
                    action = self._fallback_action(obs, env_id) if pick is None else pick[0]
                    source[row, env_id] = FALLBACK
                    self._counts["missed"] += 1
                else:
                    action, chunk, index, blended = pick
                    source[row, env_id] = ENSEMBLE if blended > 1 else POLICY
                    self._counts["ensembled"] += blended > 1
                    self._counts["met"] += 1
                if pick is not None:
                    chunk, index = pick[1], pick[2]
                    versions[row, env_id], logps[row, env_id] = chunk.policy_version, chunk.behavior_logp
                    chunk_ids[row, env_id], chunk_index[row, env_id] = chunk.chunk_id, index
                    chunk_obs[chunk.chunk_id] = chunk.obs
                    if chunk.action_logps is not None:
                        action_logp[row, env_id] = chunk.action_logps[index]
                proposed[row, env_id] = action
                if self.safety is not None:
                    action, reason = self.safety(obs, action, env_id=env_id)
                    if reason is not None:
                        safety_replaced[row, env_id] = True
                        self._counts["safety_replaced"] += 1
                else:  # as the Collector does: a sample is executed clipped into the space, still the policy's
                    action = np.clip(action, self.action_space.low, self.action_space.high)
                actions[row, env_id] = action
                self._last_action[env_id] = actions[row, env_id].copy()
                if self._pending[env_id] is None and self._streams[env_id].remaining(tick) <= k:
                    self._request(obs, env_id)
            self._obs, rewards[row], terminated[row], truncated[row], _ = self.envs.step(actions[row])
            if simulated:  # the tick's answers, computed while the envs stepped; each is held until its tick
                for env_id, future in enumerate(self._pending):
                    if future is not None and self._request_tick[env_id] == self._tick:
                        self._wait_for_answer(future, env_id)
            for env_id in resetting:  # the reset step was played: the env is in its new episode
                self._reset_step[env_id] = False
            for env_id in np.flatnonzero(terminated[row] | truncated[row]):
                self._end_episode(int(env_id), reset_step=self.autoreset_mode == AutoresetMode.NEXT_STEP)
            self._counts["ticks"] += 1
            self._counts["env_ticks"] += n
            self._tick += 1
            next_time += self.period_s
            now = time.perf_counter()
            if (
                now > next_time and not simulated
            ):  # this tick overran the next one's start: count it, do not burst to catch up
                late[row] = True
                self._counts["late_ticks"] += 1
                next_time = now
        return ChunkRollout(
            actions,
            proposed,
            rewards,
            terminated,
            truncated,
            versions,
            logps,
            chunk_ids,
            chunk_index,
            source,
            safety_replaced,
            late,
            tick_time,
            action_logp,
            chunk_obs,
            observations,
            copy.deepcopy(self._obs) if self.record_obs else None,
        )

    def stats(self) -> dict[str, float]:
        """Counters and rates: ticks, env_ticks, met, missed, reset_ticks, met_fraction (met over
        met + missed), late_ticks, requests, chunks, policy_fallbacks, bad_chunks,
        discarded_chunks (answers for an episode that had ended), overlap_dropped (actions the
        newest-wins rule dropped), ensembled, safety_replaced, chunk_latency_p50_ms / p95_ms,
        request_at (the current ``k``)."""
        counts: dict[str, float] = {key: float(value) for key, value in self._counts.items()}
        played = counts["met"] + counts["missed"]
        counts["met_fraction"] = counts["met"] / played if played else float("nan")
        latencies = np.asarray(self._all_latencies) * 1000.0
        p50, p95 = np.percentile(latencies, [50, 95]) if latencies.size else (float("nan"), float("nan"))
        counts["chunk_latency_p50_ms"], counts["chunk_latency_p95_ms"] = float(p50), float(p95)
        counts["request_at"] = float(self.threshold)
        return counts

    def chunk_latencies_s(self) -> list[float]:
        """Every measured chunk latency (submit to answer), in seconds."""
        return list(self._all_latencies)

    def log(self, logger: Any, step: int) -> None:
        """Writes `stats` (``control/...``), the chunk latency histogram and the safety counts to a `RunLogger`."""
        logger.log({f"control/{key}": value for key, value in self.stats().items()}, step=step)
        logger.histogram("control/chunk_latency_ms", np.asarray(self._all_latencies) * 1000.0, step=step)
        if self.safety is not None:
            self.safety.log(logger, step)

    # ------------------------------------------------------------------ internals
    def _request(self, obs: Any, env_id: int) -> None:
        self._pending[env_id] = self.policy.submit(obs, env_id=env_id)
        self._request_tick[env_id] = self._tick
        self._pending_obs[env_id] = copy.deepcopy(obs)  # the env's buffers may be reused by later steps
        self._counts["requests"] += 1

    def _receive(self, env_id: int, tick: int) -> None:
        future = self._pending[env_id]
        if future is None:
            return
        if (
            self.latency_ticks is not None
        ):  # simulated clock: the answer arrives exactly latency_ticks after its request
            if tick < self._request_tick[env_id] + self.latency_ticks:
                return
            self._wait_for_answer(future, env_id)
        elif not future.done():
            return
        self._pending[env_id] = None
        requested_with, self._pending_obs[env_id] = self._pending_obs[env_id], None
        try:
            output: PolicyOutput = future.result()
        except Exception as exc:
            raise ChunkExecutorError(f"ChunkExecutor: the policy failed on env {env_id}'s request: {exc!r}") from exc
        actions = self._as_chunk(output.action, env_id)
        if actions is None:
            return
        if not output.fallback:
            self._latencies.append(float(output.latency_s))
            self._all_latencies.append(float(output.latency_s))
        else:
            self._counts["policy_fallbacks"] += 1
        chunk = Chunk(
            actions,
            int(output.policy_version),
            float(output.behavior_logp),
            self._next_chunk_id,
            tick,
            bool(output.fallback),
            action_logps_from_tokens(output.token_logps, self.horizon),
            requested_with,
        )
        self._next_chunk_id += 1
        self._counts["chunks"] += 1
        self._counts["overlap_dropped"] += self._streams[env_id].install(chunk)

    def _wait_for_answer(self, future: Future, env_id: int) -> None:
        done, _ = wait([future], timeout=ANSWER_TIMEOUT_S)
        if not done:
            raise ChunkExecutorError(
                f"ChunkExecutor: the policy did not answer env {env_id}'s request within {ANSWER_TIMEOUT_S:.0f} s "
                f"(latency_ticks={self.latency_ticks} waits for every answer)"
            )

    def _as_chunk(self, action: Any, env_id: int) -> np.ndarray | None:
        space = self.action_space
        chunk = np.asarray(action)
        expected = (self.horizon, *space.shape)
        if self.horizon == 1 and chunk.shape == space.shape:
            chunk = chunk.reshape(expected)
        if chunk.shape == expected and np.issubdtype(chunk.dtype, np.number):
            return chunk.astype(space.dtype, copy=False)
        message = (
            f"ChunkExecutor: the policy's chunk for env {env_id} has shape {chunk.shape} and dtype {chunk.dtype}, "
            f"expected {expected}: horizon={self.horizon} actions of {space}"
        )
        if self.on_bad_chunk == "raise":
            raise ValueError(message)
        logger.warning("%s; dropped, asking again (on_bad_chunk='fallback')", message)
        self._counts["bad_chunks"] += 1
        return None

    def _fallback_action(self, obs: Any, env_id: int) -> np.ndarray:
        if callable(self.fallback):
            value = np.asarray(self.fallback(obs, env_id), dtype=self.action_space.dtype)
            if value.shape != self.action_space.shape:
                raise ValueError(
                    f"ChunkExecutor: fallback returned shape {value.shape} for env {env_id}, "
                    f"expected {self.action_space.shape}"
                )
            return value
        if self.fallback == "hold" and self._last_action[env_id] is not None:
            return self._last_action[env_id]
        return self._zero

    def _end_episode(self, env_id: int, reset_step: bool) -> None:
        """The episode ended (or the envs were reset): its chunks and pending answer are stale."""
        if self._pending[env_id] is not None:  # left to resolve on its own: the policy owns the future
            self._pending[env_id] = None
            self._pending_obs[env_id] = None
            self._counts["discarded_chunks"] += 1
        self._streams[env_id].clear()
        self._last_action[env_id] = None
        self._reset_step[env_id] = reset_step
        if self.safety is not None:
            self.safety.reset(env_id)
