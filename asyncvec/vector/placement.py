"""Where a vector env's sub-envs run: decided once, before the first step, from what the user asked for.

Promises before speed, in this order:

1. **Where an env runs never changes by itself.** It is decided when the vector env is built,
   from the user's settings (``in_process``, ``envs_per_worker``, ``placement``, the backend) and
   the machine, and an env stays in the process that built it until it closes (a restart rebuilds
   it there from its function). No live env is ever pickled to move it: a copy of a live object is
   a guess about code asyncvec did not write (a simulator that pickles its configuration only, a
   per-process handle), and such a guess fails silently.
2. **The default is gymnasium's:** one env per worker process (``AsyncVectorEnv``'s placement),
   whatever the env. ``in_process=True`` hosts every env in the calling process (the user's
   choice; refused beside ``max_restarts``/``step_timeout``: :func:`in_process_blockers`);
   ``envs_per_worker=k`` shares workers.
3. **Measuring advises.** The workers time each env's first steps, the user's own, and the vector
   env times how long its caller waits; :mod:`~asyncvec.vector.advice` then puts one line in
   ``envs.placement.advice`` (and the ``asyncvec.vector`` logger, at INFO) naming a setting
   predicted faster and by how much. It never acts on it.
4. **No env receives an action the user did not send,** except with ``placement="probe"``, an
   opt-in by name: a throwaway copy of each env function is stepped with random actions in a
   child process before anything runs, and the rule below places the envs from that.

The rule (the probe's choice, the advice's prediction), with ``N`` envs costing ``t_i`` each and a
measured overhead ``o`` per worker message: the predicted wall time of one lockstep vector step
is ``T(groups) = max(max_w sum_{i in w} t_i, sum_i t_i c_i / cores) + W o``; in the calling
process ``sum_i t_i`` plus a small per-env cost. Envs that wait (CPU share under a half: sleeps,
I/O, remote calls) keep a worker each; only CPU-bound envs share workers, at most one busy worker
per core. A setting is named only when predicted ``IN_PROCESS_MARGIN`` (the calling process) or
``REGROUP_MARGIN`` (shared workers) times faster.

Example:
    >>> cheap = [StepProfile(step_s=10e-6, cpu_share=1.0)] * 8
    >>> choose_placement(cheap, overhead_s=30e-6, cores=2, measured_s=500e-6).in_process
    True
    >>> choose_placement(cheap, overhead_s=30e-6, cores=2, measured_s=500e-6, blockers=["max_restarts=1"]).groups
    ((0, 2, 4, 6), (1, 3, 5, 7))
    >>> sleeping = [StepProfile(step_s=10e-3, cpu_share=0.01)] * 4
    >>> choose_placement(sleeping, overhead_s=30e-6, cores=2).envs_per_worker
    1
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gymnasium import Env, Space
from gymnasium.vector.vector_env import AutoresetMode

from asyncvec.vector.errors import PlacementError
from asyncvec.vector.split_obs import is_fixed_shape
from asyncvec.vector.transport import Backend, ProcessBackend, ProcessTransport, WorkerSpec
from asyncvec.vector.worker import EnvFailure

__all__ = [
    "Placement",
    "advice_line",
    "StepProfile",
    "check_placement_arguments",
    "choose_placement",
    "describe_failure",
    "given_placement",
    "initial_placement",
    "in_process_blockers",
    "in_process_placement",
    "probe_placement",
    "probe_skip_reason",
    "profile_env",
    "resolve_backend",
]

logger = logging.getLogger("asyncvec.vector")

#: Leave the current placement for the calling process only when predicted this many times faster.
IN_PROCESS_MARGIN = 1.1
#: Regroup envs among workers only when predicted this many times faster.
REGROUP_MARGIN = 1.25
#: What the calling process adds to each env step beside the env's own step (the in-process fast path).
IN_PROCESS_STEP_COST_S = 3e-6
#: Envs that use less CPU than this share of their step's wall time wait (sleep, I/O): a worker each.
WAITING_CPU_SHARE = 0.5
#: Step messages timed to the probe's worker to measure the round trip (only for steps under the second constant).
PROBE_ROUND_TRIPS = 16
PROBE_ROUND_TRIP_MAX_STEP_S = 0.002
#: The probe's child may take this long in all (beyond building its env) before it counts as failed.
PROBE_TIMEOUT_S = 10.0
DEFAULT_REASON = "one env per worker (the default, as gymnasium.vector.AsyncVectorEnv)"


@dataclass(frozen=True)
class StepProfile:
    """What one env's step costs.

    Attributes:
        step_s: median wall seconds of one ``step``, less the time it sat ready while other processes
            held the cores (what the step costs where it has a core of its own).
        cpu_share: CPU seconds used per wall second of stepping that had a CPU or did not want
            one (about 1 for a simulator, about 0 for an env that sleeps or waits; the time a step
            sat ready while other processes held the cores does not count, so load does not make
            a simulator look like a waiting env).
        round_trip_s: (the probe only) median overhead of one step message to a worker process and
            back, less the step itself; ``None`` if not measured.
        steps: how many steps were timed.
    """

    step_s: float
    cpu_share: float
    round_trip_s: float | None = None
    steps: int = 0

    @staticmethod
    def from_timings(
        walls: Sequence[float],
        cpus: Sequence[float],
        round_trip_s: float | None = None,
        ready_waits: Sequence[float] | None = None,
    ) -> StepProfile:
        """The profile of timed steps: median wall, and the median step's CPU share of the wall
        time less ``ready_waits`` (seconds each step sat ready for a CPU; see `StepProfile`)."""
        waits = ready_waits if ready_waits is not None else [0.0] * len(walls)
        # the schedstat window is a little wider than the wall's: under load wall - wait can go below the CPU
        # time, which bounds the time the step ran from below
        running = [max(wall - wait, cpu, 1e-9) for wall, cpu, wait in zip(walls, cpus, waits, strict=True)]
        cpu_share = min(1.0, statistics.median(cpu / wall for cpu, wall in zip(cpus, running, strict=True)))
        return StepProfile(statistics.median(running), cpu_share, round_trip_s, len(walls))

    @property
    def waits(self) -> bool:
        """The env mostly waits (sleep, I/O, a remote call): it overlaps with others in its own worker."""
        return self.cpu_share < WAITING_CPU_SHARE


@dataclass(frozen=True)
class Placement:
    """How the sub-envs are placed (``AsyncLLMVectorEnv(...).placement``).

    Attributes:
        in_process: the envs run in the calling process, stepped one after another (no workers).
        groups: the env ids each worker hosts (one group of every env when ``in_process``).
        reason: why this placement, in words (the rule's numbers, or what the user asked for).
        profiles: the per-env measurements (the probe's, or the envs' own first steps once timed),
            or ``None`` (not measured yet).
        advice: once the first steps are timed, one line naming a setting predicted faster (and by
            how much), or saying that none is; ``None`` before (:mod:`~asyncvec.vector.advice`).
        advised: the setting the advice names first, as ``AsyncLLMVectorEnv`` keyword arguments
            (e.g. ``{"envs_per_worker": 4}``); empty when none is predicted clearly faster.
    """

    in_process: bool
    groups: tuple[tuple[int, ...], ...]
    reason: str
    profiles: tuple[StepProfile, ...] | None = None
    advice: str | None = None
    advised: dict[str, Any] = field(default_factory=dict)

    @property
    def num_workers(self) -> int:
        """Worker processes (or actors); 0 when ``in_process``."""
        return 0 if self.in_process else len(self.groups)

    @property
    def envs_per_worker(self) -> int:
        """The most envs one worker hosts (``num_envs`` when ``in_process``)."""
        return max(map(len, self.groups))

    @property
    def profile(self) -> StepProfile | None:
        """The first env's measurement (``profiles[0]``), or ``None``."""
        return None if not self.profiles else self.profiles[0]

    def __str__(self) -> str:
        if self.in_process:
            where = "in the calling process"
        elif all(len(group) == self.envs_per_worker for group in self.groups[:-1]):
            where = f"{self.num_workers} worker(s) x {self.envs_per_worker} env(s)"
        else:
            where = f"{self.num_workers} worker(s) hosting {[list(group) for group in self.groups]}"
        shared = (
            ""
            if self.in_process or self.envs_per_worker == 1
            else (" (a worker's death ends the episodes of all its envs; envs_per_worker=1 keeps a crash to one env)")
        )
        advice = f" (advice: {self.advice})" if self.advice else ""
        return f"{where}: {self.reason}{shared}{advice}"


def contiguous_groups(num_envs: int, envs_per_worker: int) -> tuple[tuple[int, ...], ...]:
    """Env ids ``0..num_envs-1`` in workers of ``envs_per_worker`` each (the last may hold fewer)."""
    return tuple(tuple(range(s, min(s + envs_per_worker, num_envs))) for s in range(0, num_envs, envs_per_worker))


def given_placement(num_envs: int, envs_per_worker: int, reason: str) -> Placement:
    """Contiguous workers of ``envs_per_worker`` envs (an explicit setting, or one env per worker)."""
    return Placement(False, contiguous_groups(num_envs, envs_per_worker), reason)


def in_process_placement(num_envs: int, reason: str, profiles: tuple[StepProfile, ...] | None = None) -> Placement:
    return Placement(True, (tuple(range(num_envs)),), reason, profiles)


def in_process_blockers(
    *,
    max_restarts: int,
    step_timeout: float | None,
    batch_size: int,
    num_envs: int,
    process_backend: bool,
    in_process: bool | None,
    fault_policy: object | None = None,
) -> list[str]:
    """The settings that forbid hosting the envs in the calling process, in words (empty: allowed).
    Later uses add their own (a partial ``send``, a step from another thread: the advice).
    ``fault_policy``: a policy of the user's own (it may restart, as ``max_restarts > 0``)."""
    blockers = []
    if fault_policy is not None:
        blockers.append(f"fault_policy={fault_policy!r} (a crash in this process could not be restarted)")
    elif max_restarts > 0:
        blockers.append(f"max_restarts={max_restarts} (a crash in this process could not be restarted)")
    if step_timeout is not None:
        blockers.append(f"step_timeout={step_timeout} (a step in this process cannot be interrupted)")
    if batch_size < num_envs:
        blockers.append(f"batch_size={batch_size} < num_envs={num_envs} (partial batches need envs stepping apart)")
    if not process_backend:
        blockers.append("another backend than worker processes")
    if in_process is False:
        blockers.append("in_process=False")
    return blockers


def predicted_step_s(
    groups: Sequence[Sequence[int]], profiles: Sequence[StepProfile], cores: int, overhead_s: float
) -> float:
    """Predicted wall seconds of one lockstep vector step with the envs in workers as ``groups``
    (the module docstring's ``T``)."""
    busiest = max(sum(profiles[i].step_s for i in group) for group in groups)
    cpu = sum(p.step_s * p.cpu_share for p in profiles) / cores
    return max(busiest, cpu) + len(groups) * overhead_s


def predicted_in_process_s(profiles: Sequence[StepProfile]) -> float:
    """Predicted wall seconds of one lockstep vector step with every env in the calling process."""
    return sum(p.step_s + IN_PROCESS_STEP_COST_S for p in profiles)


def packed_groups(profiles: Sequence[StepProfile], cores: int) -> tuple[tuple[int, ...], ...]:
    """Envs that wait keep a worker each; CPU-bound envs share at most ``cores`` workers, each env to
    the least loaded worker, slowest first (so that a slow env does not stack on another)."""
    busy = sorted((i for i, p in enumerate(profiles) if not p.waits), key=lambda i: -profiles[i].step_s)
    workers = min(len(busy), max(1, cores))
    packs: list[list[int]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for index in busy:
        w = loads.index(min(loads))
        packs[w].append(index)
        loads[w] += profiles[index].step_s
    groups = [sorted(pack) for pack in packs if pack] + [[i] for i, p in enumerate(profiles) if p.waits]
    return tuple(tuple(group) for group in sorted(groups))


def choose_placement(
    profiles: Sequence[StepProfile],
    *,
    overhead_s: float,
    cores: int,
    measured_s: float | None = None,
    current: Sequence[Sequence[int]] | None = None,
    blockers: Sequence[str] = (),
    may_share_workers: bool = True,
) -> Placement:
    """The module docstring's rule for envs costing ``profiles`` (one per env).

    Args:
        overhead_s: the measured cost of one message to a worker and back, beyond the steps.
        cores: cores the envs may use.
        measured_s: the measured wall time of one vector step as the envs run now (``current``),
            or ``None``: then the current placement is one env per worker, as predicted.
        current: the groups the envs run in now (default: one env per worker).
        blockers: why the envs may not run in the calling process (:func:`in_process_blockers`).
        may_share_workers: ``False`` for partial batches: each env keeps the worker it has.
    """
    num_envs = len(profiles)
    current_groups = tuple(tuple(g) for g in current) if current is not None else contiguous_groups(num_envs, 1)
    now = measured_s if measured_s is not None else predicted_step_s(current_groups, profiles, cores, overhead_s)
    cpu = statistics.mean(p.cpu_share for p in profiles)
    measured = (
        f"steps {statistics.median(p.step_s for p in profiles) * 1e6:,.1f} us (median of {num_envs} envs, "
        f"{min(p.step_s for p in profiles) * 1e6:,.1f}-{max(p.step_s for p in profiles) * 1e6:,.1f}) at {cpu:.0%} "
        f"CPU, {overhead_s * 1e6:,.0f} us per worker message, {cores} cores; a vector step "
        f"{'measured' if measured_s is not None else 'predicted'} {now * 1e6:,.0f} us"
    )
    in_process_s = predicted_in_process_s(profiles)
    if not blockers and in_process_s * IN_PROCESS_MARGIN <= now:
        return in_process_placement(
            num_envs,
            f"in this process predicted {in_process_s * 1e6:,.0f} us a vector step, at least "
            f"{IN_PROCESS_MARGIN}x faster; {measured}",
            tuple(profiles),
        )
    packed = packed_groups(profiles, cores)
    packed_s = predicted_step_s(packed, profiles, cores, overhead_s)
    if may_share_workers and packed != current_groups and packed_s * REGROUP_MARGIN <= now:
        return Placement(
            False,
            packed,
            f"CPU-bound envs share at most one busy worker per core, those that wait keep their own "
            f"(predicted {packed_s * 1e6:,.0f} us, at least {REGROUP_MARGIN}x faster); {measured}",
            tuple(profiles),
        )
    why = "; ".join(list(blockers) + ([] if may_share_workers else ["partial batches: each env keeps its worker"]))
    why = why or "no other placement is clearly faster"
    return Placement(False, current_groups, f"stays: {why}; {measured}", tuple(profiles))


def advice_line(
    profiles: Sequence[StepProfile],
    *,
    overhead_s: float,
    cores: int,
    measured_s: float,
    current: Sequence[Sequence[int]],
    in_process_now: bool = False,
    blockers: Sequence[str] = (),
    may_share_workers: bool = True,
) -> tuple[str, dict[str, Any]]:
    """One line of advice from the envs' own timed steps: the settings predicted faster than the
    vector step ``measured_s`` as the envs run now (``current``), each with its predicted gain, or
    that none is; and the first of them as keyword arguments. Only settings the user's others allow
    are named (``blockers`` forbid the calling process; partial batches, ``may_share_workers=False``,
    forbid shared workers).

    Example:
        >>> cheap = [StepProfile(step_s=17e-6, cpu_share=1.0)] * 8
        >>> line, settings = advice_line(cheap, overhead_s=40e-6, cores=2, measured_s=400e-6,
        ...                              current=[[i] for i in range(8)])
        >>> line
        'these envs step in 17 us (median of 8) at 100% CPU: envs_per_worker=4 is predicted 2.7x faster; in_process=True 2.5x'
        >>> settings
        {'envs_per_worker': 4}
    """
    num_envs = len(profiles)
    median_s = statistics.median(p.step_s for p in profiles)
    cpu = statistics.mean(p.cpu_share for p in profiles)
    waiting = sum(p.waits for p in profiles)
    measured = f"these envs step in {median_s * 1e6:,.0f} us (median of {num_envs}) at {cpu:.0%} CPU" + (
        f", {waiting} of them mostly waiting" if waiting else ""
    )
    options: list[tuple[str, float, dict[str, Any]]] = []
    if not blockers and not in_process_now:
        options.append(("in_process=True", measured_s / predicted_in_process_s(profiles), {"in_process": True}))
    current_groups = [tuple(g) for g in current]
    if may_share_workers:
        shared: list[tuple[str, float, dict[str, Any]]] = []
        for workers in sorted({max(1, cores), 2 * max(1, cores)}):
            per_worker = -(-num_envs // workers)
            groups = contiguous_groups(num_envs, per_worker)
            if per_worker > 1 and list(groups) != current_groups:
                predicted_s = predicted_step_s(groups, profiles, cores, overhead_s)
                setting = {"envs_per_worker": per_worker}
                shared.append((f"envs_per_worker={per_worker}", measured_s / predicted_s, setting))
        options += sorted(shared, key=lambda option: -option[1])[:1]
    margins = {"in_process=True": IN_PROCESS_MARGIN}
    worth = [option for option in options if option[1] >= margins.get(option[0], REGROUP_MARGIN)]
    if not worth:
        return f"{measured}: no other setting is predicted clearly faster", {}
    worth.sort(key=lambda option: -option[1])
    first, *rest = worth
    named = [f"{first[0]} is predicted {first[1]:.1f}x faster"] + [f"{name} {gain:.1f}x" for name, gain, _ in rest]
    return f"{measured}: {'; '.join(named)}", first[2]


def resolve_backend(backend: str | Backend, context: str | None, daemon: bool) -> Backend:
    """Where the workers run, as ``AsyncLLMVectorEnv(backend=...)`` names it: ``"process"``, ``"ray"``, or a
    :class:`~asyncvec.vector.transport.Backend` (here, not in transport.py: Ray's backend imports the transport).

    Example:
        >>> resolve_backend("process", context=None, daemon=True)
        ProcessBackend(context=None, daemon=True)
    """
    if isinstance(backend, Backend):
        return backend
    if backend == "process":
        return ProcessBackend(context=context, daemon=daemon)
    if backend == "ray":
        from asyncvec.distributed.ray_env import RayBackend  # imported only when asked: Ray is an extra

        return RayBackend()
    raise ValueError(f"backend must be 'process', 'ray' or a Backend instance, got {backend!r}")


def check_placement_arguments(envs_per_worker: Any, in_process: bool | None, backend: Any, placement: Any) -> None:
    """Refuses ``AsyncLLMVectorEnv`` placement arguments that do not fit together, before anything starts.

    Example:
        >>> check_placement_arguments(4, True, "process", "auto")
        Traceback (most recent call last):
        ...
        ValueError: in_process=True runs every env in this process: do not also give envs_per_worker
    """
    if envs_per_worker is not None and (
        isinstance(envs_per_worker, bool) or not isinstance(envs_per_worker, (int, np.integer)) or envs_per_worker < 1
    ):
        raise ValueError(
            f"envs_per_worker must be an int >= 1 or None (chosen from the envs' own steps), got {envs_per_worker!r}"
        )
    if in_process and envs_per_worker is not None:
        raise ValueError("in_process=True runs every env in this process: do not also give envs_per_worker")
    if in_process and backend != "process":
        raise ValueError(f"in_process=True needs the default backend='process', got backend={backend!r}")
    if placement not in ("auto", "probe"):
        raise ValueError(
            f"placement must be 'auto' (measured from your own steps) or 'probe' (random actions on a throwaway "
            f"copy of each env, before anything runs), got {placement!r}"
        )
    if placement == "probe" and (in_process or envs_per_worker is not None):
        raise ValueError("placement='probe' chooses the placement: do not also give envs_per_worker or in_process=True")


def initial_placement(
    env_fns: Sequence[Callable[[], Env[Any, Any]]],
    backend: Backend,
    *,
    placement: str,
    envs_per_worker: int | None,
    in_process: bool | None,
    max_restarts: int,
    step_timeout: float | None,
    batch_size: int,
    spaces: tuple[Space[Any], Space[Any], Any, dict[Any, Any]] | None,
    context: str | None,
    start_timeout: float,
    daemon: bool,
    fault_policy: object | None = None,
) -> tuple[Placement, list[str]]:
    """Where the envs run, for good, and what forbids the calling process (:func:`in_process_blockers`,
    for the advice): as given (``in_process=True``, ``envs_per_worker``), as probed (``placement="probe"``),
    else one env per worker. ``spaces``: the env's observation and action spaces, render mode and metadata,
    when read here (``None`` for remote workers).

    Example:
        >>> import gymnasium as gym
        >>> p, blockers = initial_placement([lambda: gym.make("CartPole-v1")] * 4, ProcessBackend(), placement="auto",
        ...     envs_per_worker=None, in_process=None, max_restarts=1, step_timeout=None, batch_size=4, spaces=None,
        ...     context=None, start_timeout=60.0, daemon=True)
        >>> p.num_workers, p.reason
        (4, 'one env per worker (the default, as gymnasium.vector.AsyncVectorEnv)')
        >>> blockers
        ['max_restarts=1 (a crash in this process could not be restarted)']
    """
    num_envs = len(env_fns)
    blockers = in_process_blockers(
        max_restarts=max_restarts,
        step_timeout=step_timeout,
        batch_size=batch_size,
        num_envs=num_envs,
        process_backend=isinstance(backend, ProcessBackend),
        in_process=in_process,
        fault_policy=fault_policy,
    )
    if in_process:
        return in_process_placement(num_envs, "in_process=True"), blockers
    if envs_per_worker is not None:
        return given_placement(num_envs, int(envs_per_worker), "envs_per_worker given"), blockers
    if placement == "probe":
        probe_skip = None if spaces is None else probe_skip_reason(*spaces)
        if probe_skip is not None:
            return given_placement(num_envs, 1, f"one env per worker: not measured: {probe_skip}"), blockers
        probed = probe_placement(
            env_fns, backend, blockers=blockers, context=context, start_timeout=start_timeout, daemon=daemon
        )
        return probed, blockers
    return given_placement(num_envs, 1, DEFAULT_REASON), blockers


def probe_skip_reason(
    observation_space: Space[Any], action_space: Space[Any], render_mode: Any, metadata: dict[Any, Any]
) -> str | None:  # the order of initial_placement's ``spaces``
    """Why ``placement="probe"`` does not probe the env (random actions not meaningful or not safe), or ``None``."""
    if metadata.get("asyncvec_probe", True) is False:
        return "the env declares metadata['asyncvec_probe'] = False"
    if not is_fixed_shape(action_space):
        return f"action space {action_space} is not fixed-shape (random actions would not be meaningful)"
    if render_mode == "human":
        return "render_mode='human' (a probe would open a window)"
    return None


def probe_placement(
    env_fns: Sequence[Callable[[], Env[Any, Any]]],
    backend: Backend,
    *,
    blockers: Sequence[str],
    context: str | None,
    start_timeout: float,
    daemon: bool,
) -> Placement:
    """``placement="probe"`` (an opt-in): steps a throwaway copy of each distinct env function with
    random actions (:func:`profile_env`) and applies :func:`choose_placement`. A probe that fails
    falls back to one env per worker.

    Example:
        >>> import gymnasium as gym
        >>> p = probe_placement([lambda: gym.make("CartPole-v1")] * 4, ProcessBackend(), blockers=["max_restarts=1"],
        ...                     context=None, start_timeout=60.0, daemon=True)
        >>> p.in_process, p.profile is not None
        (False, True)
    """
    by_fn: dict[int, StepProfile] = {}
    try:
        for fn in env_fns:
            if id(fn) not in by_fn:
                by_fn[id(fn)] = profile_env(fn, context, start_timeout, daemon)
    except Exception as exc:  # the env, not the vector env, failed: fall back to gymnasium's placement
        return given_placement(len(env_fns), 1, f"one env per worker: {exc}")
    profiles = [by_fn[id(fn)] for fn in env_fns]
    trips = [p.round_trip_s for p in profiles if p.round_trip_s is not None]
    return choose_placement(
        profiles,
        overhead_s=statistics.median(trips) if trips else 0.0,
        cores=backend.parallelism(),
        blockers=list(blockers) + ([] if isinstance(backend, ProcessBackend) else ["another backend"]),
    )


def profile_env(
    env_fn: Callable[[], Env[Any, Any]], context: str | None = None, start_timeout: float = 60.0, daemon: bool = True
) -> StepProfile:
    """Measures one throwaway env built by ``env_fn`` in a child process with random actions
    (``placement="probe"`` only: a crash, hang or exit there costs nothing but the probe).

    Raises:
        PlacementError: the env could not be built or cannot be measured, raised while stepping, or
            the child died or took longer than ``start_timeout`` to build plus ``PROBE_TIMEOUT_S``.
    """
    ctx = multiprocessing.get_context(context)
    # daemon as the vector env's workers: an env that starts processes of its own needs daemon=False
    transport = ProcessTransport(WorkerSpec([env_fn], [[0]], AutoresetMode.NEXT_STEP), ctx, daemon=daemon)
    try:
        ok, payload = transport.await_ready(0, start_timeout)
        if not ok:
            raise PlacementError(f"measurement failed: the probe env could not be built: {describe_failure(payload)}")
        observation_space, action_space, metadata, render_mode = _ask(transport, (0, "spaces", None))
        skip = probe_skip_reason(observation_space, action_space, render_mode, metadata)
        if skip is not None:
            raise PlacementError(f"not measured: {skip}")
        timings = _ask(transport, (0, "probe", None))
        profile = StepProfile.from_timings(timings["step_s"], timings["cpu_s"], ready_waits=timings["ready_s"])
        round_trip_s = None
        if profile.step_s < PROBE_ROUND_TRIP_MAX_STEP_S:  # for slower steps the round trip does not change the choice
            space = copy.deepcopy(_ask(transport, (0, "call", ("action_space", (), {}))))
            space.seed(1)
            trips = []
            for _ in range(PROBE_ROUND_TRIPS):
                start = time.perf_counter()
                _ask(transport, (0, "step", space.sample()))
                trips.append(time.perf_counter() - start)
            round_trip_s = max(0.0, statistics.median(trips) - profile.step_s)
        return StepProfile(profile.step_s, profile.cpu_share, round_trip_s, profile.steps)
    finally:
        transport.close(timeout=1.0, terminate=False)


def _ask(transport: Any, item: tuple[int, str, Any]) -> Any:
    transport.send(0, [item])
    if not transport.wait([0], PROBE_TIMEOUT_S):
        raise PlacementError(f"measurement failed: the probe env did not answer {item[1]!r} within {PROBE_TIMEOUT_S} s")
    ok, payload = transport.read(0)
    if not ok:
        raise PlacementError(f"measurement failed: the probe's worker failed: {describe_failure(payload)}")
    result = payload[0]
    if isinstance(result, EnvFailure):
        raise PlacementError(f"measurement failed: the probe env raised in {item[1]!r}: {describe_failure(result)}")
    return result


def describe_failure(payload: Any) -> str:
    """A worker's error payload (or a ``BuildFailure``) in one line: ``Type: message``."""
    payload = getattr(payload, "payload", payload)  # a BuildFailure wraps the error payload
    if isinstance(payload, tuple) and len(payload) >= 2:
        return f"{payload[0]}: {payload[1]}"
    return repr(payload)
