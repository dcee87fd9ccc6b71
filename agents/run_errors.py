r"""How an agent's command line reports the error that ended a run: one line (what failed, where, where the full
traceback went) and an exit code; an env that failed in its worker is named as the user's env, with the file and line
it raised at.

Example:
    >>> first_line(ValueError("bad action for env 1\n\nTraceback ..."))
    'bad action for env 1'
"""

from __future__ import annotations

import re
import sys
import tempfile
import traceback
from pathlib import Path

from asyncvec.vector import WorkerError

TRACEBACK_VARIABLE = "ASYNCVEC_TRACEBACK"
"""Set (``ASYNCVEC_TRACEBACK=1``), the agents' command lines let every error keep its full traceback."""


def first_line(exc: BaseException) -> str:
    """``exc``'s message up to its first blank line, on one line (a worker's traceback follows a blank line)."""
    text = str(exc).split("\n\n")[0]
    return " ".join(text.split()) or type(exc).__name__


def worker_error_in(exc: BaseException) -> WorkerError | None:
    """The `WorkerError` (an env that raised, died or hung in its worker) that ``exc`` is or wraps, if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, WorkerError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def where_raised(worker_traceback: str) -> str:
    r"""``file:line in function`` of the last frame of a formatted traceback ('' when there is none).

    Example:
        >>> where_raised('Traceback (most recent call last):\n  File "/x/my_env.py", line 12, in step\n    1/0\nZeroDivisionError')
        'my_env.py:12 in step'
    """
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', worker_traceback)
    if not frames:
        return ""
    path, line, function = frames[-1]
    return f"{Path(path).name}:{line} in {function}"


def report_run_error(name: str, exc: BaseException, folder: Path | None, setup: bool = False) -> int:
    """Prints an error that ended a training run as one line (what failed, where, where its full traceback
    was written) and returns the exit code: 2 for an env that failed in its worker (the user's env to fix) or
    anything failing while the agent was built (``setup``: the env's or the model's code, a setting), 1
    otherwise. The full traceback goes to ``folder/traceback.txt`` (or a temporary file), once."""
    worker = worker_error_in(exc)
    if worker is None:
        text = "".join(traceback.format_exception(exc))
    else:  # the worker's traceback once (the error's message and its chained cause repeat it)
        text = (
            f"{first_line(worker)}\n\nWhere the run met it (most recent call last):\n"
            + "".join(traceback.format_tb(exc.__traceback__))
            + f"\nTraceback in the worker process of env {worker.env_index}:\n{worker.worker_traceback}"
        )
    try:
        if folder is None:
            raise OSError
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "traceback.txt"
        path.write_text(text)
    except OSError:
        with tempfile.NamedTemporaryFile("w", prefix="asyncvec-", suffix="-traceback.txt", delete=False) as file:
            file.write(text)
            path = Path(file.name)
    tail = f"full traceback in {path} ({TRACEBACK_VARIABLE}=1 prints it)"
    if worker is not None:
        at = where_raised(worker.worker_traceback)
        print(
            f"{name}: error: your env failed: {first_line(worker)}{f' (at {at})' if at else ''}; fix the env "
            f"(or let --max-restarts rebuild it); {tail}",
            file=sys.stderr,
        )
        return 2
    at = where_raised("".join(traceback.format_exception(exc)))
    when = "while building the agent: its env, model or options" if setup else "while training"
    print(
        f"{name}: error: {type(exc).__name__}: {first_line(exc)} ({f'at {at}, ' if at else ''}{when}); {tail}",
        file=sys.stderr,
    )
    return 2 if setup else 1
