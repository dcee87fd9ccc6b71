"""The vector env's view of each sub-environment: one :class:`Slot` per env, shared by the
dispatcher (what was sent and answered) and the fault handling (restarts, seeds, episode state)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NO_RESULT", "Episode", "Slot"]

NO_RESULT = object()  # a worker's answer can be None, so "no answer yet" needs its own marker


class Episode(enum.Enum):
    """Where an env's episode stands, as its answers showed."""

    NONE = "none"  # never reset
    LIVE = "live"
    ENDED = "ended"  # its last step ended it (it owes an autoreset under NEXT_STEP)


@dataclass
class Slot:
    """The vector env's view of one sub-environment."""

    worker: int
    position: int  # index among its worker's envs
    command: str | None = None  # what the user asked of it and ``recv`` has not returned yet
    payload: Any = None  # kept to repeat a reset after a restart
    result: Any = NO_RESULT  # answer received, not yet delivered
    info_extra: dict[Any, Any] = field(default_factory=dict)
    restarts: int = 0
    seed: int | None = None  # the last seed the caller gave this env's reset
    reseed: int | None = None  # a rebuilt env's restart_seed, until a message hands it to the worker
    episode: Episode = Episode.NONE
    after_restart: tuple[str, str] | None = None  # ("truncate" | "autoreset", reason): its next step after a rebuild
