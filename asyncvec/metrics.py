"""Run telemetry: TensorBoard scalars and histograms, a terminal progress bar, episode statistics."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Mapping

import numpy as np

__all__ = ["EpisodeStats", "RunLogger", "StageClock"]


class EpisodeStats:
    """Running return and length of each env's current episode, and a window of finished ones.

    Example:
        >>> stats = EpisodeStats(num_envs=2, window=10)
        >>> stats.update(np.array([0, 1]), np.array([1.0, 1.0]), np.array([False, True]))
        >>> stats.returns(), stats.episodes
        ([1.0], 1)
    """

    def __init__(self, num_envs: int, window: int = 100) -> None:
        self._return = np.zeros(num_envs)
        self._length = np.zeros(num_envs, dtype=np.int64)
        self._returns: deque[float] = deque(maxlen=window)
        self._lengths: deque[int] = deque(maxlen=window)
        self.episodes = 0
        self.steps = 0

    def update(self, env_ids: np.ndarray, rewards: np.ndarray, dones: np.ndarray) -> None:
        """Adds one step for each env in ``env_ids``; closes the episodes where ``dones``."""
        np.add.at(self._return, env_ids, rewards)
        np.add.at(self._length, env_ids, 1)
        self.steps += len(env_ids)
        for env_id in np.asarray(env_ids)[np.asarray(dones, dtype=bool)]:
            self._returns.append(float(self._return[env_id]))
            self._lengths.append(int(self._length[env_id]))
            self._return[env_id] = 0.0
            self._length[env_id] = 0
            self.episodes += 1

    def returns(self, last: int | None = None) -> list[float]:
        """Returns of the finished episodes in the window (the ``last`` ones if given)."""
        items = list(self._returns)
        return items if last is None else items[-last:]

    def lengths(self) -> list[int]:
        return list(self._lengths)

    def mean_return(self, last: int | None = None) -> float:
        items = self.returns(last)
        return float(np.mean(items)) if items else float("nan")


class StageClock:
    """Wall-clock and CPU seconds per stage of a learner's loop (Sample Factory's habit): where the
    time goes, logged beside the returns instead of measured from outside.

    ``with clock("update"): ...`` times one pass of a stage (``add`` records one measured
    elsewhere). ``scalars()`` gives, per stage, the mean wall seconds of the passes since its last
    call (``time/update_s``) and their CPU seconds on the timing thread (``time/update_cpu_s``:
    below the wall time when the stage waited or other threads ran); ``totals`` the wall seconds
    of the whole run, which ``StageClock.words`` says in words.

    Example:
        >>> clock = StageClock()
        >>> with clock("update"):
        ...     _ = sum(range(1000))
        >>> sorted(clock.scalars()), clock.count["update"]
        (['time/update_cpu_s', 'time/update_s'], 1)
        >>> StageClock.words({"collect_wait": 12.25, "update": 30.0})
        'collect wait 12.2 s, update 30.0 s'
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self._since: dict[str, list[float]] = {}  # stage -> [wall, cpu, passes] since the last scalars()

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        self.totals.setdefault(stage, 0.0)  # stages are listed in the order they are entered: outer before inner
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - wall, time.thread_time() - cpu)

    def add(self, stage: str, wall_s: float, cpu_s: float = float("nan")) -> None:
        self.totals[stage] = self.totals.get(stage, 0.0) + wall_s
        self.count[stage] = self.count.get(stage, 0) + 1
        since = self._since.setdefault(stage, [0.0, 0.0, 0])
        since[0] += wall_s
        since[1] += cpu_s
        since[2] += 1

    def scalars(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for stage, (wall, cpu, passes) in self._since.items():
            if passes:
                out[f"time/{stage}_s"] = wall / passes
                out[f"time/{stage}_cpu_s"] = cpu / passes
        self._since = {stage: [0.0, 0.0, 0] for stage in self._since}
        return out

    @staticmethod
    def words(seconds: Mapping[str, float]) -> str:
        """Seconds per stage (``totals``, or ``TrainResult.stage_seconds``) in words."""
        return ", ".join(f"{stage.replace('_', ' ')} {value:.1f} s" for stage, value in seconds.items())


#: RunLogger.close waits this long for TensorBoard's writer to stop, then goes on without it.
WRITER_CLOSE_TIMEOUT_S = 10.0


class RunLogger:
    """TensorBoard writer (when ``track``) plus a tqdm progress bar counting ``unit`` (env steps unless
    told: an LM agent counts prompts). ``initial_step``: where a resumed run's bar starts (its step axis
    goes on from the checkpoint's).

    Example:
        >>> logger = RunLogger("runs/example", track=False, total_steps=100, progress=False)
        >>> logger.log({"charts/return": 1.0}, step=10)
        >>> logger.close()
    """

    def __init__(
        self,
        log_dir: str | Path,
        *,
        track: bool = False,
        total_steps: int | None = None,
        progress: bool = True,
        hparams: Mapping[str, Any] | None = None,
        unit: str = "step",
        initial_step: int = 0,
    ) -> None:
        self.writer = None
        if track:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(log_dir))
            if hparams:
                table = "\n".join(f"|{k}|{v}|" for k, v in hparams.items())
                self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, unit=unit, dynamic_ncols=True, mininterval=1.0)
        self._last_step = initial_step

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        """Writes finite scalars to TensorBoard and advances the progress bar to ``step`` (a step past
        the total raises the total, so the bar stays drawn, full)."""
        if self.writer is not None:
            for name, value in scalars.items():
                if isinstance(value, (int, float, np.floating, np.integer)) and math.isfinite(value):
                    self.writer.add_scalar(name, float(value), step)
        if self.bar is not None:
            self._move_bar_to(step)
            shown = {_BAR_KEYS[k]: f"{v:.3g}" for k, v in scalars.items() if k in _BAR_KEYS and math.isfinite(v)}
            if shown:
                self.bar.set_postfix(shown, refresh=False)
        self._last_step = max(self._last_step, step)

    def _move_bar_to(self, step: int) -> None:
        assert self.bar is not None
        if self.bar.total is not None and step > self.bar.total:
            # past the planned total (the last batch overshoots it): tqdm would drop the bar
            self.bar.total = step
        self.bar.update(max(0, step - self._last_step))

    def histogram(self, name: str, values: Any, step: int) -> None:
        """Writes a histogram (e.g. latencies, staleness) when there are values."""
        values = np.asarray(values, dtype=np.float64)
        if self.writer is not None and values.size:
            self.writer.add_histogram(name, values, step)

    def close(self, final_step: int | None = None) -> None:
        """Flushes and closes the writer and the bar; ``final_step`` first moves the bar to the step the
        run ended at (a learner that logs every few hundred steps would leave it short)."""
        if self.bar is not None and final_step is not None:
            self._move_bar_to(final_step)
            self._last_step = max(self._last_step, final_step)
        if self.writer is not None:
            writer, self.writer = self.writer, None
            _close_within(writer, WRITER_CLOSE_TIMEOUT_S)
        if self.bar is not None:
            self.bar.close()


def _close_within(writer: Any, timeout_s: float) -> None:
    """``writer.close()`` in a thread of its own, waited for at most ``timeout_s``: a Ctrl-C reaches only the main
    thread, so it cannot land inside TensorBoard's queue code there (once it did, the writer thread never got its
    stop signal and the stop hung in ``join``), and a writer that does not stop cannot hold the run's stop."""
    closer = threading.Thread(target=writer.close, name="asyncvec-tensorboard-close", daemon=True)
    closer.start()
    closer.join(timeout_s)
    if closer.is_alive():
        print(
            f"TensorBoard's writer did not stop within {timeout_s:g} s: its last events may be missing",
            file=sys.stderr,
            flush=True,
        )


# scalar -> its label on the progress bar ("staleness", not "mean": it is not a return)
_BAR_KEYS = {
    "charts/episodic_return": "episodic_return",
    "charts/env_steps_per_s": "env_steps_per_s",
    "staleness/mean": "staleness",
}
