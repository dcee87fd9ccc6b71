"""Record and replay a run's schedule: which samples, of which versions, entered which update.

An async run's batches are decided by timing (which env or completion finished first, which
version was current when it acted); ``--record-schedule`` keeps them, so ``--replay DIR`` can re-run
the learner on exactly those batches, in order, without acting: the same updates from the same
state give the same parameters, bit for bit. What a replay needs of each update: the batch the
learner took (samples with their behaviour log-probs and versions), the learner's version then,
where the run was after it (prompts or env steps), and the RNG states. The LM agents and PPO use it.

Example:
    >>> import tempfile
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Args: seed: int = 0; mode: str = "async"
    >>> folder = tempfile.mkdtemp()
    >>> ScheduleWriter(folder, "rloo", Args()).write(batch=["a batch"], version=3, position=8)
    >>> [(u.version, u.position, u.batch) for u in read_schedule(folder, "rloo", Args(mode="sync"), {"mode"})]
    [(3, 8, ['a batch'])]
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from asyncvec.runs import rng_state


class ScheduleError(ValueError):
    """A ``--replay`` folder that cannot be replayed: missing, of another agent or options, or cut short."""


@dataclass
class RecordedUpdate:
    """One update of a recorded run: the batch it took, the learner's version when it took it, where
    the run was after it (prompts or env steps done), and the RNG states at its start."""

    batch: Any
    version: int
    position: int
    rng: dict[str, Any]


def recorded_options(args: Any) -> dict[str, Any]:
    """The options a schedule records and compares: every field by its flat name (an LM agent's ``LMArgs`` groups
    its options in sections; ``args.flat()`` gives them the names they have on the command line)."""
    return asdict(args.flat() if hasattr(args, "flat") else args)


class ScheduleWriter:
    """Writes a run's schedule into ``folder``: ``meta.json`` (agent, options), then one
    ``update_NNNNNN.pt`` per update (:meth:`write`, before the update runs)."""

    def __init__(self, folder: str | Path, agent: str, args: Any) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.updates = len(list(self.folder.glob("update_*.pt")))  # a resumed run goes on numbering
        meta = {"agent": agent, "args": recorded_options(args)}
        (self.folder / "meta.json").write_text(json.dumps(meta, indent=1, default=str))

    def write(self, batch: Any, version: int, position: int) -> None:
        """Keeps the batch of an update, the version it meets, the run's position after it and the RNG
        states now."""
        path = self.folder / f"update_{self.updates:06d}.pt"
        record = {"batch": batch, "version": version, "position": position, "rng": rng_state()}
        torch.save(record, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
        self.updates += 1


def read_schedule(folder: str | Path, agent: str, args: Any, not_replayed: Collection[str]) -> Iterator[RecordedUpdate]:
    """The updates recorded in ``folder``, in order, after checking they were recorded by ``agent``
    with the options in ``args`` that change what the learner computes (all but ``not_replayed``:
    how samples were collected, logged or how long the run was).

    Every file is checked here, before anything runs (a file cut short fails its archive's checks), though the
    updates are read one at a time as they are replayed.

    Raises:
        ScheduleError: no schedule there, another agent's, other options, a gap in the updates, or an
            update file that is cut or damaged.
    """
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise ScheduleError(
            f"--replay {folder}: no recorded schedule there (meta.json): pass the schedule folder of a run made "
            "with --record-schedule (<log-dir>/<run>/schedule)"
        )
    meta = json.loads(meta_path.read_text())
    if meta.get("agent") != agent:
        raise ScheduleError(
            f"--replay {folder}: recorded by {meta.get('agent')}, not {agent}: replay it with that agent"
        )
    current = json.loads(json.dumps(recorded_options(args), default=str))
    for name, value in meta.get("args", {}).items():
        if name not in not_replayed and current.get(name) != value:
            raise ScheduleError(
                f"--replay {folder}: recorded with --{name.replace('_', '-')} {value}, not {current.get(name)}: pass "
                f"the recorded run's options ({meta_path})"
            )
    paths = sorted(folder.glob("update_*.pt"))
    if not paths:
        raise ScheduleError(f"--replay {folder}: the schedule holds no update")
    for index, path in enumerate(paths):
        if path.name != f"update_{index:06d}.pt":
            raise ScheduleError(
                f"--replay {folder}: update {index} is missing (found {path.name}): the schedule is cut"
            )
        _check_readable(folder, path)
    return _records(folder, paths)


def _check_readable(folder: Path, path: Path) -> None:
    """``torch.save`` writes a zip archive: one cut short has no directory, a damaged one fails its CRCs."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (OSError, zipfile.BadZipFile) as exc:
        raise ScheduleError(f"--replay {folder}: {path.name} is unreadable ({exc}): the schedule is cut") from exc
    if damaged is not None:
        raise ScheduleError(f"--replay {folder}: {path.name} is unreadable ({damaged} is damaged)")


def _records(folder: Path, paths: list[Path]) -> Iterator[RecordedUpdate]:
    for path in paths:
        try:
            record = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # a truncated file
            raise ScheduleError(f"--replay {folder}: {path.name} is unreadable ({exc})") from exc
        yield RecordedUpdate(record["batch"], int(record["version"]), int(record["position"]), record["rng"])
