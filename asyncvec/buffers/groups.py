"""Groups of k completions per prompt, for RLOO / GRPO-style learners."""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncvec.buffers._spaces import as_column
from asyncvec.versioning import per_token_versions

__all__ = ["CompletionGroups", "GroupBatch"]


@dataclass
class GroupBatch:
    """Complete groups, ``G`` prompts by ``k`` completions.

    Attributes:
        prompt_ids: ``G`` prompt ids, in the order their groups completed (``pop(keys=...)``: in that order).
        completions: ``[G][k]`` completions as given to ``add``.
        rewards: ``[G, k]`` float32, ready for ``asyncvec.losses.rloo_advantages``.
        logps: ``[G, k, L]`` float32 per-token behavior log-probs, zero-padded to the
            longest completion ``L``.
        mask: ``[G, k, L]`` bool, True on real tokens.
        policy_version: ``[G, k]`` int64 version of each completion: its oldest token's (the
            version when its sampling started).
        token_versions: ``[G, k, L]`` int64 version that sampled each token (in-flight weight
            updates may change it within a completion); -1 off the mask.
    """

    prompt_ids: list[Hashable]
    completions: list[list[Any]]
    rewards: np.ndarray
    logps: np.ndarray
    mask: np.ndarray
    policy_version: np.ndarray
    token_versions: np.ndarray

    def staleness(self, current_version: int) -> np.ndarray:
        """``[G, k]`` ``current_version - policy_version``: each completion's oldest token's staleness."""
        return current_version - self.policy_version


@dataclass
class _Pending:
    positions: list[int] = field(default_factory=list)
    completions: list[Any] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    logps: list[np.ndarray] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    token_versions: list[tuple[int, ...]] = field(default_factory=list)


class CompletionGroups:
    """Gathers completions per prompt and releases a prompt once it has ``group_size`` of them.

    Completions of different prompts may arrive interleaved and from several threads. Once a
    prompt's group is complete it is queued (FIFO) and the prompt id may start a new group.

    Args:
        group_size: ``k``, completions per prompt (at least 2 for leave-one-out baselines).

    Example:
        >>> groups = CompletionGroups(group_size=2)
        >>> groups.add("p0", "4", reward=1.0, logps=[-0.1], version=3)
        False
        >>> groups.add("p1", "no", reward=0.0, logps=[-2.0, -0.5], version=3)
        False
        >>> groups.add("p0", "5", reward=0.0, logps=[-1.2, -0.3], version=4, token_versions=[4, 5])
        True
        >>> batch = groups.pop(timeout=0)
        >>> batch.prompt_ids, batch.rewards.tolist(), batch.mask.sum(-1).tolist()
        (['p0'], [[1.0, 0.0]], [[1, 2]])
        >>> batch.policy_version.tolist(), batch.token_versions.tolist()
        ([[3, 4]], [[[3, -1], [4, 5]]])
    """

    def __init__(self, group_size: int) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1:
            raise ValueError(f"group_size: expected a positive int, got {group_size!r}")
        self.group_size = int(group_size)
        self._pending: OrderedDict[Hashable, _Pending] = OrderedDict()
        self._complete: deque[tuple[Hashable, _Pending]] = deque()
        self._cond = threading.Condition()

    def add(
        self,
        prompt_id: Hashable,
        completion: Any,
        reward: float,
        logps: Any,
        version: int,
        token_versions: Any = None,
        position: int | None = None,
    ) -> bool:
        """Add one completion; returns True when it completes its prompt's group.

        Args:
            prompt_id: any hashable id of the prompt.
            completion: the completion (text, token ids, ...); stored as given.
            reward: the scalar reward of the completion.
            logps: 1-D per-token log-probabilities under the behavior policy (each token's under
                the version that sampled it).
            version: the policy version that generated it: its oldest token's.
            token_versions: the version that sampled each token (one per entry of ``logps``,
                never decreasing, the first equal to ``version``); None: every token has ``version``.
            position: the completion's place in its group (0 to k-1); a complete group lists its
                completions in this order whatever order they arrived in. None: arrival order.
        """
        try:
            hash(prompt_id)
        except TypeError:
            raise ValueError(f"prompt_id: expected a hashable id, got {type(prompt_id).__name__}") from None
        reward_value = float(as_column("reward", reward, 1, np.float64, finite=True)[0])
        version_value = int(as_column("version", version, 1, np.int64, minimum=0)[0])
        token_logps = np.asarray(logps)
        if token_logps.ndim != 1 or token_logps.dtype.kind not in "iuf":
            raise ValueError(
                f"logps: expected a 1-D array of per-token log-probs, got {token_logps.dtype} "
                f"shape {token_logps.shape} (prompt {prompt_id!r})"
            )
        if token_versions is not None:
            token_versions = np.asarray(token_versions).tolist()
        versions = per_token_versions(version_value, token_versions, len(token_logps))
        with self._cond:
            group = self._pending.setdefault(prompt_id, _Pending())
            place = len(group.completions) if position is None else int(position)
            if place in group.positions:
                raise ValueError(f"position: prompt {prompt_id!r} already has a completion at position {place}")
            group.positions.append(place)
            group.completions.append(completion)
            group.rewards.append(reward_value)
            group.logps.append(token_logps.astype(np.float32))
            group.versions.append(version_value)
            group.token_versions.append(versions)
            if len(group.completions) < self.group_size:
                return False
            del self._pending[prompt_id]
            self._complete.append((prompt_id, _in_position_order(group)))
            self._cond.notify_all()
            return True

    @property
    def num_complete(self) -> int:
        """Complete groups waiting to be popped."""
        with self._cond:
            return len(self._complete)

    @property
    def num_pending(self) -> int:
        """Prompts with an incomplete group."""
        with self._cond:
            return len(self._pending)

    def pop(
        self, num_groups: int | None = None, timeout: float | None = None, keys: list[Hashable] | None = None
    ) -> GroupBatch:
        """Remove and return complete groups, oldest first.

        Args:
            num_groups: exactly this many groups; None: every complete group (at least one).
            timeout: seconds to wait for them; 0 checks once; None waits indefinitely.
            keys: instead of the oldest complete groups, these prompts' groups, in this order (waiting
                for each to complete): a batch that does not depend on which finished first.

        Raises:
            TimeoutError: not enough complete groups in time.
        """
        if keys is not None:
            return self._pop_keys(list(keys), timeout)
        if num_groups is not None and (
            isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1
        ):
            raise ValueError(f"num_groups: expected a positive int or None, got {num_groups!r}")
        wanted = 1 if num_groups is None else num_groups
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._complete) >= wanted, timeout):
                raise TimeoutError(
                    f"pop: {len(self._complete)} complete groups after {timeout}s, need {wanted} "
                    f"({len(self._pending)} prompts still incomplete)"
                )
            count = len(self._complete) if num_groups is None else num_groups
            taken = [self._complete.popleft() for _ in range(count)]
        return _to_batch(taken, self.group_size)

    def _pop_keys(self, keys: list[Hashable], timeout: float | None) -> GroupBatch:
        if not keys:
            raise ValueError("keys: expected at least one prompt id")
        with self._cond:

            def all_complete() -> bool:
                complete = {key for key, _ in self._complete}
                return all(key in complete for key in keys)

            if not self._cond.wait_for(all_complete, timeout):
                missing = [key for key in keys if key not in {k for k, _ in self._complete}]
                raise TimeoutError(
                    f"pop: the groups of {missing[:8]} still incomplete after {timeout}s "
                    f"({len(self._pending)} prompts incomplete)"
                )
            by_key = {key: group for key, group in self._complete}
            self._complete = deque((key, group) for key, group in self._complete if key not in set(keys))
            taken = [(key, by_key[key]) for key in keys]
        return _to_batch(taken, self.group_size)


def _in_position_order(group: _Pending) -> _Pending:
    order = sorted(range(len(group.positions)), key=group.positions.__getitem__)
    columns = (getattr(group, column.name) for column in dataclasses.fields(group))
    return _Pending(*([values[i] for i in order] for values in columns))


def _to_batch(taken: list[tuple[Hashable, _Pending]], k: int) -> GroupBatch:
    length = max((len(logps) for _, group in taken for logps in group.logps), default=0)
    logps = np.zeros((len(taken), k, length), dtype=np.float32)
    mask = np.zeros((len(taken), k, length), dtype=bool)
    token_versions = np.full((len(taken), k, length), -1, dtype=np.int64)
    for g, (_, group) in enumerate(taken):
        for i, (token_logps, versions) in enumerate(zip(group.logps, group.token_versions)):
            logps[g, i, : len(token_logps)] = token_logps
            mask[g, i, : len(token_logps)] = True
            token_versions[g, i, : len(versions)] = versions
    return GroupBatch(
        prompt_ids=[prompt_id for prompt_id, _ in taken],
        completions=[group.completions for _, group in taken],
        rewards=np.array([group.rewards for _, group in taken], dtype=np.float32).reshape(len(taken), k),
        logps=logps,
        mask=mask,
        policy_version=np.array([group.versions for _, group in taken], dtype=np.int64).reshape(len(taken), k),
        token_versions=token_versions,
    )
