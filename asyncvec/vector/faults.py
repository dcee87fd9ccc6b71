"""What the vector env does when an env raises, a worker dies, or a step hangs: restart or give up.

With ``max_restarts > 0`` a failed env is rebuilt in place: the step or reset it lost is repeated
on the rebuilt env as a ``"restart"`` item (its episode comes back truncated with
``info["env_restarted"] = True``, or its reset is done again), and every other env keeps
running. When a worker hosting several envs dies, all its envs are rebuilt; those not in
flight then owe their next step a truncation (or NEXT_STEP's autoreset). Past ``max_restarts``,
or when a method call rather than a step was lost, the vector env closes and raises
:class:`~asyncvec.vector.errors.WorkerError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
from gymnasium.vector.vector_env import AutoresetMode

from asyncvec.vector.errors import WorkerError, error_from_payload

if TYPE_CHECKING:
    from asyncvec.vector.dispatch import Dispatcher

__all__ = ["ENV_COMMANDS", "Restarts", "check_fault_settings", "restart_seed"]

ENV_COMMANDS = ("step", "reset")  # commands that run an env forward: they time out, fail over and restart


def check_fault_settings(step_timeout: float | None, max_restarts: int, in_process: bool | None) -> None:
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


class Restarts:
    """The fault handling of one :class:`~asyncvec.vector.dispatch.Dispatcher` (see the module docstring).

    Args:
        dispatch: the dispatcher whose envs and workers this handles.
        max_restarts: how many times each env may be rebuilt.
        autoreset_mode: the vector env's autoreset mode (what an env whose episode had ended owes).
    """

    def __init__(self, dispatch: Dispatcher, max_restarts: int, autoreset_mode: AutoresetMode) -> None:
        self.dispatch = dispatch
        self.max_restarts = max_restarts
        self.autoreset_mode = autoreset_mode
        self.rebuilds = 0  # env rebuilds so far: until one, no env owes a truncation or a restart's info

    def reset_payload(self, index: int, payload: dict[str, Any]) -> dict[str, Any]:
        """A reset with a seed makes it the env's seed; one without takes a rebuilt env's restart seed."""
        slot = self.dispatch.slots[index]
        if payload["seed"] is not None:
            slot.seed, slot.reseed = payload["seed"], None
        elif slot.reseed is not None:
            payload, slot.reseed = {**payload, "seed": slot.reseed}, None
        return payload

    def owed_step(self, index: int) -> dict[str, Any]:
        """The ``"restart"`` payload that replaces a step of an env whose worker was rebuilt while it
        waited: that step ends the lost episode instead (or, if that episode had ended, is the reset
        step NEXT_STEP owes it)."""
        slot = self.dispatch.slots[index]
        assert slot.after_restart is not None  # only an env that owes one
        then, reason = slot.after_restart
        if then == "truncate":
            slot.info_extra = {"env_restarted": True, "restart_reason": reason}
        payload = {"rebuild": False, "then": then, "arg": self.dispatch.observations.single(index), "seed": slot.reseed}
        slot.after_restart, slot.reseed = None, None
        return payload

    def _rebuilt(self, index: int) -> None:
        """Counts a rebuild of env ``index`` and derives the seed of its next reset (:func:`restart_seed`)."""
        slot = self.dispatch.slots[index]
        slot.restarts += 1
        self.rebuilds += 1
        slot.reseed = None if slot.seed is None else restart_seed(slot.seed, slot.restarts)

    def _restart_item(self, index: int) -> dict[str, Any]:
        """How an env whose step or reset was lost to a fault starts again on its rebuilt env."""
        slot = self.dispatch.slots[index]
        if slot.command == "reset":
            return {"then": "reset", "arg": self.reset_payload(index, slot.payload)}
        then = "autoreset" if slot.episode == "ended" and self.autoreset_mode == AutoresetMode.NEXT_STEP else "truncate"
        seed, slot.reseed = slot.reseed, None
        return {"then": then, "arg": self.dispatch.observations.single(index), "seed": seed}

    def _give_up(self, index: int, command: str | None, payload: Any, note: str = "") -> NoReturn:
        slot = self.dispatch.slots[index]
        error = error_from_payload(index, command, payload)
        if slot.restarts:
            note += f"\n(after {slot.restarts} restart(s); max_restarts={self.max_restarts})"
        if note:
            error.args = (f"{error.args[0]}{note}",)
        self.dispatch.close_for(str(error).split("\n", 1)[0])
        raise error

    def env_failed(self, index: int, payload: Any) -> None:
        """An env raised in a step or reset; its worker is fine: queues the rebuild of that env in
        place, or closes and raises."""
        slot = self.dispatch.slots[index]
        if slot.restarts >= self.max_restarts:
            self._give_up(index, slot.command, payload)
        self._rebuilt(index)
        slot.info_extra = {"env_restarted": True, "restart_reason": f"{payload[0]}: {payload[1]}"}
        self.dispatch.queue(index, "restart", {"rebuild": True, **self._restart_item(index)})

    def worker_failed(self, worker: int, payload: Any, culprit: int | None = None) -> None:
        """A worker died or hung: rebuild it (all its envs) in place, or close and raise."""
        dispatch = self.dispatch
        slots, transport = dispatch.slots, dispatch.transport
        lost = [i for message in dispatch.queues[worker] for i in message.env_ids]
        dispatch.queues[worker].clear()
        if culprit is None:
            culprit = transport.culprit(worker)
        if culprit is None or culprit not in lost:
            culprit = lost[0]
        group = dispatch.groups[worker]
        note = ""
        if len(group) > 1:
            note = f"\n(its worker also hosted envs {[i for i in group if i != culprit]}, rebuilt with it)"
        command = slots[culprit].command
        if any(slots[i].command not in ENV_COMMANDS for i in lost) or slots[culprit].restarts >= self.max_restarts:
            self._give_up(culprit, command, payload, note)
        try:
            transport.restart(worker)
            dispatch.await_ready(worker)
        except WorkerError as error:
            error.args = (f"{error.args[0]}\n(while restarting its worker after: {payload[0]}: {payload[1]})",)
            dispatch.close_for(str(error).split("\n", 1)[0])
            raise
        except BaseException as exc:
            dispatch.close_for(f"{type(exc).__name__}: {exc}")
            raise
        reason = f"{payload[0]}: {payload[1]}"
        for index in group:
            slot = slots[index]
            self._rebuilt(index)
            if index in lost:
                slot.info_extra = {"env_restarted": True, "restart_reason": reason}
                dispatch.queue(index, "restart", {"rebuild": False, **self._restart_item(index)})
            elif slot.episode == "live":
                slot.after_restart = ("truncate", reason)
            elif slot.episode == "ended" and self.autoreset_mode == AutoresetMode.NEXT_STEP:
                slot.after_restart = ("autoreset", reason)
        dispatch.flush()
