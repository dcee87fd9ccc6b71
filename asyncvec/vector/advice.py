"""Advice from the user's own steps: time the first steps where the envs run, then name a faster setting.

Wherever the envs run in worker processes, their workers time :data:`TIMED_STEPS` steps of each env after its
first :data:`WARMUP_STEPS` (the user's own actions: nothing is stepped that the user did not send),
and the vector env times how long its caller waits inside ``step``/``send``/``recv``. At the first
moment after that when no message is in flight, the workers' timings come back and
:func:`~asyncvec.vector.placement.advice_line` predicts what each other setting would give:
``envs.placement.advice`` then holds one line (e.g. "these envs step in 17 us (median of 8) at
100% CPU: in_process=True is predicted 2.7x faster; envs_per_worker=4 1.9x"), logged once at INFO
by the ``asyncvec.vector`` logger. Nothing moves: where the envs run was decided before their
first step (:mod:`~asyncvec.vector.placement`) and stays so.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from asyncvec.vector.errors import PlacementError
from asyncvec.vector.placement import StepProfile, advice_line, describe_failure, predicted_step_s
from asyncvec.vector.transport import Transport
from asyncvec.vector.worker import TIMING_WARMUP_S, TIMING_WARMUP_STEPS, EnvFailure

__all__ = ["TIMED_STEPS", "PlacementAdvisor", "timed_for_advice"]

logger = logging.getLogger("asyncvec.vector")

#: Each env's first steps timed before advising.
TIMED_STEPS = 32
#: ... or, for slow envs, at least this many steps each once the caller has waited this long.
MIN_STEPS, ENOUGH_WAIT_S = 4, 0.5
#: Warm-up steps per env not counted in the caller's time, nor timed in the workers (page faults, caches), or
#: fewer once the caller has waited WARMUP_S (each worker stops its warm-up alike: worker.TIMING_WARMUP_S).
WARMUP_STEPS, WARMUP_S = TIMING_WARMUP_STEPS, TIMING_WARMUP_S
#: A worker that takes longer to answer "timings" is killed (its faults then apply).
ANSWER_TIMEOUT_S = 60.0


Method = TypeVar("Method", bound=Callable[..., Any])


def timed_for_advice(steps: Callable[[Any, Any], int]) -> Callable[[Method], Method]:
    """Decorates a vector env method (``step_async``, ``step_wait``, ``send``, ``recv``): while its
    envs' first steps are timed, the caller's wait inside it counts (:meth:`PlacementAdvisor.spent`),
    with ``steps(envs, result)`` env steps delivered."""

    def decorate(method: Method) -> Method:
        @functools.wraps(method)
        def timed(envs: Any, *args: Any, **kwargs: Any) -> Any:
            advisor = envs._advisor
            if advisor is None:  # the hot path once the advice is given
                return method(envs, *args, **kwargs)
            started = time.perf_counter()
            result = method(envs, *args, **kwargs)
            if envs._advisor is advisor:  # not released by this very call
                advisor.spent(time.perf_counter() - started, steps(envs, result))
            return result

        return timed  # type: ignore[return-value]  # same signature as the method

    return decorate


class PlacementAdvisor:
    """The timing and advice of one :class:`~asyncvec.vector.AsyncLLMVectorEnv` (module docstring).

    Args:
        envs: the :class:`~asyncvec.vector.AsyncLLMVectorEnv` (typed ``Any``: that module imports this one).
        blockers: why the envs may not run in the calling process, from its settings.
        partial: partial batches are asked for (``batch_size < num_envs``): shared workers are not advised.
        cores: cores the envs may use.
    """

    def __init__(self, envs: Any, blockers: list[str], partial: bool, cores: int) -> None:
        self.envs = envs
        self.blockers = list(blockers)
        self.cores = cores
        self.partial = partial
        self._main_thread = threading.main_thread().ident
        self.warm = False  # the warm-up is over (WARMUP_STEPS per env, or WARMUP_S waited)
        self.warmup_steps, self.warmup_s = 0, 0.0
        self.waited_s = 0.0  # caller's seconds inside step/send/recv, after the warm-up
        self.steps = 0  # env steps delivered after the warm-up

    def block(self, reason: str, partial: bool = False) -> None:
        """A use that rules out the calling process (and, ``partial``, shared workers) from the advice."""
        if reason not in self.blockers:
            self.blockers.append(reason)
        self.partial = self.partial or partial

    def before_send(self, ids: Sequence[int]) -> None:
        """``step_async``/``send``/``send_reset`` of ``ids``: notes partial use and other threads; once
        the first steps are timed and nothing is in flight, advises."""
        if threading.get_ident() != self._main_thread:
            self.block("steps come from a thread other than the main one (envs here would take its GIL)")
        if len(ids) < self.envs.num_envs:
            self.block(f"a partial send ({len(ids)} of {self.envs.num_envs} envs)", partial=True)
        if self._window_done() and not any(self.envs._dispatch.queues):
            self.advise()

    def spent(self, seconds: float, steps: int) -> None:
        """The caller waited ``seconds`` inside a call that delivered ``steps`` env steps."""
        if not self.warm:
            self.warmup_steps += steps
            self.warmup_s += seconds
            self.warm = self.warmup_steps >= WARMUP_STEPS * self.envs.num_envs or self.warmup_s >= WARMUP_S
            return
        self.steps += steps
        self.waited_s += seconds

    def _window_done(self) -> bool:
        per_env = self.steps / self.envs.num_envs
        return per_env >= TIMED_STEPS or (per_env >= MIN_STEPS and self.waited_s >= ENOUGH_WAIT_S)

    def advise(self) -> None:
        """Reads the workers' timings and puts the advice in ``envs.placement`` (module docstring); the
        vector env stops calling here."""
        envs = self.envs
        envs._advisor = None
        placement = envs.placement
        measured_s = self.waited_s / max(self.steps, 1) * envs.num_envs
        try:
            timings = _ask_all(envs._transport, placement.groups, "timings")
        except RuntimeError as exc:
            logger.info("AsyncLLMVectorEnv(num_envs=%d): no placement advice: %s", envs.num_envs, exc)
            return
        if not any(timings):
            return
        profiles = _profiles(timings)
        ideal = predicted_step_s(placement.groups, profiles, self.cores, 0.0)
        advice, advised = advice_line(
            profiles,
            overhead_s=max(0.0, measured_s - ideal) / len(placement.groups),
            cores=self.cores,
            measured_s=measured_s,
            current=placement.groups,
            blockers=self.blockers,
            may_share_workers=not self.partial,
        )
        envs.placement = replace(placement, profiles=profiles, advice=advice, advised=advised)
        logger.info("AsyncLLMVectorEnv(num_envs=%d) placement advice: %s", envs.num_envs, advice)


def _profiles(timings: list[Any]) -> tuple[StepProfile, ...]:
    """One profile per env from its timed steps; an env never stepped costs the median of the others."""
    measured = {
        i: StepProfile.from_timings([w for w, _, _ in t], [c for _, c, _ in t], ready_waits=[r for _, _, r in t])
        for i, t in enumerate(timings)
        if t
    }
    typical = StepProfile(
        statistics.median(p.step_s for p in measured.values()),
        statistics.median(p.cpu_share for p in measured.values()),
    )
    return tuple(measured.get(i, typical) for i in range(len(timings)))


def _ask_all(transport: Transport, groups: Sequence[Sequence[int]], command: str) -> list[Any]:
    """Sends ``command`` to every env, straight through the transport (nothing else is in flight),
    and returns one answer per env id. Raises :class:`PlacementError` naming the env whose answer failed."""
    answers: list[Any] = [None] * sum(map(len, groups))
    for worker, group in enumerate(groups):
        transport.send(worker, [(position, command, None) for position in range(len(group))])
    waiting = set(range(len(groups)))
    failures: list[str] = []  # raised once every worker answered: an unread answer would reach the next message
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while waiting:
        if time.monotonic() > deadline:  # its answer would reach the next message: the worker must go
            for worker in waiting:
                transport.kill(worker)
            raise PlacementError(f"workers {sorted(waiting)} did not answer {command!r} within {ANSWER_TIMEOUT_S} s")
        for worker in transport.wait(sorted(waiting), 1.0):
            waiting.discard(worker)
            ok, payload = transport.read(worker)
            if not ok:
                failures.append(f"the worker of envs {list(groups[worker])} failed: {describe_failure(payload)}")
                continue
            for index, result in zip(groups[worker], payload):
                if isinstance(result, EnvFailure):
                    failures.append(f"env {index}: {describe_failure(result.payload)}")
                answers[index] = result
    if failures:
        raise PlacementError(failures[0] + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""))
    return answers
