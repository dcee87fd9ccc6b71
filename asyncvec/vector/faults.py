"""What the vector env does when an env raises, a worker dies, or a step hangs: restart or give up.

This module decides; :class:`~asyncvec.vector.dispatch.Dispatcher` does what it decides
(:class:`Restart`). Whether a fault is restarted at all is the :class:`FaultPolicy`'s call
(``fault_policy=`` of the vector env); the default, :class:`MaxRestarts`, is ``max_restarts``.

With ``max_restarts > 0`` a failed env is rebuilt in place: the step or reset it lost is repeated
on the rebuilt env as a ``"restart"`` item (its episode comes back truncated with
``info["env_restarted"] = True``, or its reset is done again), and every other env keeps
running. When a worker hosting several envs dies, all its envs are rebuilt; those not in
flight then owe their next step a truncation (or NEXT_STEP's autoreset). Past ``max_restarts``,
or when a method call rather than a step was lost, the vector env closes and raises
:class:`~asyncvec.vector.errors.WorkerError`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
from gymnasium.vector.vector_env import AutoresetMode

from asyncvec.vector.errors import WorkerError, error_from_payload
from asyncvec.vector.observations import ObservationBuffers
from asyncvec.vector.slots import ENV_WORK, OWES_RESTART_STEP, Episode, Slot, SlotState

__all__ = [
    "Fault",
    "FaultKind",
    "FaultPolicy",
    "Faults",
    "MaxRestarts",
    "Restart",
    "check_fault_settings",
    "describe_policy",
    "restart_seed",
]


def check_fault_settings(
    step_timeout: float | None, max_restarts: int, in_process: bool | None, fault_policy: object = None
) -> None:
    """Refuses fault settings that are out of range or cannot be enforced (at construction and when set later).

    Example:
        >>> check_fault_settings(1.0, 0, in_process=True)
        Traceback (most recent call last):
        ...
        ValueError: envs stepped in this process (in_process=True, or chosen by placement for a cheap env) cannot enforce step_timeout: a step there cannot be interrupted; build the env with in_process=False
    """
    if step_timeout is not None and step_timeout <= 0:
        raise ValueError(f"step_timeout must be positive seconds or None, got {step_timeout}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    if fault_policy is not None and not isinstance(fault_policy, FaultPolicy):
        raise TypeError(f"fault_policy must have a restart(fault) -> bool method, got {type(fault_policy).__name__}")
    if fault_policy is not None and max_restarts:
        raise ValueError(f"give max_restarts={max_restarts} or fault_policy, not both (the policy decides)")
    if in_process and step_timeout is not None:
        raise ValueError(
            "envs stepped in this process (in_process=True, or chosen by placement for a cheap env) cannot enforce "
            "step_timeout: a step there cannot be interrupted; build the env with in_process=False"
        )


def restart_seed(seed: int, restarts: int) -> int:
    """The seed of an env rebuilt for the ``restarts``-th time, whose last reset had ``seed``.

    A rebuilt env starts with a fresh random generator; its next reset that has no seed of its
    own (the autoreset after the truncated episode, or a ``reset()`` without a seed) uses this
    seed, so a run with restarts is reproducible. It is the first 32-bit word of
    ``numpy.random.SeedSequence(seed, spawn_key=(restarts,))``: distinct for every restart and
    unrelated to the seeds ``seed + i`` of the other envs.

    Example:
        >>> restart_seed(0, 1) == restart_seed(0, 1) != restart_seed(0, 2)
        True
    """
    return int(np.random.SeedSequence(int(seed), spawn_key=(int(restarts),)).generate_state(1, np.uint32)[0])


class FaultKind(enum.Enum):
    """What went wrong."""

    ENV_RAISED = "env raised"  # an env's step or reset raised; its worker is fine
    WORKER_DIED = "worker died"  # the worker process (or Ray actor) died: all its envs are lost
    STEP_TIMEOUT = "step timeout"  # a step or reset ran past step_timeout: its worker was killed


@dataclass(frozen=True)
class Fault:
    """One fault, as a :class:`FaultPolicy` sees it.

    Attributes:
        env: the env that failed (a worker's death or hang: the env it was running).
        kind: what went wrong.
        command: what that env was doing (``"step"`` or ``"reset"``).
        error: the error's type name and message (``("StepTimeout", "no answer within ...")`` for a hang).
        restarts: how many times ``env`` was rebuilt before this fault.
        envs: every env a restart rebuilds (a worker fault: all envs of that worker).
    """

    env: int
    kind: FaultKind
    command: str | None
    error: tuple[str, str]
    restarts: int
    envs: tuple[int, ...]


@runtime_checkable
class FaultPolicy(Protocol):
    """Decides whether the vector env rebuilds the envs a fault lost (``True``) or closes and raises
    :class:`~asyncvec.vector.errors.WorkerError` (``False``). It is asked only for a lost step or
    reset (a lost method call always raises) and runs in the thread that waits for the envs.

    Example (restart envs that raised, never a hang):
        >>> class NoHangs:
        ...     def restart(self, fault: Fault) -> bool:
        ...         return fault.kind is not FaultKind.STEP_TIMEOUT and fault.restarts < 3
        >>> isinstance(NoHangs(), FaultPolicy)
        True
    """

    def restart(self, fault: Fault) -> bool: ...


@dataclass(frozen=True)
class MaxRestarts:
    """The default :class:`FaultPolicy`: each env may be rebuilt ``max_restarts`` times.

    Example:
        >>> fault = Fault(0, FaultKind.ENV_RAISED, "step", ("ValueError", "boom"), restarts=1, envs=(0,))
        >>> MaxRestarts(1).restart(fault), MaxRestarts(2).restart(fault)
        (False, True)
    """

    max_restarts: int = 0

    def restart(self, fault: Fault) -> bool:
        return fault.restarts < self.max_restarts


def describe_policy(policy: FaultPolicy) -> str:
    """``max_restarts=N`` for the default policy, else ``fault_policy=<its repr>``."""
    return f"max_restarts={policy.max_restarts}" if isinstance(policy, MaxRestarts) else f"fault_policy={policy!r}"


@dataclass(frozen=True)
class Restart:
    """What a fault restarts (the dispatcher does it): ``worker`` (``None``: an env that raised,
    rebuilt in place by its worker), then a ``"restart"`` item per env in ``items``."""

    worker: int | None
    items: tuple[tuple[int, dict[str, Any]], ...]


class Faults:
    """The fault handling of one dispatcher's envs (see the module docstring): keeps the envs'
    restart bookkeeping in their slots and says, per fault, what to restart or which error to raise.

    Args:
        slots: the envs' slots (shared with the dispatcher).
        observations: each env's last observation (a truncated episode's final one).
        policy: decides whether to restart.
        autoreset_mode: the vector env's autoreset mode (what an env whose episode had ended owes).
    """

    def __init__(
        self, slots: list[Slot], observations: ObservationBuffers, policy: FaultPolicy, autoreset_mode: AutoresetMode
    ) -> None:
        self.slots = slots
        self.observations = observations
        self.policy = policy
        self.autoreset_mode = autoreset_mode
        self.rebuilds = 0  # env rebuilds so far: until one, no env owes a truncation or a restart's info

    def reset_payload(self, index: int, payload: dict[str, Any]) -> dict[str, Any]:
        """A reset with a seed makes it the env's seed; one without takes a rebuilt env's restart seed."""
        slot = self.slots[index]
        if payload["seed"] is not None:
            slot.seed, slot.reseed = payload["seed"], None
        elif slot.reseed is not None:
            payload, slot.reseed = {**payload, "seed": slot.reseed}, None
        return payload

    def owed_step(self, index: int) -> dict[str, Any]:
        """The ``"restart"`` payload that replaces a step of an env whose worker was rebuilt while it
        waited: that step ends the lost episode instead (or, if that episode had ended, is the reset
        step NEXT_STEP owes it)."""
        slot = self.slots[index]
        assert slot.episode in OWES_RESTART_STEP  # only an env that owes one
        lost = slot.episode is Episode.LOST
        if lost:
            slot.info_extra = {"env_restarted": True, "restart_reason": slot.restart_reason}
        then = "truncate" if lost else "autoreset"
        payload = {"rebuild": False, "then": then, "arg": self.observations.single(index), "seed": slot.reseed}
        slot.reseed = None
        self.drop_owed_step(index)
        return payload

    def drop_owed_step(self, index: int) -> None:
        """Env ``index`` no longer owes a restart's step (it was sent, or a reset replaces it): its
        episode stands as before the rebuild, live or ended, as far as a later fault is concerned."""
        slot = self.slots[index]
        slot.episode = Episode.LIVE if slot.episode is Episode.LOST else Episode.ENDED
        slot.restart_reason = ""

    def _rebuilt(self, index: int) -> None:
        """Counts a rebuild of env ``index`` and derives the seed of its next reset (:func:`restart_seed`)."""
        slot = self.slots[index]
        slot.restarts += 1
        self.rebuilds += 1
        slot.reseed = None if slot.seed is None else restart_seed(slot.seed, slot.restarts)

    def _restart_item(self, index: int, rebuild: bool, reason: str) -> dict[str, Any]:
        """How an env whose step or reset was lost to a fault starts again on its rebuilt env."""
        slot = self.slots[index]
        slot.info_extra = {"env_restarted": True, "restart_reason": reason}
        if slot.state is SlotState.WAITING_RESET:
            return {"rebuild": rebuild, "then": "reset", "arg": self.reset_payload(index, slot.payload)}
        ended = slot.episode is Episode.ENDED and self.autoreset_mode == AutoresetMode.NEXT_STEP
        seed, slot.reseed = slot.reseed, None
        return {
            "rebuild": rebuild,
            "then": "autoreset" if ended else "truncate",
            "arg": self.observations.single(index),
            "seed": seed,
        }

    def _error(self, index: int, command: str | None, payload: Any, note: str = "") -> WorkerError:
        slot = self.slots[index]
        error = error_from_payload(index, command, payload)
        if slot.restarts:
            note += f"\n(after {slot.restarts} restart(s); {describe_policy(self.policy)})"
        if note:
            error.args = (f"{error.args[0]}{note}",)
        return error

    def _fault(self, index: int, kind: FaultKind, payload: Any, envs: Sequence[int]) -> Fault:
        slot = self.slots[index]
        return Fault(index, kind, slot.command, (str(payload[0]), str(payload[1])), slot.restarts, tuple(envs))

    def env_failed(self, index: int, payload: Any) -> Restart | WorkerError:
        """An env raised in a step or reset; its worker is fine: its rebuild in place, or the error to raise."""
        slot = self.slots[index]
        if not self.policy.restart(self._fault(index, FaultKind.ENV_RAISED, payload, [index])):
            return self._error(index, slot.command, payload)
        self._rebuilt(index)
        return Restart(None, ((index, self._restart_item(index, True, f"{payload[0]}: {payload[1]}")),))

    def worker_failed(
        self, worker: int, group: Sequence[int], lost: Sequence[int], culprit: int | None, payload: Any
    ) -> Restart | WorkerError:
        """A worker hosting ``group`` died or hung while ``lost`` waited for it: its restart with all
        its envs rebuilt, or the error to raise."""
        if culprit is None or culprit not in lost:
            culprit = lost[0]
        note = ""
        if len(group) > 1:
            note = f"\n(its worker also hosted envs {[i for i in group if i != culprit]}, rebuilt with it)"
        command = self.slots[culprit].command
        kind = FaultKind.STEP_TIMEOUT if payload[0] == "StepTimeout" else FaultKind.WORKER_DIED
        if any(self.slots[i].state not in ENV_WORK for i in lost) or not self.policy.restart(
            self._fault(culprit, kind, payload, group)
        ):
            return self._error(culprit, command, payload, note)
        reason = f"{payload[0]}: {payload[1]}"
        items = []
        for index in group:
            slot = self.slots[index]
            self._rebuilt(index)
            if index in lost:
                items.append((index, self._restart_item(index, False, reason)))
            elif slot.episode is Episode.LIVE or slot.episode is Episode.LOST:  # LOST: rebuilt again, the newer reason
                slot.episode, slot.restart_reason = Episode.LOST, reason
            elif slot.episode is Episode.ENDED and self.autoreset_mode == AutoresetMode.NEXT_STEP:
                slot.episode = Episode.ENDED_REBUILT
        return Restart(worker, tuple(items))
