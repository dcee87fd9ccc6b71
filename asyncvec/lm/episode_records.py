"""The records of multi-turn episodes: :class:`Turn` (one policy call and the env step after it),
:class:`Episode` (its turns) and :class:`EpisodeGroups` (the episodes of a batch, ``group_size`` per reset
seed), as :class:`~asyncvec.lm.episodes.EpisodeCollector` hands them out and
:class:`~asyncvec.lm.learner.EpisodeBatch` reads them. Also importable from :mod:`asyncvec.lm.episodes`.

Example:
    >>> turn = Turn((5,), (7, 1), (-0.1, -0.2), "7", 2, 0.0, reward=1.0)
    >>> Episode(env_id=0, seed=3, group=0, turns=[turn, turn]).discounted_return(gamma=0.5)
    1.5
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from asyncvec.versioning import per_token_versions

__all__ = ["Episode", "EpisodeGroups", "Turn"]


@dataclass
class Turn:
    """One assistant turn: the policy call and the env step that followed it.

    Attributes:
        prompt_ids: the rendered history the model read (a prefix of the next turn's prompt).
        completion_ids: the sampled token ids (eos included when sampled); empty on a deadline miss.
        completion_logps: the behavior log-prob of each completion token (under the version that
            sampled that token).
        text: the completion's text (what the env received, before any clipping).
        policy_version: the weights' version that sampled it: its oldest (first) token's.
        policy_latency_s: seconds from the request to the answer.
        fallback: the policy flagged the answer (deadline miss, or its action parser rejected it).
        missed_deadline: the policy's deadline passed: nothing was sampled (never trained on).
        reward: the env's reward for this turn.
        env_latency_s: seconds the env step took (as seen by the collector).
        segment: the context segment of the episode it was sampled in: 0, one more each time the
            oldest turns were dropped (``on_overflow="drop_oldest"``); within a segment each
            prompt is a prefix of the next.
        token_versions: the version that sampled each completion token, when in-flight weight
            updates changed it within the turn (None: every token has ``policy_version``); see
            :attr:`versions`.
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    completion_logps: tuple[float, ...]
    text: str
    policy_version: int
    policy_latency_s: float
    fallback: bool = False
    missed_deadline: bool = False
    reward: float = 0.0
    env_latency_s: float = 0.0
    segment: int = 0
    token_versions: tuple[int, ...] | None = None

    @property
    def versions(self) -> tuple[int, ...]:
        """The version of each completion token (``policy_version`` for each without ``token_versions``).

        Example:
            >>> Turn((5,), (7, 8, 1), (-0.1, -0.2, -0.3), "78", 2, 0.0, token_versions=(2, 3, 3)).versions
            (2, 3, 3)
        """
        return per_token_versions(self.policy_version, self.token_versions, len(self.completion_ids))

    @property
    def trainable(self) -> bool:
        """A sampled completion (not a deadline miss, not empty)."""
        return not self.missed_deadline and len(self.completion_ids) > 0


@dataclass
class Episode:
    """A whole conversation: its turns and how it ended.

    Attributes:
        env_id, seed, group: where it ran, its reset seed, its group's index.
        member: its place in its group (0 to k-1): a group lists its episodes in this order.
        turns: the assistant turns in order.
        terminated, truncated: how the episode ended (``truncated`` also for context overflow and env errors).
        context_overflow: the next prompt would not fit the context: the episode was cut there.
        env_error: the env raised (it was rebuilt): the episode is never trained on.
        dropped_turns: turns left out of later prompts (``on_overflow="drop_oldest"``).
    """

    env_id: int
    seed: int
    group: int
    turns: list[Turn] = field(default_factory=list)
    member: int = 0
    terminated: bool = False
    truncated: bool = False
    context_overflow: bool = False
    env_error: bool = False
    dropped_turns: int = 0

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def total_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))

    def discounted_return(self, gamma: float = 1.0) -> float:
        """``sum_t gamma^t r_t`` over its turns."""
        return float(sum(gamma**t * turn.reward for t, turn in enumerate(self.turns)))

    @property
    def trainable(self) -> bool:
        """No env error and at least one trainable turn."""
        return not self.env_error and any(turn.trainable for turn in self.turns)


@dataclass
class EpisodeGroups:
    """Complete groups popped from an :class:`EpisodeCollector`: ``episodes[g]`` holds group ``g``'s ``k`` episodes."""

    episodes: list[list[Episode]]
    seeds: list[int]

    def __len__(self) -> int:
        return len(self.episodes)

    @property
    def num_turns(self) -> int:
        return sum(e.num_turns for group in self.episodes for e in group)

    def staleness(self, current_version: int) -> np.ndarray:
        """Versions behind ``current_version`` of every sampled turn (flat): its oldest token's."""
        return np.asarray(
            [current_version - t.policy_version for g in self.episodes for e in g for t in e.turns if t.trainable],
            dtype=np.int64,
        )
