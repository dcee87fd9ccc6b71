"""Placement from the user's own steps: time the first steps where the envs run, then move them if it pays.

With ``placement="auto"`` (the default) and no ``envs_per_worker``/``in_process=True``, the envs
start one per worker process. Their workers time the first :data:`TIMED_STEPS` steps of each env
(the user's own actions: nothing is stepped that the user did not send), and the vector env
times how long its caller waits inside ``step``/``send``/``recv``. At the first moment after that
when no message is in flight, :func:`~asyncvec.vector.placement.choose_placement` decides; if it
says so the envs **move, with their whole state**: each worker pickles its envs (cloudpickle: the
env object, its autoreset flag, its pending restart seed), new workers (or the calling process)
unpickle them, and the old copies are dropped without ``close()``. Episodes, random generators
and observations continue exactly (the equivalence tests against gymnasium run through moves).

Gymnasium's EzPickle envs (MuJoCo, Box2D) move by their attributes (``worker.dumps_env_state``: EzPickle
itself would rebuild a fresh env). An env that cannot be pickled (a socket, a thread, a window, Box2D's
bodies) stays where it is; so do envs whose pickling follows rules of their own (``worker.custom_pickling``;
``metadata["asyncvec_relocate"] = True`` declares that it keeps the state),
envs whose state pickles to more than ``worker.MAX_MOVED_STATE_BYTES`` (64 MiB) and one that declares
``metadata["asyncvec_relocate"] = False``. At most :data:`MAX_MOVES` moves, the second
only to confirm or undo the first with a new measurement. Once the envs run in the calling
process, a use that forbids it (a partial ``send`` or ``recv``, a step from another thread, a
``max_restarts`` or ``step_timeout`` set later) moves them back to one worker each before it runs.
``envs.placement`` says where they are and why; the ``asyncvec.vector`` logger says it at INFO.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from asyncvec.vector.placement import (
    Placement,
    StepProfile,
    choose_placement,
    describe_failure,
    given_placement,
    predicted_step_s,
)
from asyncvec.vector.transport import InProcessBackend, ProcessBackend, Transport, WorkerSpec
from asyncvec.vector.worker import EnvFailure

__all__ = ["MAX_MOVES", "TIMED_STEPS", "Relocator", "timed_for_placement"]

logger = logging.getLogger("asyncvec.vector")

#: Each env's first steps timed before deciding.
TIMED_STEPS = 32
#: ... or, for slow envs, at least this many steps each once the caller has waited this long.
MIN_STEPS, ENOUGH_WAIT_S = 4, 0.5
#: Warm-up steps per env not counted in the caller's time (first touches of memory, caches).
WARMUP_STEPS = 2
MAX_MOVES = 2
#: A worker that takes longer to answer "timings", "export" or "detach" is killed (its faults then apply).
ANSWER_TIMEOUT_S = 60.0


Method = TypeVar("Method", bound=Callable[..., Any])


def timed_for_placement(steps: Callable[[Any, Any], int]) -> Callable[[Method], Method]:
    """Decorates a vector env method (``step_async``, ``step_wait``, ``send``, ``recv``): while its
    envs' first steps are timed, the caller's wait inside it counts (:meth:`Relocator.spent`), with
    ``steps(envs, result)`` env steps delivered."""

    def decorate(method: Method) -> Method:
        @functools.wraps(method)
        def timed(envs: Any, *args: Any, **kwargs: Any) -> Any:
            relocator = envs._relocator
            if relocator is None or relocator.moves_left <= 0:  # the hot path once the envs are placed
                return method(envs, *args, **kwargs)
            started = time.perf_counter()
            result = method(envs, *args, **kwargs)
            if envs._relocator is relocator:  # not released by this very call
                relocator.spent(time.perf_counter() - started, steps(envs, result))
            return result

        return timed  # type: ignore[return-value]  # same signature as the method

    return decorate


class Relocator:
    """The measuring and moving of one :class:`~asyncvec.vector.AsyncLLMVectorEnv` (module docstring).

    Args:
        envs: the :class:`~asyncvec.vector.AsyncLLMVectorEnv` (its dispatcher, transport and shared memory
            move together; typed ``Any``: that module imports this one).
        blockers: why the envs may not run in the calling process, from its settings.
        partial: partial batches are asked for (``batch_size < num_envs``): each env keeps its worker.
        cores: cores the envs may use.
    """

    def __init__(self, envs: Any, blockers: list[str], partial: bool, cores: int) -> None:
        self.envs = envs
        self.blockers = list(blockers)
        self.cores = cores
        self.partial = partial  # partial batches: one env per worker, nothing shared
        self.moves_left = MAX_MOVES
        self._main_thread = threading.main_thread().ident
        self.relocated = False  # the envs moved at least once (into the calling process: moved back when forbidden)
        self.history: list[tuple[tuple[tuple[int, ...], ...], float]] = []  # (groups, measured vector-step s)
        self._restart_window()

    @property
    def active(self) -> bool:
        """Still timing the envs' first steps (a decision is to come)."""
        return self.moves_left > 0

    def _restart_window(self) -> None:
        self.waited_s = 0.0  # caller's seconds inside step/send/recv, after the warm-up
        self.steps = 0  # env steps delivered

    # ------------------------------------------------------------------ what the vector env reports

    def block(self, reason: str, partial: bool = False) -> None:
        """A use that forbids the calling process (and, ``partial``, shared workers); envs already
        in the calling process move to one worker each now (nothing is in flight there)."""
        if reason not in self.blockers:
            self.blockers.append(reason)
        self.partial = self.partial or partial
        if self.envs.placement.in_process and self.relocated and not self.envs._dispatch.recv_waiting:
            self._move(
                given_placement(self.envs.num_envs, 1, f"one env per worker: {reason}", measuring=False), final=True
            )
            if self.envs.placement.in_process:  # the envs could not be copied out (their state no longer pickles)
                logger.warning(
                    "AsyncLLMVectorEnv(num_envs=%d): %s, but its envs stay in this process: %s",
                    self.envs.num_envs,
                    reason,
                    self.envs.placement.reason,
                )

    def before_send(self, ids: Sequence[int]) -> None:
        """``step_async``/``send``/``send_reset`` of ``ids``: notes partial use and other threads;
        when the envs are all idle and the first steps are timed, decides (and maybe moves)."""
        if threading.get_ident() != self._main_thread:
            self.block("steps come from a thread other than the main one (envs here would take its GIL)")
        if len(ids) < self.envs.num_envs:
            self.block(f"a partial send ({len(ids)} of {self.envs.num_envs} envs)", partial=True)
        if self.active and self._window_done() and not any(self.envs._dispatch.queues):
            self.decide()

    def spent(self, seconds: float, steps: int) -> None:
        """The caller waited ``seconds`` inside a call that delivered ``steps`` env steps."""
        self.steps += steps
        if self.steps > WARMUP_STEPS * self.envs.num_envs:
            self.waited_s += seconds

    def _window_done(self) -> bool:
        per_env = self.steps / self.envs.num_envs
        return per_env >= TIMED_STEPS or (per_env >= MIN_STEPS + WARMUP_STEPS and self.waited_s >= ENOUGH_WAIT_S)

    # ------------------------------------------------------------------ deciding and moving

    def decide(self) -> None:
        """Applies the rule to the timed steps; moves the envs if it says so (module docstring)."""
        envs = self.envs
        current = envs.placement.groups
        counted = self.steps - WARMUP_STEPS * envs.num_envs
        measured_s = self.waited_s / max(counted, 1) * envs.num_envs
        try:
            timings = _ask_all(envs._transport, current, "timings")
        except RuntimeError as exc:
            self._stop(f"stays: the timings could not be read ({exc})")
            return
        if not any(timings):
            self._stop("stays: no step was timed")
            return
        profiles = _profiles(timings)
        ideal = predicted_step_s(current, profiles, self.cores, 0.0)
        overhead_s = max(0.0, measured_s - ideal) / len(current)
        self.history.append((current, measured_s))
        if len(self.history) > 1 and self.history[-2][1] < measured_s:  # the first move did not pay: both measured
            groups, before_s = self.history[-2]
            choice = Placement(
                False,
                groups,
                f"back: measured {before_s * 1e6:,.0f} us a vector step there, {measured_s * 1e6:,.0f} us after "
                f"moving; {'; '.join(self.blockers) or 'in this process was not predicted faster'}",
                profiles,
            )
        else:
            choice = choose_placement(
                profiles,
                overhead_s=overhead_s,
                cores=self.cores,
                measured_s=measured_s,
                current=current,
                blockers=self.blockers,
                may_share_workers=not self.partial,
            )
        if choice.in_process == envs.placement.in_process and choice.groups == current:
            self._stop(choice.reason, choice.profiles)
            return
        self._move(choice, final=choice.in_process or self.moves_left <= 1)

    def _where_now(self) -> str:
        """Where the envs are, for a reason that says they stay (the first placement's own reason speaks of a
        timing that is over by then)."""
        placement = self.envs.placement
        return (
            f"{placement.num_workers} worker(s) x {placement.envs_per_worker} env(s)"
            if placement.measuring
            else placement.reason
        )

    def _stop(self, reason: str, profiles: tuple[StepProfile, ...] | None = None) -> None:
        self.moves_left = 0
        placement = self.envs.placement
        self.envs.placement = Placement(placement.in_process, placement.groups, reason, profiles or placement.profiles)
        logger.info("AsyncLLMVectorEnv(num_envs=%d) keeps its envs %s", self.envs.num_envs, self.envs.placement)
        self._release()

    def _release(self) -> None:
        """Once nothing can move any more (the envs stay in workers), the vector env stops calling here."""
        if not self.active and not self.envs.placement.in_process:
            self.envs._relocator = None

    def _move(self, placement: Placement, final: bool) -> None:
        """Moves every env, with its state, to ``placement``; on any failure the envs stay as they are."""
        envs = self.envs
        dispatch = envs._dispatch
        if envs.placement.in_process:
            dispatch.poll_ready()  # in this process every answer is there already: file them first
        if any(dispatch.queues) or dispatch.has_outbox:  # an answer still to come would go to the old workers
            return
        old_transport, old_groups = envs._transport, envs.placement.groups
        try:
            states = _ask_all(old_transport, old_groups, "export")
        except RuntimeError as exc:
            self._stop(f"stays: the envs cannot move between processes ({exc}); {self._where_now()}")
            return
        measuring = not final and self.moves_left > 1
        action_memory = None if placement.in_process else envs._action_memory
        spec = WorkerSpec(
            envs.env_fns,
            [list(g) for g in placement.groups],
            envs.autoreset_mode,
            envs._shm,
            action_memory,
            states,
            TIMED_STEPS if measuring else 0,
        )
        backend = InProcessBackend() if placement.in_process else ProcessBackend(envs.context, envs.daemon)
        transport = backend.create(spec)
        for worker in range(len(placement.groups)):
            ok, payload = transport.await_ready(worker, envs.start_timeout)
            if not ok:
                transport.close(0.0, terminate=True)
                self._stop(f"stays: the moved envs could not start ({describe_failure(payload)}); {self._where_now()}")
                return
        try:
            _ask_all(old_transport, old_groups, "detach")
        finally:
            old_transport.close(timeout=1.0, terminate=False)
        # the envs now run in the new transport's workers; each env's bookkeeping stays in the dispatcher
        envs._dispatch.rehost(
            transport, [list(g) for g in spec.groups], None if placement.in_process else envs._action_rows
        )
        envs._transport, envs.backend, envs.envs_per_worker = transport, backend, placement.envs_per_worker
        envs.placement = Placement(
            placement.in_process, placement.groups, placement.reason, placement.profiles, measuring
        )
        envs._in_process_steps = None
        self.moves_left = self.moves_left - 1 if measuring else 0
        self.relocated = True
        self._restart_window()
        self._release()
        logger.info("AsyncLLMVectorEnv(num_envs=%d) moved its envs %s", envs.num_envs, envs.placement)


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
    and returns one answer per env id. Raises ``RuntimeError`` naming the env whose answer failed."""
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
            raise RuntimeError(f"workers {sorted(waiting)} did not answer {command!r} within {ANSWER_TIMEOUT_S} s")
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
        raise RuntimeError(failures[0] + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""))
    return answers
