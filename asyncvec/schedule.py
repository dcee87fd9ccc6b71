"""Record and replay an LM run's schedule: which samples, of which versions, entered which update.

An async run's batches are decided by timing (which completion finished first, which version was
current when it started); ``--record-schedule`` keeps them, so ``--replay DIR`` can re-run the
learner on exactly those batches, in order, without generating: the same updates from the same
state give the same parameters, bit for bit. What a replay needs of each update: the groups the
learner took (completions with their behaviour log-probs, per-token versions and rewards), the
learner's version then, the prompts done after it, and the RNG states (minibatch order).

Example:
    >>> import tempfile
    >>> from asyncvec.lm.options import LMArgs
    >>> folder = tempfile.mkdtemp()
    >>> writer = ScheduleWriter(folder, "rloo", LMArgs(mode="async"))
    >>> writer.write(groups=["a batch"], version=3, prompts_done=8)
    >>> [(u.version, u.prompts_done, u.groups) for u in read_schedule(folder, "rloo", LMArgs(mode="sync"))]
    [(3, 8, ['a batch'])]
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from asyncvec.runs import rng_state

# Options that do not change what the learner computes from a batch: a replay may differ in them.
NOT_REPLAYED = frozenset(
    {
        "mode",
        "staleness_control",
        "bitwise_sampling",
        "prefetch_updates",
        "policy_batch_size",
        "policy_wait_ms",
        "policy_inflight_batches",
        "deadline_ms",
        "inflight_updates",
        "backend",
        "base_url",
        "served_model",
        "server_kind",
        "update_token",
        "vllm_engine",
        "reward_workers",
        "reward_timeout_s",
        "reward_cache_size",
        "total_prompts",
        "target_reward",
        "eval_prompts",
        "timeout_s",
        "output_dir",
        "checkpoint_dir",
        "resume",
        "track",
        "log_dir",
        "progress",
        "record_schedule",
        "replay",
    }
)


class ScheduleError(ValueError):
    """A ``--replay`` folder that cannot be replayed: missing, of another agent or options, or cut short."""


@dataclass
class RecordedUpdate:
    """One update of a recorded run: the groups it took, the learner's version when it took them,
    the prompts done after them, and the RNG states at its start."""

    groups: Any
    version: int
    prompts_done: int
    rng: dict[str, Any]


class ScheduleWriter:
    """Writes a run's schedule into ``folder``: ``meta.json`` (agent, options), then one
    ``update_NNNNNN.pt`` per update (:meth:`write`, before the update runs)."""

    def __init__(self, folder: str | Path, agent: str, args: Any) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.updates = len(list(self.folder.glob("update_*.pt")))  # a resumed run goes on numbering
        meta = {"agent": agent, "args": asdict(args)}
        (self.folder / "meta.json").write_text(json.dumps(meta, indent=1, default=str))

    def write(self, groups: Any, version: int, prompts_done: int) -> None:
        """Keeps the groups the next update takes, the version they meet and the RNG states now."""
        path = self.folder / f"update_{self.updates:06d}.pt"
        record = {"groups": groups, "version": version, "prompts_done": prompts_done, "rng": rng_state()}
        torch.save(record, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
        self.updates += 1


def read_schedule(folder: str | Path, agent: str, args: Any) -> Iterator[RecordedUpdate]:
    """The updates recorded in ``folder``, in order, after checking they were recorded by ``agent``
    with the options in ``args`` that change what the learner computes (all but ``NOT_REPLAYED``).

    Raises:
        ScheduleError: no schedule there, another agent's, other options, or a gap in the updates.
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
    current = json.loads(json.dumps(asdict(args), default=str))
    for name, value in meta.get("args", {}).items():
        if name not in NOT_REPLAYED and current.get(name) != value:
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
    return _records(folder, paths)


def _records(folder: Path, paths: list[Path]) -> Iterator[RecordedUpdate]:
    for path in paths:
        try:
            record = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # a truncated file
            raise ScheduleError(f"--replay {folder}: {path.name} is unreadable ({exc})") from exc
        yield RecordedUpdate(record["groups"], int(record["version"]), int(record["prompts_done"]), record["rng"])
