"""Off-policy corrections, advantage estimators and policy losses as pure torch functions.

Every function takes tensors and returns tensors; nothing here knows about buffers or
models. Shapes: time-major ``[T, B]`` for V-trace and GAE; ``[..., L]`` (tokens last) with
an optional boolean ``mask`` (True = valid) for token-level functions. Advantages and
importance weights are returned detached; losses keep the graph of ``logp`` only.

Example:
    >>> import torch
    >>> from asyncvec import losses
    >>> target, behavior = torch.tensor([-0.1, -2.0]), torch.tensor([-1.0, -1.0])
    >>> weights, stats = losses.truncated_importance_weights(target, behavior, cap=2.0)
    >>> weights, round(stats["clipped_fraction"].item(), 2)
    (tensor([2.0000, 0.3679]), 0.5)
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "VTraceReturns",
    "approx_kl",
    "clipped_fraction",
    "decoupled_ppo_loss",
    "discounted_returns",
    "effective_sample_size",
    "gae",
    "grpo_advantages",
    "kl_penalized_rewards",
    "masked_mean",
    "masked_normalize",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "truncated_importance_weights",
    "vtrace",
]

Stats = dict[str, Tensor]


# -- helpers and diagnostics ----------------------------------------------------------------
def _check_same_shape(**tensors: Tensor | None) -> None:
    named = [(name, tensor) for name, tensor in tensors.items() if tensor is not None]
    first_name, first = named[0]
    for name, tensor in named[1:]:
        if tensor.shape != first.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(first.shape)} like {first_name}, got {tuple(tensor.shape)}"
            )


def masked_mean(values: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mean of ``values`` over entries where ``mask`` is true (all entries without a mask).

    Example:
        >>> masked_mean(torch.tensor([1.0, 2.0, 9.0]), torch.tensor([True, True, False]))
        tensor(1.5000)
    """
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def effective_sample_size(weights: Tensor, mask: Tensor | None = None) -> Tensor:
    """Normalized effective sample size ``(sum w)^2 / (n * sum w^2)``, in ``(0, 1]``.

    1 means uniform weights; ``1/n`` means a single sample carries all the weight. Only
    entries where ``mask`` is true count. Returns 0 when every weight is zero.

    Example:
        >>> effective_sample_size(torch.tensor([1.0, 1.0, 1.0, 1.0]))
        tensor(1.)
        >>> effective_sample_size(torch.tensor([4.0, 0.0, 0.0, 0.0]))
        tensor(0.2500)
    """
    weights = weights.detach()
    if mask is not None:
        _check_same_shape(weights=weights, mask=mask)
        weights = weights[mask.bool()]
    n = weights.numel()
    squares = (weights * weights).sum()
    if n == 0 or squares == 0:
        return weights.new_zeros(())
    return weights.sum() ** 2 / (n * squares)


def clipped_fraction(
    values: Tensor, low: float | None = None, high: float | None = None, mask: Tensor | None = None
) -> Tensor:
    """Fraction of (valid) entries outside ``[low, high]``.

    Example:
        >>> ratio = torch.tensor([0.7, 1.0, 1.1, 1.5])
        >>> clipped_fraction(ratio, low=0.8, high=1.2)
        tensor(0.5000)
    """
    outside = torch.zeros_like(values, dtype=torch.bool)
    if low is not None:
        outside |= values < low
    if high is not None:
        outside |= values > high
    return masked_mean(outside.to(torch.float32), mask)


# -- importance weights -----------------------------------------------------------------------
def truncated_importance_weights(
    target_logp: Tensor,
    behavior_logp: Tensor,
    cap: float,
    mode: Literal["truncate", "mask"] = "truncate",
    level: Literal["token", "sequence"] = "token",
    mask: Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """Truncated importance weights ``w = min(pi/mu, C)``, computed in log space, detached.

    ``log w = min(log pi - log mu, log C)``. ``mode="mask"`` zeroes the weights whose ratio
    exceeds ``C`` instead of clipping them. ``level="sequence"`` uses the sequence ratio
    ``prod_t pi_t/mu_t = exp(sum_t (log pi_t - log mu_t))`` over the valid tokens of the
    last dimension and returns one weight per sequence (shape without the last dimension).
    Masked-out entries get weight 0.

    Per-token versions (in-flight weight updates): ``behavior_logp[..., t]`` is token ``t``'s
    log-prob under the version ``v_t`` that sampled it, ``log mu_{v_t}(y_t | y_<t)``; the token
    weight is then ``min(pi_t / mu_{v_t,t}, C)`` and the sequence ratio
    ``prod_t pi_t / mu_{v_t,t}``, the exact ratio of a sequence whose tokens span versions.

    Args:
        target_logp: log-probabilities under the policy being trained, ``[..., L]``.
        behavior_logp: log-probabilities under the policy that produced the samples.
        cap: ``C > 0`` (``math.inf`` for plain importance weights).
        mode: ``"truncate"`` or ``"mask"``.
        level: ``"token"`` or ``"sequence"``.
        mask: optional bool mask like ``target_logp``, True on valid entries.

    Returns:
        ``(weights, stats)``; stats (detached scalars): ``clipped_fraction`` (share of valid
        entries whose ratio exceeds ``C``), ``ess`` (normalized effective sample size of the
        returned weights), ``mean_weight``.

    Example:
        >>> target = torch.tensor([[-1.0, -1.0], [-0.5, -3.0]])
        >>> behavior = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
        >>> weights, _ = truncated_importance_weights(target, behavior, cap=1.5, mode="mask")
        >>> weights
        tensor([[1.0000, 0.0000],
                [0.0000, 0.1353]])
        >>> truncated_importance_weights(target, behavior, cap=1.5, level="sequence")[0]
        tensor([1.5000, 0.2231])
    """
    if not cap > 0:
        raise ValueError(f"cap: expected a number > 0, got {cap!r}")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"mode: expected 'truncate' or 'mask', got {mode!r}")
    if level not in ("token", "sequence"):
        raise ValueError(f"level: expected 'token' or 'sequence', got {level!r}")
    _check_same_shape(target_logp=target_logp, behavior_logp=behavior_logp, mask=mask)
    log_ratio = (target_logp - behavior_logp).detach()
    if level == "sequence":
        if log_ratio.dim() == 0:
            raise ValueError("target_logp: level='sequence' needs a token dimension (the last one)")
        if mask is not None:
            log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
            mask = mask.bool().any(dim=-1)
        log_ratio = log_ratio.sum(dim=-1)
    log_cap = math.log(cap)
    over = log_ratio > log_cap
    weights = torch.exp(log_ratio.clamp(max=log_cap))
    if mode == "mask":
        weights = torch.where(over, torch.zeros_like(weights), weights)
    if mask is not None:
        weights = weights * mask.to(weights.dtype)
    stats = {
        "clipped_fraction": masked_mean(over.to(torch.float32), mask),
        "ess": effective_sample_size(weights, mask),
        "mean_weight": masked_mean(weights, mask),
    }
    return weights, stats


# -- value targets and advantages ---------------------------------------------------------------
class VTraceReturns(NamedTuple):
    """V-trace targets ``vs`` and policy-gradient advantages, both ``[T, B]``, detached."""

    vs: Tensor
    pg_advantages: Tensor


def vtrace(
    behavior_logp: Tensor,
    target_logp: Tensor,
    rewards: Tensor,
    values: Tensor,
    bootstrap_value: Tensor,
    discounts: Tensor,
    rho_bar: float | None = 1.0,
    c_bar: float | None = 1.0,
    pg_rho_bar: float | None = None,
) -> VTraceReturns:
    """V-trace off-policy value targets (Espeholt et al. 2018, IMPALA), time-major.

    With ``rho_t = min(rho_bar, pi/mu)``, ``c_t = min(c_bar, pi/mu)`` and
    ``delta_t = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t))``::

        v_s = V(x_s) + delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1}))
        pg_advantage_s = rho_s (r_s + gamma_s v_{s+1} - V(x_s))

    with ``v_T = V(x_T) = bootstrap_value``. ``gamma_t = discounts[t]``, normally
    ``gamma * (1 - terminated[t])``.

    Args:
        behavior_logp, target_logp: ``[T, B]`` log-probabilities of the taken actions under
            the behavior policy ``mu`` and the target policy ``pi``.
        rewards, values, discounts: ``[T, B]``.
        bootstrap_value: ``[B]``, ``V(x_T)``.
        rho_bar, c_bar: truncation levels (None: no truncation).
        pg_rho_bar: truncation of ``rho`` in the advantage; defaults to ``rho_bar``.

    Example:
        >>> T, B = 3, 2
        >>> out = vtrace(torch.zeros(T, B), torch.zeros(T, B), torch.ones(T, B), torch.zeros(T, B),
        ...              torch.zeros(B), torch.full((T, B), 0.5))
        >>> out.vs[:, 0]  # on-policy: discounted returns 1 + .5 + .25, 1 + .5, 1
        tensor([1.7500, 1.5000, 1.0000])
    """
    _check_same_shape(
        behavior_logp=behavior_logp, target_logp=target_logp, rewards=rewards, values=values, discounts=discounts
    )
    with torch.no_grad():
        values_next = _next_values(values, bootstrap_value)
        rhos = torch.exp(target_logp - behavior_logp)
        clipped_rhos = rhos if rho_bar is None else rhos.clamp(max=rho_bar)
        cs = rhos if c_bar is None else rhos.clamp(max=c_bar)
        pg_bar = rho_bar if pg_rho_bar is None else pg_rho_bar
        pg_rhos = rhos if pg_bar is None else rhos.clamp(max=pg_bar)
        deltas = clipped_rhos * (rewards + discounts * values_next - values)
        vs = values + _backward_sums(deltas, discounts * cs, values, bootstrap_value)  # (v_s - V(x_s) summed)
        vs_next = _next_values(vs, bootstrap_value)
        pg_advantages = pg_rhos * (rewards + discounts * vs_next - values)
    return VTraceReturns(vs=vs, pg_advantages=pg_advantages)


def _next_values(values: Tensor, bootstrap_value: Tensor) -> Tensor:
    """``[T, B]`` values of the next step: ``values`` one step on, ``bootstrap_value`` (``V(x_T)``, ``[B]``) last."""
    if values.dim() < 1 or bootstrap_value.shape != values.shape[1:]:
        raise ValueError(
            f"bootstrap_value: expected shape {tuple(values.shape[1:])} (values without time), "
            f"got {tuple(bootstrap_value.shape)}"
        )
    return torch.cat([values[1:], bootstrap_value.unsqueeze(0)], dim=0)


def _backward_sums(terms: Tensor, carry: Tensor, values: Tensor, bootstrap_value: Tensor) -> Tensor:
    """``x_t = terms_t + carry_t * x_{t+1}`` from the last step back, with ``x_T = 0``: time-major, shaped and
    typed as ``values`` (each step's sum as ``bootstrap_value``)."""
    sums = torch.empty_like(values)
    running = torch.zeros_like(bootstrap_value)
    for t in range(terms.shape[0] - 1, -1, -1):
        running = terms[t] + carry[t] * running
        sums[t] = running
    return sums


def gae(
    rewards: Tensor,
    values: Tensor,
    bootstrap_value: Tensor,
    terminated: Tensor,
    truncated: Tensor | None = None,
    *,
    gamma: float = 0.99,
    lam: float = 0.95,
    final_values: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016), time-major ``[T, B]``.

    ::

        next_t  = 0 if terminated[t] else (final_values[t] or 0 if truncated[t] else V(x_{t+1}))
        delta_t = r_t + gamma * next_t - V(x_t)
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1},   done = terminated | truncated

    with ``V(x_T) = bootstrap_value`` and ``returns = A + V``. A truncated episode is cut
    off: its advantage does not flow across the boundary, and it bootstraps from
    ``final_values[t]`` (the value of the real final observation) when given, else from 0
    (as CleanRL does).

    Args:
        rewards, values: ``[T, B]``.
        bootstrap_value: ``[B]``, the value of the observation after the last step.
        terminated: ``[T, B]`` bool. truncated: optional ``[T, B]`` bool.
        gamma, lam: discount and GAE lambda.
        final_values: optional ``[T, B]`` values of the final observations of truncated steps.

    Returns:
        ``(advantages, returns)``, detached.

    Example:
        >>> rewards, values = torch.ones(3, 1), torch.zeros(3, 1)
        >>> done = torch.tensor([[False], [True], [False]])
        >>> advantages, returns = gae(rewards, values, torch.zeros(1), done, gamma=0.5, lam=1.0)
        >>> advantages[:, 0]
        tensor([1.5000, 1.0000, 1.0000])
    """
    _check_same_shape(
        rewards=rewards, values=values, terminated=terminated, truncated=truncated, final_values=final_values
    )
    with torch.no_grad():
        next_values = _next_values(values, bootstrap_value)
        terminated = terminated.bool()
        truncated = torch.zeros_like(terminated) if truncated is None else truncated.bool()
        cut_value = torch.zeros_like(values) if final_values is None else final_values
        next_values = torch.where(truncated, cut_value, next_values)
        next_values = torch.where(terminated, torch.zeros_like(values), next_values)
        deltas = rewards + gamma * next_values - values
        carry = (~(terminated | truncated)).to(values.dtype) * (gamma * lam)
        advantages = _backward_sums(deltas, carry, values, bootstrap_value)
    return advantages, advantages + values


def rloo_advantages(rewards: Tensor) -> Tensor:
    """REINFORCE leave-one-out advantages ``A_i = R_i - mean_{j != i} R_j``.

    Equivalently ``k/(k-1) (R_i - mean_j R_j)``; no division by the standard deviation.
    Put a KL penalty into the rewards first (:func:`kl_penalized_rewards`).

    Args:
        rewards: ``[num_prompts, k]`` rewards of ``k >= 2`` completions per prompt.

    Example:
        >>> rloo_advantages(torch.tensor([[1.0, 0.0, 0.0]]))
        tensor([[ 1.0000, -0.5000, -0.5000]])
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards: expected shape [num_prompts, k] with k >= 2, got {tuple(rewards.shape)}")
    k = rewards.shape[1]
    rewards = rewards.detach()
    return k / (k - 1) * (rewards - rewards.mean(dim=1, keepdim=True))


def grpo_advantages(rewards: Tensor, group_ids: Tensor | None = None, eps: float = 1e-4) -> Tensor:
    """GRPO's group-normalized advantages (Shao et al. 2024, DeepSeekMath; outcome supervision).

    ::

        A_i = (r_i - mean_{j in G(i)} r_j) / (std_{j in G(i)} r_j + eps)

    over the completions ``G(i)`` of the same prompt; ``std`` is the sample standard deviation
    (Bessel-corrected, as in TRL's, OpenRLHF's and verl's GRPO), so a group whose rewards are all
    equal gets 0. Unlike RLOO the KL penalty stays out of the rewards: GRPO adds it to the loss.

    Args:
        rewards: ``[num_prompts, k]`` rewards of ``k >= 2`` completions per prompt, or ``[B]``
            rewards with their ``group_ids``.
        group_ids: ``[B]`` prompt ids of ``[B]`` rewards (groups of any size >= 2, in any order).
        eps: added to the standard deviation.

    Returns:
        Advantages of ``rewards``' shape, detached.

    Example:
        >>> grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]]))
        tensor([[ 1.4997, -0.4999, -0.4999, -0.4999],
                [ 0.0000,  0.0000,  0.0000,  0.0000]])
        >>> grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0]), group_ids=torch.tensor([7, 7, 3, 3, 3]))
        tensor([ 0.7070, -0.7070, -1.1545,  0.5773,  0.5773])
    """
    rewards = rewards.detach()
    if group_ids is None:
        if rewards.dim() != 2 or rewards.shape[1] < 2:
            raise ValueError(f"rewards: expected shape [num_prompts, k] with k >= 2, got {tuple(rewards.shape)}")
        mean, std = rewards.mean(dim=1, keepdim=True), rewards.std(dim=1, keepdim=True)
        return (rewards - mean) / (std + eps)
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards, group_ids: expected two [B] tensors, got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    ids, group = torch.unique(group_ids, return_inverse=True)
    counts = torch.bincount(group, minlength=len(ids)).to(rewards.dtype)
    if bool((counts < 2).any()):
        lone = ids[counts < 2].tolist()
        raise ValueError(f"group_ids: groups {lone} have one reward (a standard deviation needs 2)")
    mean = rewards.new_zeros(len(ids)).index_add_(0, group, rewards) / counts
    squares = rewards.new_zeros(len(ids)).index_add_(0, group, (rewards - mean[group]) ** 2)
    std = torch.sqrt(squares / (counts - 1))
    return (rewards - mean[group]) / (std[group] + eps)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Discounted returns-to-go along the last dim: ``G_t = sum_{i >= t} gamma^(i-t) r_i``.

    Used per turn of multi-turn episodes (``rewards[e, t]``: turn ``t``'s reward). Entries
    where ``mask`` is False (past an episode's end) count as reward 0 and get return 0.

    Args:
        rewards: ``[B, T]`` rewards.
        mask: ``[B, T]`` bool, True on the steps that exist.
        gamma: discount in ``[0, 1]``.

    Example:
        >>> discounted_returns(torch.tensor([[0.0, 0.0, 1.0], [1.0, 5.0, 0.0]]),
        ...                    torch.tensor([[True, True, True], [True, False, False]]), gamma=0.5)
        tensor([[0.2500, 0.5000, 1.0000],
                [1.0000, 0.0000, 0.0000]])
    """
    _check_same_shape(rewards=rewards, mask=mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    rewards = torch.where(mask.bool(), rewards.detach(), torch.zeros_like(rewards))
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    for t in range(rewards.shape[-1] - 1, -1, -1):
        running = rewards[..., t] + gamma * running
        returns[..., t] = running
    return torch.where(mask.bool(), returns, torch.zeros_like(returns))


def masked_normalize(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the entries where ``mask`` is True; 0 elsewhere.

    Example:
        >>> masked_normalize(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([True, True, False]))
        tensor([-1.,  1.,  0.])
    """
    _check_same_shape(values=values, mask=mask)
    mask = mask.bool()
    values = values.detach()
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return torch.where(mask, (values - mean) / torch.sqrt(var + eps), torch.zeros_like(values))


def approx_kl(logp: Tensor, ref_logp: Tensor, estimator: Literal["k1", "k2", "k3"] = "k1") -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi`` (Schulman 2020).

    With ``log r = log pi - log pi_ref``: ``k1 = log r``; ``k2 = (log r)^2 / 2``;
    ``k3 = exp(-log r) - 1 + log r`` (unbiased and never negative).

    Example:
        >>> approx_kl(torch.tensor([-1.0]), torch.tensor([-2.0]), "k3")
        tensor([0.3679])
    """
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"estimator: expected 'k1', 'k2' or 'k3', got {estimator!r}")


def kl_penalized_rewards(
    rewards: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    beta: float,
    mask: Tensor | None = None,
    estimator: Literal["k1", "k2", "k3"] = "k1",
) -> Tensor:
    """Sequence rewards with the KL penalty inside: ``R - beta * sum_t KL_t`` over valid tokens.

    Args:
        rewards: ``[...]`` one reward per sequence (e.g. ``[num_prompts, k]`` for RLOO).
        logp, ref_logp: ``[..., L]`` per-token log-probs under the policy and the reference.
        beta: KL coefficient.
        mask: optional ``[..., L]`` bool, True on valid tokens.

    Example:
        >>> kl_penalized_rewards(torch.tensor([1.0]), torch.tensor([[-1.0, -1.0]]),
        ...                      torch.tensor([[-1.5, -2.0]]), beta=0.1)
        tensor([0.8500])
    """
    _check_same_shape(logp=logp, ref_logp=ref_logp, mask=mask)
    if logp.shape[:-1] != rewards.shape:
        raise ValueError(f"logp: expected shape {tuple(rewards.shape)} + [L], got {tuple(logp.shape)}")
    kl = approx_kl(logp, ref_logp, estimator).detach()
    if mask is not None:
        kl = kl * mask.to(kl.dtype)
    return rewards.detach() - beta * kl.sum(dim=-1)


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    kl: Tensor | None = None,
    beta: float = 0.0,
    baseline: bool = False,
    group_ids: Tensor | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++ advantages (Hu 2025): token rewards, returns-to-go, global normalization.

    ::

        r_t = 1[t = T] * R - beta * KL_t          (T: last valid token of the sequence)
        G_t = sum_{i >= t} r_i
        A_t = (G_t - mean(G)) / sqrt(var(G) + eps)  over all valid tokens of the batch

    ``baseline=True`` (REINFORCE++-baseline) first subtracts from ``R`` the mean reward of
    the sequences with the same ``group_ids`` (the same prompt).

    Args:
        rewards: ``[B]`` final rewards ``R``, or ``[B, L]`` token rewards used as ``r_t``
            (before the KL term).
        mask: ``[B, L]`` bool, True on valid (completion) tokens.
        kl: optional ``[B, L]`` per-token KL estimates (see :func:`approx_kl`).
        beta: KL coefficient.
        baseline: subtract the per-prompt mean of ``R`` (needs ``[B]`` rewards and ``group_ids``).
        group_ids: ``[B]`` int prompt ids.
        eps: variance floor.

    Returns:
        ``[B, L]`` advantages, zero on invalid tokens, detached.

    Example:
        >>> mask = torch.tensor([[True, True, False], [True, True, True]])
        >>> reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask)
        tensor([[ 1.2247,  1.2247,  0.0000],
                [-0.8165, -0.8165, -0.8165]])
    """
    if mask.dim() != 2:
        raise ValueError(f"mask: expected shape [B, L], got {tuple(mask.shape)}")
    valid = mask.bool()
    if not bool(valid.any(dim=1).all()):
        row = int((~valid.any(dim=1)).nonzero()[0])
        raise ValueError(f"mask: row {row} has no valid token")
    with torch.no_grad():
        if rewards.shape == mask.shape:
            if baseline:
                raise ValueError("baseline: needs [B] final rewards, got [B, L] token rewards")
            token_rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
        elif rewards.shape == mask.shape[:1]:
            final = rewards
            if baseline:
                if group_ids is None or group_ids.shape != rewards.shape:
                    raise ValueError(f"group_ids: baseline=True needs [B]={tuple(rewards.shape)} prompt ids")
                _, group = torch.unique(group_ids, return_inverse=True)
                sums = rewards.new_zeros(int(group.max()) + 1).index_add_(0, group, rewards)
                counts = torch.bincount(group).to(rewards.dtype)
                final = rewards - (sums / counts)[group]
            # Index of the last valid token of each row.
            positions = torch.arange(mask.shape[1], device=mask.device).expand_as(valid)
            last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=1).values
            token_rewards = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
            token_rewards[torch.arange(mask.shape[0], device=mask.device), last] = final
        else:
            raise ValueError(
                f"rewards: expected shape [B]=({mask.shape[0]},) or [B, L]={tuple(mask.shape)}, "
                f"got {tuple(rewards.shape)}"
            )
        if kl is not None:
            _check_same_shape(mask=mask, kl=kl)
            token_rewards = token_rewards - beta * torch.where(valid, kl, torch.zeros_like(kl))
        returns = token_rewards.flip(-1).cumsum(-1).flip(-1)
        mean = returns[valid].mean()
        variance = ((returns[valid] - mean) ** 2).mean()
        advantages = (returns - mean) * torch.rsqrt(variance + eps)
        return torch.where(valid, advantages, torch.zeros_like(advantages))


# -- policy losses -------------------------------------------------------------------------------
def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_coef: float = 0.2,
    mask: Tensor | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """PPO clipped surrogate loss ``-E[w * min(r A, clip(r, 1 - eps, 1 + eps) A)]``, ``r = pi/pi_old``.

    ``weights`` (default 1) multiply each sample's surrogate, e.g. truncated importance
    weights; the mean runs over valid entries.

    Returns:
        ``(loss, stats)``; stats (detached): ``clip_fraction`` (share with
        ``|r - 1| > eps``), ``approx_kl`` (k3 estimate of ``KL(pi_old || pi)``),
        ``ratio_mean``.

    Example:
        >>> logp = torch.tensor([-0.5, -1.0], requires_grad=True)
        >>> loss, stats = ppo_clip_loss(logp, torch.tensor([-1.0, -1.0]), torch.tensor([1.0, -1.0]))
        >>> round(loss.item(), 3), stats["clip_fraction"].item()
        (-0.1, 0.5)
    """
    _check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, weights=weights)
    if not clip_coef > 0:
        raise ValueError(f"clip_coef: expected a number > 0, got {clip_coef!r}")
    log_ratio = logp - old_logp.detach()
    ratio = torch.exp(log_ratio)
    advantages = advantages.detach()
    surrogate = torch.min(ratio * advantages, ratio.clamp(1 - clip_coef, 1 + clip_coef) * advantages)
    if weights is not None:
        surrogate = weights.detach() * surrogate
    loss = -masked_mean(surrogate, mask)
    with torch.no_grad():
        stats = {
            "clip_fraction": clipped_fraction(ratio, 1 - clip_coef, 1 + clip_coef, mask),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def decoupled_ppo_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behavior_logp: Tensor,
    advantages: Tensor,
    clip_coef: float = 0.2,
    behavior_cap: float | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """Decoupled PPO (Hilton et al. 2022): clip against a proximal policy, correct for the behavior one.

    ::

        L = -E_mu[ min(pi_prox/mu, C) * min(r A, clip(r, 1 - eps, 1 + eps) A) ],  r = pi/pi_prox

    The behavior weight ``pi_prox/mu`` is detached and truncated at ``C = behavior_cap``
    (no truncation when None). When ``mu = pi_prox`` every weight is 1 and this is PPO.
    Per-token versions: ``mu`` is per token, each token's under the version that sampled it,
    while ``pi_prox`` is one policy for every token, so tokens of any age share one trust region.

    Args:
        logp: log-probs under the policy being trained (with grad).
        prox_logp: log-probs under the proximal policy (e.g. the learner's weights at the
            start of the update).
        behavior_logp: log-probs under the (possibly stale) policy that acted.
        advantages: advantage estimates.
        clip_coef: ``eps``.
        behavior_cap: ``C``.
        mask: optional bool mask, True on valid entries.

    Returns:
        ``(loss, stats)``: :func:`ppo_clip_loss` stats plus ``behavior_weight_mean``,
        ``behavior_clipped_fraction`` and ``behavior_ess``.

    Example:
        >>> logp = torch.tensor([-1.0, -1.0], requires_grad=True)
        >>> prox, adv = torch.tensor([-1.0, -1.0]), torch.tensor([1.0, 2.0])
        >>> decoupled_ppo_loss(logp, prox, torch.tensor([-1.0, -3.0]), adv, behavior_cap=2.0)[0]
        tensor(-2.5000, grad_fn=<NegBackward0>)
    """
    weights, weight_stats = truncated_importance_weights(
        prox_logp, behavior_logp, cap=math.inf if behavior_cap is None else behavior_cap, mask=mask
    )
    loss, stats = ppo_clip_loss(logp, prox_logp, advantages, clip_coef, mask=mask, weights=weights)
    stats["behavior_weight_mean"] = weight_stats["mean_weight"]
    stats["behavior_clipped_fraction"] = weight_stats["clipped_fraction"]
    stats["behavior_ess"] = weight_stats["ess"]
    return loss, stats
