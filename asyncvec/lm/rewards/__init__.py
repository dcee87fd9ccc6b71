"""Reward plugins and an asynchronous reward service for language-model policies.

A reward plugin is a sync or async function ``f(prompt, completion, **info) -> float``
registered under a name. :class:`CombinedReward` sums plugins with weights.
:class:`RewardService` scores ``(prompt, response)`` pairs on background threads while the
policy keeps generating: it batches requests for a reward model (:class:`HFRewardModel`),
caches results per reward-model version, and turns timeouts and scorer errors into
*flagged* results that stay out of training.

This module imports neither torch nor transformers until a reward model is built.

Example:
    >>> from asyncvec.lm import rewards
    >>> rewards.score("exact_answer", "3+4=", " 7")
    1.0
    >>> with rewards.RewardService("exact_answer", timeout_s=5.0) as service:
    ...     result = service.submit("12*3=", "36").result(timeout=5.0)
    >>> result.reward, result.usable
    (1.0, True)
"""

from asyncvec.lm.rewards.models import BatchScorer, HFRewardModel
from asyncvec.lm.rewards.parsers import (
    ARITHMETIC_OPERATIONS,
    exact_answer,
    length_penalty,
    parse_leading_int,
    solve_arithmetic,
)
from asyncvec.lm.rewards.registry import (
    AsyncRewardInLoopError,
    CombinedReward,
    RewardFn,
    ascore,
    available,
    check_reward,
    get,
    register,
    score,
    unregister,
)
from asyncvec.lm.rewards.service import RewardResult, RewardService, RewardServiceClosedError, RewardServiceStats

__all__ = [
    "ARITHMETIC_OPERATIONS",
    "AsyncRewardInLoopError",
    "BatchScorer",
    "CombinedReward",
    "HFRewardModel",
    "RewardFn",
    "RewardResult",
    "RewardService",
    "RewardServiceClosedError",
    "RewardServiceStats",
    "ascore",
    "available",
    "check_reward",
    "exact_answer",
    "get",
    "length_penalty",
    "parse_leading_int",
    "register",
    "score",
    "solve_arithmetic",
    "unregister",
]
