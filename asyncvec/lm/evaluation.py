"""How well a language-model agent's policy does: held-out evaluation (one-step prompts or
multi-turn episodes), and the ``--target-reward`` check on a batch sampled entirely by the
current weights.

Example:
    >>> from asyncvec.lm.evaluation import target_reached
    >>> target_reached([0.9] * 10, target=0.85), target_reached([0.9] * 9, target=0.85)
    (True, False)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncvec.lm.build import LMParts
from asyncvec.lm.episodes import EpisodeCollector
from asyncvec.lm.groups import score_completions
from asyncvec.lm.learner import EpisodeBatch, LMBatch
from asyncvec.lm.options import LMArgs
from asyncvec.lm.prompts import iter_prompts

TARGET_WINDOW = 10
"""``target_reward`` is met when the mean training reward of this many updates reaches it."""


def mean_reward(parts: LMParts, num_prompts: int, seed: int, timeout_s: float) -> float:
    """Mean reward of one sampled completion for each of ``num_prompts`` prompts of ``eval_env``
    (the same prompts for a given ``seed``); nan when ``num_prompts`` is 0."""
    if num_prompts == 0:
        return float("nan")
    if parts.multi_turn:
        return evaluate_episodes(parts, num_prompts, seed, timeout_s)["reward"]
    prompts = list(itertools.islice(iter_prompts(parts.eval_env, seed), num_prompts))
    scored = score_completions(parts.policy, parts.rewarder, prompts, timeout_s)
    return float(np.mean(scored)) if scored else float("nan")


def evaluate_episodes(parts: LMParts, num_episodes: int, seed: int, timeout_s: float) -> dict[str, float]:
    """Multi-turn: ``num_episodes`` held-out episodes (the same for a given ``seed``) played by the
    policy; their mean return, success rate (terminated with a positive last reward) and mean
    turns, also appended to ``parts.eval_log``."""
    collector = EpisodeCollector(
        parts.eval_envs, parts.policy, 1, tokenizer=parts.tokenizer, system_prompt=parts.collector.system_prompt,
        max_new_tokens=parts.collector.max_new_tokens, seed=10**9 + seed * 10_007,
        on_overflow=parts.collector.on_overflow,
    )  # fmt: skip
    with collector:
        batch = collector.collect(num_episodes, timeout=timeout_s * max(1, num_episodes // 8))
    data = EpisodeBatch.from_episodes(batch, parts.policy.policy_version, max_staleness=10**9)
    stats = {key: data.info[key] for key in ("reward", "success", "turns_mean")}
    parts.eval_log.append(stats)
    return stats


def target_reached(reward_curve: list[float], target: float | None) -> bool:
    """Whether the mean training reward of the last ``TARGET_WINDOW`` updates reaches ``target``."""
    recent = [r for r in reward_curve[-TARGET_WINDOW:] if not math.isnan(r)]
    return target is not None and len(recent) == TARGET_WINDOW and float(np.mean(recent)) >= target


@dataclass
class TargetCheck:
    """What :func:`confirm_target` found: ``batch`` (None once the budget ran out) is the batch
    sampled entirely by the current weights, ``reward`` its mean reward, ``popped`` the prompts
    (groups) it took, older batches dropped on the way included."""

    confirmed: bool
    batch: Any | None
    reward: float
    popped: int


def confirm_target(parts: LMParts, args: LMArgs, prompts_left: int) -> TargetCheck:
    """After :func:`target_reached`: whether a batch sampled entirely by the current weights (no
    update in between) reaches ``args.target_reward - args.target_tolerance``.

    Why: the training reward of an update is that of weights an update or two older (async mode
    samples ahead of the learner), so one bad last update would go unseen. Batches holding older
    samples (in flight when the weights changed) are popped and dropped on the way; the run trains
    on a batch that falls short.
    """
    current = parts.versions.current_version
    popped = 0
    while prompts_left - popped >= args.prompts_per_update:
        if args.mode == "sync":
            parts.collector.submit(args.prompts_per_update)
        batch = parts.collector.pop(args.prompts_per_update, args.timeout_s)
        popped += args.prompts_per_update
        if int(np.max(batch.staleness(current), initial=0)) == 0:
            if parts.multi_turn:
                reward = EpisodeBatch.from_episodes(batch, current, max_staleness=0).info["reward"]
            else:
                reward = LMBatch.from_groups(batch, parts.tokenizer, current, max_staleness=0).info["reward"]
            return TargetCheck(reward >= args.target_reward - args.target_tolerance, batch, reward, popped)
    return TargetCheck(False, None, float("nan"), popped)
