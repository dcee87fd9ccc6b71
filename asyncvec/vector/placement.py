"""Where a vector env's sub-envs run, chosen from a measurement of the env (``envs_per_worker=None``).

At construction, unless ``envs_per_worker`` is given, :func:`profile_env` builds one throwaway
env in a child process (a crash, hang or exit there costs nothing but the probe) and measures:

* ``t``: the median wall time of one ``step`` with random actions from the action space,
* ``c``: the CPU share of a step (CPU seconds of the process per wall second, the median over the
  steps; a sleeping or waiting env is near 0, a simulator near 1),
* ``o``: the overhead of one message to a worker process and back (pickling, pipe, wake-ups),
  from real step messages to that child, less ``t``.

:func:`choose_placement` then applies one rule, the same for every env (no setting is keyed by
an env id), for ``N`` envs on a machine with ``cores`` usable cores:

1. Busy workers: ``W = min(N, round(cores / c))``: never more CPU-bound workers than cores (a
   simulator with ``c = 1`` gets one worker per core), one worker per env for envs that wait
   (``c -> 0``: sleeps, I/O, remote calls overlap across workers). Each worker hosts
   ``k = ceil(N / W)`` envs.
2. In the calling process instead, when stepping all ``N`` envs one after another costs no more
   than one round trip to a worker: ``N * t <= o`` (a step far cheaper than a pipe round trip,
   e.g. classic control). Then workers could not win even in lockstep, and the caller loses
   at most one round trip of overlap per step (the env steps inside ``send``/``step_async``
   instead of beside the caller's work). Never with ``step_timeout`` (an in-process step cannot
   be interrupted), nor with a backend other than worker processes, nor when the env declares
   ``metadata["asyncvec_probe"] = False``.

The probe is skipped (one env per worker, gymnasium's placement) where random actions are not
meaningful or safe: action spaces of variable size (``Text``, ``Sequence``, ``Graph``: text
envs), ``render_mode="human"``, an env whose metadata says ``"asyncvec_probe": False`` (declare
it for envs whose steps act on the world: hardware, paid services, one-shot files), or a probe
that fails (the env raises, dies, or takes longer than its budget). Passing ``envs_per_worker``
or ``in_process`` also skips it. ``envs.placement`` tells what was chosen and why; the ``asyncvec.vector``
logger says it at INFO level.

Example:
    >>> p = choose_placement(8, StepProfile(step_s=5e-6, cpu_share=1.0, round_trip_s=60e-6, steps=64), cores=2)
    >>> p.in_process, p.envs_per_worker
    (True, 8)
    >>> p = choose_placement(8, StepProfile(step_s=1e-3, cpu_share=1.0, round_trip_s=60e-6, steps=50), cores=2)
    >>> p.in_process, p.envs_per_worker, p.num_workers
    (False, 4, 2)
    >>> sleeping = StepProfile(step_s=10e-3, cpu_share=0.01, round_trip_s=60e-6, steps=5)
    >>> choose_placement(16, sleeping, cores=2).envs_per_worker
    1
"""

from __future__ import annotations

import copy
import logging
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium import Env, Space
from gymnasium.vector.vector_env import AutoresetMode

from asyncvec.vector.split_obs import is_fixed_shape

if TYPE_CHECKING:
    from asyncvec.vector.transport import Backend

__all__ = [
    "Placement",
    "StepProfile",
    "check_placement_arguments",
    "choose_placement",
    "given_placement",
    "in_process_placement",
    "place_envs",
    "probe_skip_reason",
    "profile_env",
    "time_steps",
    "usable_cores",
]

logger = logging.getLogger("asyncvec.vector")

#: The probe steps its env for about this long (wall seconds of stepping), at most PROBE_MAX_STEPS steps.
PROBE_BUDGET_S = 0.05
PROBE_MAX_STEPS = 64
#: A step longer than this ends the probe at once: the env is slow, and one step says how slow.
PROBE_SLOW_STEP_S = 0.02
#: Step messages timed to the probe's worker to measure the round trip (only for steps under the second constant).
PROBE_ROUND_TRIPS = 16
PROBE_ROUND_TRIP_MAX_STEP_S = 0.002
#: The probe's child may take this long in all (beyond building its env) before it counts as failed.
PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class StepProfile:
    """What :func:`profile_env` measured of one env.

    Attributes:
        step_s: median wall seconds of one ``step``.
        cpu_share: CPU seconds the env's process used per wall second of stepping (about 1 for
            a simulator, about 0 for an env that sleeps or waits).
        round_trip_s: median overhead of one step message to a worker process and back, less
            the step itself; ``None`` if not measured.
        steps: how many steps were timed.
    """

    step_s: float
    cpu_share: float
    round_trip_s: float | None
    steps: int


@dataclass(frozen=True)
class Placement:
    """How the sub-envs are placed (``AsyncLLMVectorEnv(...).placement``).

    Attributes:
        in_process: the envs run in the calling process, stepped one after another (no workers).
        envs_per_worker: envs each worker process hosts (``num_envs`` when ``in_process``).
        num_workers: worker processes (or actors); 0 when ``in_process``.
        reason: why this placement, in words (the rule's numbers, or why none was measured).
        profile: the measurement the choice came from, or ``None`` (given, or not measured).
    """

    in_process: bool
    envs_per_worker: int
    num_workers: int
    reason: str
    profile: StepProfile | None = None

    def __str__(self) -> str:
        where = (
            "in the calling process"
            if self.in_process
            else f"{self.num_workers} worker(s) x {self.envs_per_worker} env(s)"
        )
        return f"{where}: {self.reason}"


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells it, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def given_placement(num_envs: int, envs_per_worker: int, reason: str) -> Placement:
    """The placement of an explicit ``envs_per_worker`` (or of a fallback to one env per worker)."""
    return Placement(False, envs_per_worker, math.ceil(num_envs / envs_per_worker), reason)


def in_process_placement(num_envs: int, reason: str, profile: StepProfile | None = None) -> Placement:
    return Placement(True, num_envs, 0, reason, profile)


def choose_placement(num_envs: int, profile: StepProfile, cores: int, can_run_in_process: bool = True) -> Placement:
    """The module docstring's rule: workers ``W = min(N, round(cores / c))``, ``k = ceil(N / W)``
    envs each; in the calling process if ``N * t <= o`` and ``can_run_in_process``."""
    t, c = profile.step_s, max(profile.cpu_share, 1e-3)
    o = profile.round_trip_s or 0.0
    busy = min(num_envs, max(1, round(cores / c)))  # rounded: a measured share of 0.97 is one core
    k = math.ceil(num_envs / busy)
    workers = math.ceil(num_envs / k)
    measured = f"step {t * 1e6:,.0f} us at {profile.cpu_share:.0%} CPU, round trip {o * 1e6:,.0f} us, {cores} cores"
    if can_run_in_process and num_envs * t <= o:
        return in_process_placement(
            num_envs,
            f"{num_envs} steps in turn ({num_envs * t * 1e6:,.0f} us) cost no more than a worker round trip; "
            f"{measured}",
            profile,
        )
    why = "CPU-bound: at most one busy worker per core" if busy < num_envs else "one worker per env"
    return Placement(False, k, workers, f"{why}; {measured}", profile)


def check_placement_arguments(envs_per_worker: Any, in_process: bool | None, backend: Any) -> None:
    """Refuses ``AsyncLLMVectorEnv`` placement arguments that do not fit together, before anything starts.

    Example:
        >>> check_placement_arguments(4, True, "process")
        Traceback (most recent call last):
        ...
        ValueError: in_process=True runs every env in this process: do not also give envs_per_worker
    """
    if envs_per_worker is not None and (
        isinstance(envs_per_worker, bool) or not isinstance(envs_per_worker, (int, np.integer)) or envs_per_worker < 1
    ):
        raise ValueError(
            f"envs_per_worker must be an int >= 1 or None (chosen by measuring the env), got {envs_per_worker!r}"
        )
    if in_process and envs_per_worker is not None:
        raise ValueError("in_process=True runs every env in this process: do not also give envs_per_worker")
    if in_process and backend != "process":
        raise ValueError(f"in_process=True needs the default backend='process', got backend={backend!r}")


def place_envs(
    env_fns: list[Callable[[], Env[Any, Any]]],
    backend: Backend,
    *,
    envs_per_worker: int | None,
    in_process: bool | None,
    step_timeout: float | None,
    skip_reason: str | None,
    context: str | None,
    start_timeout: float,
    daemon: bool,
) -> Placement:
    """How a vector env places its envs: as given (``in_process=True``, ``envs_per_worker``), else by
    measuring one env (:func:`profile_env`) and :func:`choose_placement`'s rule.

    ``skip_reason``: :func:`probe_skip_reason` of the env's spaces when they are known here (then one
    env per worker, unmeasured). A probe that fails falls back to one env per worker (gymnasium's placement).

    Example:
        >>> import gymnasium as gym
        >>> from asyncvec.vector.transport import ProcessBackend
        >>> place_envs([lambda: gym.make("CartPole-v1")] * 4, ProcessBackend(), envs_per_worker=2, in_process=None,
        ...            step_timeout=None, skip_reason=None, context=None, start_timeout=60.0, daemon=True).num_workers
        2
    """
    num_envs = len(env_fns)
    if in_process:
        return in_process_placement(num_envs, "in_process=True")
    if envs_per_worker is not None:
        return given_placement(num_envs, int(envs_per_worker), "envs_per_worker given")
    if skip_reason is not None:
        return given_placement(num_envs, 1, f"one env per worker: not measured: {skip_reason}")
    try:
        profile = profile_env(env_fns[0], context, start_timeout, daemon)
    except Exception as exc:  # the env, not the vector env, failed: fall back to gymnasium's placement
        return given_placement(num_envs, 1, f"one env per worker: {exc}")
    from asyncvec.vector.transport import ProcessBackend  # transport imports this module

    can_run_in_process = in_process is None and step_timeout is None and isinstance(backend, ProcessBackend)
    return choose_placement(num_envs, profile, backend.parallelism(), can_run_in_process)


def time_steps(
    env: Env[Any, Any], budget_s: float = PROBE_BUDGET_S, max_steps: int = PROBE_MAX_STEPS
) -> dict[str, Any]:
    """Steps ``env`` with random actions (a seeded copy of its action space) and times each step.

    Runs in the probe's worker process (the ``"probe"`` command). Returns ``{"step_s": [...],
    "cpu_s": [...]}``, wall and process-CPU seconds per step; a reset after an episode's end is
    not timed. Stops after ``budget_s`` of stepping, ``max_steps`` steps, or one step longer than
    ``PROBE_SLOW_STEP_S``.
    """
    space: Space[Any] = copy.deepcopy(env.action_space)
    space.seed(0)
    env.reset(seed=0)
    walls: list[float] = []
    cpus: list[float] = []
    spent = 0.0
    while len(walls) < max_steps and spent < budget_s:
        action = space.sample()
        wall, cpu = time.perf_counter(), time.process_time()
        _, _, terminated, truncated, _ = env.step(action)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        walls.append(wall)
        cpus.append(cpu)
        spent += wall
        if wall > PROBE_SLOW_STEP_S:
            break
        if terminated or truncated:
            env.reset()
    return {"step_s": walls, "cpu_s": cpus}


def probe_skip_reason(
    observation_space: Space[Any], action_space: Space[Any], render_mode: Any, metadata: dict[Any, Any]
) -> str | None:
    """Why the env is not probed (random actions not meaningful or not safe), or ``None``."""
    if metadata.get("asyncvec_probe", True) is False:
        return "the env declares metadata['asyncvec_probe'] = False"
    if not is_fixed_shape(action_space):
        return f"action space {action_space} is not fixed-shape (random actions would not be meaningful)"
    if render_mode == "human":
        return "render_mode='human' (a probe would open a window)"
    return None


def profile_env(
    env_fn: Callable[[], Env[Any, Any]], context: str | None = None, start_timeout: float = 60.0, daemon: bool = True
) -> StepProfile:
    """Measures one throwaway env built by ``env_fn`` in a child process (see the module docstring).

    Raises:
        RuntimeError: the env could not be built, raised while stepping, or the child died or
            took longer than ``start_timeout`` to build plus ``PROBE_TIMEOUT_S``.
    """
    from asyncvec.vector.transport import ProcessTransport, WorkerSpec

    ctx = multiprocessing.get_context(context)
    # daemon as the vector env's workers: an env that starts processes of its own needs daemon=False
    transport = ProcessTransport(WorkerSpec([env_fn], [[0]], AutoresetMode.NEXT_STEP), ctx, daemon=daemon)
    try:
        ok, payload = transport.await_ready(0, start_timeout)
        if not ok:
            raise RuntimeError(f"measurement failed: the probe env could not be built: {_describe(payload)}")
        observation_space, action_space, metadata, render_mode = _ask(transport, (0, "spaces", None))
        skip = probe_skip_reason(observation_space, action_space, render_mode, metadata)
        if skip is not None:
            raise RuntimeError(f"not measured: {skip}")
        timings = _ask(transport, (0, "probe", None))
        walls, cpus = timings["step_s"], timings["cpu_s"]
        step_s = statistics.median(walls)
        # The median step's share, not total CPU over total wall: on a loaded machine some steps of a
        # CPU-bound env are preempted (wall > CPU), and the median step still shows what the env needs.
        cpu_share = min(1.0, statistics.median(cpu / max(wall, 1e-9) for cpu, wall in zip(cpus, walls)))
        round_trip_s = None
        if step_s < PROBE_ROUND_TRIP_MAX_STEP_S:  # for slower steps the round trip does not change the choice
            space = copy.deepcopy(_ask(transport, (0, "call", ("action_space", (), {}))))
            space.seed(1)
            trips = []
            for _ in range(PROBE_ROUND_TRIPS):
                start = time.perf_counter()
                _ask(transport, (0, "step", space.sample()))
                trips.append(time.perf_counter() - start)
            round_trip_s = max(0.0, statistics.median(trips) - step_s)
        return StepProfile(step_s, cpu_share, round_trip_s, len(walls))
    finally:
        transport.close(timeout=1.0, terminate=False)


def _ask(transport: Any, item: tuple[int, str, Any]) -> Any:
    transport.send(0, [item])
    if not transport.wait([0], PROBE_TIMEOUT_S):
        raise RuntimeError(f"measurement failed: the probe env did not answer {item[1]!r} within {PROBE_TIMEOUT_S} s")
    ok, payload = transport.read(0)
    if not ok:
        raise RuntimeError(f"measurement failed: the probe's worker failed: {_describe(payload)}")
    from asyncvec.vector.worker import EnvFailure

    result = payload[0]
    if isinstance(result, EnvFailure):
        raise RuntimeError(f"measurement failed: the probe env raised in {item[1]!r}: {_describe(result)}")
    return result


def _describe(payload: Any) -> str:
    payload = getattr(payload, "payload", payload)  # a BuildFailure wraps the error payload
    if isinstance(payload, tuple) and len(payload) >= 2:
        return f"{payload[0]}: {payload[1]}"
    return repr(payload)
