"""PPO's settings chosen by a rule, not by env id: the named presets (``--preset``) and the off-policy correction
(``--correction``: which one a run uses, and its policy loss).

``mu`` is the behavior policy that acted, ``pi_prox`` the learner's policy at the start of the update, ``pi`` the one
being trained (the module docstring of agents/ppo.py states each loss).
"""

from __future__ import annotations

import math

import gymnasium as gym
import torch

from asyncvec.losses import decoupled_ppo_loss, ppo_clip_loss, truncated_importance_weights

# Opt-in named settings (``--preset NAME``), never applied by env id. A preset sets the fields a user
# left at their default; anything passed with another value wins. Side by side:
# "cleanrl": CleanRL's ppo.py (classic control): 128 steps/env, 4 minibatches x 4 epochs, an entropy bonus;
# "cleanrl-continuous": its ppo_continuous_action.py (MuJoCo): 2,048 steps per update, 32 minibatches x 10 epochs.
_PRESET_NAMES = ("cleanrl", "cleanrl-continuous")
_PRESET_VALUES: dict[str, tuple[object, object]] = {
    "num_steps": (128, 256),
    "learning_rate": (2.5e-4, 3e-4),
    "gamma": (0.99, 0.99),
    "gae_lambda": (0.95, 0.95),
    "num_minibatches": (4, 32),
    "update_epochs": (4, 10),
    "ent_coef": (0.01, 0.0),
    "target_kl": (None, None),
    "normalize_obs": (False, True),
    "normalize_rewards": (False, True),
    "clip_vloss": (True, True),
}
PRESETS: dict[str, dict[str, object]] = {
    name: {field: values[column] for field, values in _PRESET_VALUES.items()}
    for column, name in enumerate(_PRESET_NAMES)
}


def chosen_correction(
    correction: str, is_cap: float | None, mode: str, max_staleness: int, action_space: gym.Space
) -> tuple[str, float]:
    """The correction and importance-weight cap a run uses: ``--correction`` and ``--is-cap`` as given, ``auto``
    and ``None`` resolved by a fixed rule (measured on a suite of tasks, docs/agents.md "Async at lag 1 by
    construction"). At async ``--max-staleness 1`` every sample is one version old; a Gaussian policy (Box actions)
    then learns with ``decoupled`` (the clip centred on the learner, untruncated weights ``pi_prox/mu``), while
    ``tis`` (the clip centred on the acting policy) kept the Gaussian wide: 1.7x sync's env steps on Pendulum, and
    a fifth of sync's return on InvertedDoublePendulum after 100k steps. Everywhere else (sync, lag 0, a categorical
    policy, partial batches above 1) ``tis``, with ``C = 2``.

    Example:
        >>> box = gym.spaces.Box(-1, 1, (1,))
        >>> chosen_correction("auto", None, "async", 1, box), chosen_correction("auto", None, "sync", 1, box)
        (('decoupled', inf), ('tis', 2.0))
        >>> chosen_correction("auto", 3.0, "async", 1, gym.spaces.Discrete(2))
        ('tis', 3.0)
    """
    if correction == "auto":
        one_version_old = mode == "async" and max_staleness == 1
        correction = "decoupled" if one_version_old and isinstance(action_space, gym.spaces.Box) else "tis"
    if is_cap is not None:
        return correction, float(is_cap)
    return correction, math.inf if correction == "decoupled" else 2.0


def corrected_policy_loss(
    correction: str,
    is_cap: float,
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip: float,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped policy loss of ``correction`` (``none``, ``tis``, ``vtrace`` or ``decoupled``) on a minibatch, and
    its importance-weight statistics (``is_weight_mean``, ``is_clipped_fraction``, ``is_ess``) where it has weights."""
    if correction == "decoupled":
        loss, stats = decoupled_ppo_loss(
            logp, prox_logp, behavior_logp, advantages, clip, behavior_cap=is_cap, mask=mask
        )
        stats["is_weight_mean"] = stats.pop("behavior_weight_mean")
        stats["is_clipped_fraction"] = stats.pop("behavior_clipped_fraction")
        stats["is_ess"] = stats.pop("behavior_ess")
        return loss, stats
    if correction == "vtrace":
        return ppo_clip_loss(logp, prox_logp, advantages, clip, mask=mask)
    if correction == "tis":
        ratio = torch.exp(logp - behavior_logp)
        surrogate = torch.min(ratio.clamp(max=is_cap) * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
        _, w_stats = truncated_importance_weights(logp.detach(), behavior_logp, is_cap, mask=mask)
        return -surrogate[mask].mean(), {
            "is_weight_mean": w_stats["mean_weight"],
            "is_clipped_fraction": w_stats["clipped_fraction"],
            "is_ess": w_stats["ess"],
        }
    return ppo_clip_loss(logp, behavior_logp, advantages, clip, mask=mask)
