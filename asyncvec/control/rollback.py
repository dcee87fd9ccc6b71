"""Rollback: back to the last good policy when an update makes it worse.

`RollbackGuard` keeps checkpoints keyed by policy version and evaluates the policy every
``every`` updates. When an evaluation falls below the best one by more than ``margin``, it

1. pauses collection (``pause()``),
2. restores the best version's weights in the learner (``restore(weights)``) and publishes them
   again under a **new** version number (``publish(weights) -> version``; versions only grow,
   so a version number never names two sets of weights), recorded as a rollback
   (`RollbackEvent`, ``lineage[new_version] = best_version``),
3. marks every version after the best one up to the bad one as rolled back: their samples get
   weight ``sample_weight`` (0.0, the default, drops them) from `RollbackGuard.sample_weights`,
4. resumes collection (``resume()``).

The learner calls `RollbackGuard.update` after each publish; nothing else changes in its loop.

Example:
    >>> published = []
    >>> def publish(weights):
    ...     published.append(weights)
    ...     return len(published)
    >>> scores = {1: 1.0, 2: 2.0, 3: -5.0}
    >>> guard = RollbackGuard(publish, evaluate=lambda version: scores[version], margin=1.0)
    >>> for weights in ("w1", "w2", "w3"):   # the learner publishes, then tells the guard
    ...     event = guard.update(publish(weights), weights)
    >>> event.bad_version, event.restored_version, event.new_version, published[-1]
    (3, 2, 4, 'w2')
    >>> guard.sample_weights([1, 2, 3, 4]).tolist()
    [1.0, 1.0, 0.0, 1.0]
"""

from __future__ import annotations

import copy
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["RollbackEvent", "RollbackGuard"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RollbackEvent:
    """One rollback.

    Attributes:
        bad_version: the version whose evaluation fell below the best by more than the margin.
        restored_version: the best version, whose weights were published again.
        new_version: the version number the restored weights were published under.
        score: ``bad_version``'s evaluation.
        best_score: ``restored_version``'s evaluation.
        rolled_back: the versions whose samples are dropped or down-weighted.
    """

    bad_version: int
    restored_version: int
    new_version: int
    score: float
    best_score: float
    rolled_back: tuple[int, ...]


class RollbackGuard:
    """Checkpoints keyed by version, periodic evaluation, rollback to the best (module docstring).

    Args:
        publish: publishes weights to the actors and returns their new version (e.g.
            ``VersionManager.publish``).
        evaluate: ``evaluate(version) -> score`` (higher is better) of the version just
            published; called every ``every`` updates.
        margin: roll back when ``score < best_score - margin``.
        every: evaluate every this many updates.
        keep: how many recent checkpoints to keep besides the best one.
        sample_weight: the weight of samples from rolled-back versions (0.0 drops them).
        restore: called with the best weights before they are published again (load them into
            the learner's model, reset its optimizer).
        pause, resume: called around a rollback (e.g. to hold collection back).
        snapshot: copies weights for a checkpoint (default ``copy.deepcopy``; torch tensors
            in a state dict are cloned).
    """

    def __init__(
        self,
        publish: Callable[[Any], int],
        evaluate: Callable[[int], float],
        *,
        margin: float,
        every: int = 1,
        keep: int = 2,
        sample_weight: float = 0.0,
        restore: Callable[[Any], Any] | None = None,
        pause: Callable[[], Any] | None = None,
        resume: Callable[[], Any] | None = None,
        snapshot: Callable[[Any], Any] = copy.deepcopy,
    ) -> None:
        if not math.isfinite(margin) or margin < 0:
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be an int >= 0, got {keep!r}")
        if not 0.0 <= sample_weight <= 1.0:
            raise ValueError(f"sample_weight must be in [0, 1], got {sample_weight!r}")
        self._publish, self._evaluate = publish, evaluate
        self.margin, self.every, self.keep, self.sample_weight = float(margin), every, keep, float(sample_weight)
        self._restore, self._pause, self._resume, self._snapshot = restore, pause, resume, snapshot
        self.checkpoints: OrderedDict[int, Any] = OrderedDict()
        self.scores: dict[int, float] = {}
        self.best_version: int | None = None
        self.best_score = -math.inf
        self.rolled_back: set[int] = set()
        self.lineage: dict[int, int] = {}  # new version -> the version whose weights it re-published
        self.events: list[RollbackEvent] = []
        self.updates = 0

    def update(self, version: int, weights: Any) -> RollbackEvent | None:
        """Records the just-published ``version``; evaluates every ``every`` updates; rolls back if needed.

        Returns the `RollbackEvent` when it rolled back, else None.
        """
        version = int(version)
        self.updates += 1
        self.checkpoints[version] = self._snapshot(weights)
        if self.updates % self.every:
            self._prune()
            return None
        score = float(self._evaluate(version))
        self.scores[version] = score
        if self.best_version is None or score > self.best_score:
            self.best_version, self.best_score = version, score
        elif score < self.best_score - self.margin:
            return self._roll_back(version, score)
        self._prune()
        return None

    def sample_weights(self, versions: Sequence[int] | np.ndarray) -> np.ndarray:
        """Per-sample weights: ``sample_weight`` for samples of rolled-back versions, 1.0 otherwise."""
        versions = np.asarray(versions, dtype=np.int64)
        weights = np.ones(versions.shape, dtype=np.float64)
        if self.rolled_back:
            weights[np.isin(versions, list(self.rolled_back))] = self.sample_weight
        return weights

    def stats(self) -> dict[str, float]:
        """rollbacks, rolled_back_versions, best_version (-1 before any evaluation), best_score, evaluations."""
        return {
            "rollbacks": float(len(self.events)),
            "rolled_back_versions": float(len(self.rolled_back)),
            "best_version": float(-1 if self.best_version is None else self.best_version),
            "best_score": self.best_score,
            "evaluations": float(len(self.scores)),
        }

    def _roll_back(self, bad_version: int, score: float) -> RollbackEvent:
        best_version = self.best_version
        weights = self.checkpoints[best_version]
        logger.warning(
            "RollbackGuard: version %d scored %.4g, below the best (version %d, %.4g) by more than %.4g: rolling back",
            bad_version,
            score,
            best_version,
            self.best_score,
            self.margin,
        )
        if self._pause is not None:
            self._pause()
        try:
            if self._restore is not None:
                self._restore(self._snapshot(weights))
            new_version = int(self._publish(self._snapshot(weights)))
        finally:
            if self._resume is not None:
                self._resume()
        rolled_back = tuple(range(best_version + 1, bad_version + 1))  # every version after the best
        self.rolled_back.update(rolled_back)
        for version in rolled_back:
            if version != best_version:
                self.checkpoints.pop(version, None)
        self.lineage[new_version] = best_version
        self.checkpoints[new_version] = weights
        self.scores[new_version] = self.best_score
        self.best_version = new_version  # the same weights under their new number
        event = RollbackEvent(bad_version, best_version, new_version, score, self.best_score, rolled_back)
        self.events.append(event)
        self._prune()
        return event

    def _prune(self) -> None:
        """Keeps the best checkpoint and the ``keep`` most recent others."""
        others = [v for v in self.checkpoints if v != self.best_version]
        for version in others[: max(0, len(others) - self.keep)]:
            del self.checkpoints[version]

    def log(self, logger_: Any, step: int, prefix: str = "rollback/") -> None:
        """Writes `stats` to a `asyncvec.metrics.RunLogger` (TensorBoard) at ``step``."""
        logger_.log({f"{prefix}{key}": value for key, value in self.stats().items()}, step=step)
