"""The vector env's view of each sub-environment: one :class:`Slot` per env, shared by the
dispatcher (what was sent and answered) and the fault handling (restarts, seeds, episode state).

A slot's state is two enums, one per question, because the answers are independent (an env
can be asked a method call in any episode state): :class:`SlotState`, what the env was asked and
whether its answer is in (Gymnasium's ``AsyncState``, per env), and :class:`Episode`, where its
episode stands, including what a rebuild left it owing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ANSWERED", "ENV_WORK", "Episode", "OWES_RESTART_STEP", "Slot", "SlotState"]


class SlotState(enum.Enum):
    """What the user asked of an env that ``recv`` (or the lockstep wait) has not returned yet."""

    IDLE = "idle"  # nothing asked, or its answer was delivered
    WAITING_STEP = "step"
    WAITING_RESET = "reset"
    WAITING_CALL = "call"  # a method call, attribute read or write, or space check (its command in ``Slot.call``)
    STEP_READY = "step answered"  # the answer is in ``Slot.result``, not yet delivered
    RESET_READY = "reset answered"
    CALL_READY = "call answered"


ANSWERED = (SlotState.STEP_READY, SlotState.RESET_READY, SlotState.CALL_READY)
#: a step or reset, asked or answered: work that runs the env forward (it times out, fails over and restarts)
ENV_WORK = (SlotState.WAITING_STEP, SlotState.WAITING_RESET, SlotState.STEP_READY, SlotState.RESET_READY)


class Episode(enum.Enum):
    """Where an env's episode stands, as its answers showed (and what a rebuild of its env left it owing)."""

    NONE = "none"  # never reset
    LIVE = "live"
    ENDED = "ended"  # its last step ended it (it owes an autoreset under NEXT_STEP)
    LOST = "lost"  # its env was rebuilt mid-episode: its next step reports that episode truncated
    ENDED_REBUILT = "ended, rebuilt"  # ended under NEXT_STEP, then rebuilt: its next step is the owed autoreset


#: the episode states in which an env's next step is a restart item (a truncation or the owed autoreset)
OWES_RESTART_STEP = (Episode.LOST, Episode.ENDED_REBUILT)


@dataclass(slots=True)  # slots: its fields are read and written per env on every step
class Slot:
    """The vector env's view of one sub-environment."""

    worker: int
    position: int  # index among its worker's envs
    state: SlotState = SlotState.IDLE
    call: str = ""  # WAITING_CALL / CALL_READY: the command ("call", "setattr", "check_spaces", "spaces")
    payload: Any = None  # kept to repeat a reset after a restart
    result: Any = None  # the answer (STEP_READY, RESET_READY, CALL_READY), not yet delivered
    info_extra: dict[Any, Any] = field(default_factory=dict)
    restarts: int = 0
    seed: int | None = None  # the last seed the caller gave this env's reset
    reseed: int | None = None  # a rebuilt env's restart_seed, until a message hands it to the worker
    episode: Episode = Episode.NONE
    restart_reason: str = ""  # Episode.LOST: why its env was rebuilt (its truncated step's info says so)

    @property
    def command(self) -> str | None:
        """What the env was asked (``"step"``, ``"reset"``, or the call's command), as errors and
        :class:`~asyncvec.vector.faults.Fault` name it; ``None`` while idle."""
        state = self.state
        if state is SlotState.IDLE:
            return None
        if state is SlotState.WAITING_STEP or state is SlotState.STEP_READY:
            return "step"
        if state is SlotState.WAITING_RESET or state is SlotState.RESET_READY:
            return "reset"
        return self.call
