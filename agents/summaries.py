"""The words of an env agent's last line: its steps (and where a resumed run went on from), its final return,
its env restarts.

Example:
    >>> f"PPO {run_steps_text(128, 64)}, {final_return_text(21.5, 20)}{restarts_text([0, 1], 2)}"
    'PPO 128 steps (resumed at step 64: 64 in this run), final return (last 20 episodes) 21.5, 1 env restart (env 1: 1; --max-restarts 2 per env)'
"""

from __future__ import annotations

import numpy as np


def final_return_text(final_return: float, last: int) -> str:
    """The summary's words for the mean return of the last ``last`` episodes (NaN: none finished).

    Example:
        >>> final_return_text(float("nan"), 20)
        'no episode finished yet'
    """
    if np.isnan(final_return):
        return "no episode finished yet"
    return f"final return (last {last} episodes) {final_return:.1f}"


def run_steps_text(global_step: int, resumed_at_step: int) -> str:
    """The summary's words for the steps of a run; a resumed run's time and steps/s cover only its own part.

    Example:
        >>> run_steps_text(128, 64)
        '128 steps (resumed at step 64: 64 in this run)'
    """
    if resumed_at_step == 0:
        return f"{global_step} steps"
    return f"{global_step} steps (resumed at step {resumed_at_step}: {global_step - resumed_at_step} in this run)"


def restarts_text(restarts: list[int], max_restarts: int) -> str:
    """The summary's words for the env restarts of a ``--max-restarts`` run ('' without the option).

    Example:
        >>> restarts_text([0, 2, 0, 1], 3)
        ', 3 env restarts (env 1: 2, env 3: 1; --max-restarts 3 per env)'
    """
    if not max_restarts:
        return ""
    if not sum(restarts):
        return f", no env restarted (--max-restarts {max_restarts} per env)"
    which = ", ".join(f"env {index}: {count}" for index, count in enumerate(restarts) if count)
    total = sum(restarts)
    return f", {total} env restart{'s' if total > 1 else ''} ({which}; --max-restarts {max_restarts} per env)"
