"""Errors raised by the vector env.

Gymnasium's split-phase errors are re-exported so that code catching them keeps working.
"""

from __future__ import annotations

import pickle
from typing import Any

from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError

__all__ = [
    "AlreadyPendingCallError",
    "ClosedEnvironmentError",
    "NoAsyncCallError",
    "PlacementError",
    "SpaceMismatchError",
    "WorkerError",
    "error_from_payload",
]


class WorkerError(RuntimeError):
    """A sub-environment failed: it raised, died, or hung past ``step_timeout``.

    Attributes:
        env_index: index of the sub-environment in the vector env.
        command: what the worker was doing (``"step"``, ``"reset"``, ``"call"``...).
        exc_type: name of the exception type raised in the worker (or ``"WorkerDied"`` /
            ``"StepTimeout"`` when there was no exception to report).
        worker_traceback: the traceback formatted in the worker process, if any.

    The original exception, when it could be pickled back, is chained as ``__cause__``.
    """

    def __init__(self, env_index: int, command: str, exc_type: str, message: str, worker_traceback: str = "") -> None:
        self.env_index = env_index
        self.command = command
        self.exc_type = exc_type
        self.message = message
        self.worker_traceback = worker_traceback
        text = f"env {env_index} failed in {command}(): {exc_type}: {message}"
        if worker_traceback:
            text += f"\n\nTraceback in the worker process of env {env_index}:\n{worker_traceback}"
        super().__init__(text)

    def __reduce__(
        self,
    ) -> tuple[
        type, tuple[int, str, str, str, str]
    ]:  # pickled whole (from an acting process to its learner), not as its text
        return type(self), (self.env_index, self.command, self.exc_type, self.message, self.worker_traceback)


class PlacementError(RuntimeError):
    """Measuring the envs for their placement failed: a ``placement="probe"`` env could not be built,
    raised, hung or cannot be measured (:func:`~asyncvec.vector.placement.profile_env`; the probe then
    falls back to one env per worker), or the workers' step timings for the placement advice could
    not be read (the advice is then skipped)."""


class SpaceMismatchError(RuntimeError):
    """A sub-environment's observation or action space differs from env 0's (``observation_mode="different"``
    accepts observation spaces of the same dtype and shape)."""


def error_from_payload(index: int, command: str | None, payload: Any) -> WorkerError:
    """The :class:`WorkerError` of env ``index`` from a worker's error payload
    ``(exc_type, message, traceback, pickled exception or None)``, the exception chained when it unpickles.

    Example:
        >>> error = error_from_payload(3, "step", ("ValueError", "bad action", "", None))
        >>> str(error), error.env_index
        ('env 3 failed in step(): ValueError: bad action', 3)
    """
    exc_type, message, trace, pickled = payload
    error = WorkerError(index, str(command), exc_type, message, trace)
    if pickled is not None:
        try:
            error.__cause__ = pickle.loads(pickled)
        except Exception:
            pass
    return error
