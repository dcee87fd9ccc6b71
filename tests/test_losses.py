"""asyncvec.losses against plain-Python reference computations."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncvec import losses


def random_rollout(seed: int, T: int = 7, B: int = 3):
    g = torch.Generator().manual_seed(seed)
    terminated = torch.rand(T, B, generator=g) < 0.2
    return {
        "behavior_logp": -torch.rand(T, B, generator=g, dtype=torch.float64) * 2,
        "target_logp": -torch.rand(T, B, generator=g, dtype=torch.float64) * 2,
        "rewards": torch.randn(T, B, generator=g, dtype=torch.float64),
        "values": torch.randn(T, B, generator=g, dtype=torch.float64),
        "bootstrap_value": torch.randn(B, generator=g, dtype=torch.float64),
        "terminated": terminated,
        "truncated": (torch.rand(T, B, generator=g) < 0.2) & ~terminated,
        "final_values": torch.randn(T, B, generator=g, dtype=torch.float64),
    }


def vtrace_reference(behavior_logp, target_logp, rewards, values, bootstrap_value, discounts, rho_bar, c_bar):
    """The IMPALA recursion, one scalar at a time."""
    T, B = rewards.shape
    vs = np.zeros((T, B))
    pg = np.zeros((T, B))
    for b in range(B):
        for s in reversed(range(T)):
            ratio = math.exp(target_logp[s, b] - behavior_logp[s, b])
            rho, c = min(rho_bar, ratio), min(c_bar, ratio)
            value_next = bootstrap_value[b] if s == T - 1 else values[s + 1, b]
            vs_next = bootstrap_value[b] if s == T - 1 else vs[s + 1, b]
            gamma = discounts[s, b]
            delta = rho * (rewards[s, b] + gamma * value_next - values[s, b])
            vs[s, b] = values[s, b] + delta + gamma * c * (vs_next - value_next)
            pg[s, b] = rho * (rewards[s, b] + gamma * vs_next - values[s, b])
    return vs, pg


@pytest.mark.parametrize(("seed", "rho_bar", "c_bar"), [(0, 1.0, 1.0), (1, 2.0, 0.5), (2, 0.7, 0.9), (3, 1e9, 1e9)])
def test_vtrace_matches_the_impala_recursion(seed: int, rho_bar: float, c_bar: float) -> None:
    data = random_rollout(seed)
    discounts = 0.9 * (~data["terminated"]).double()
    out = losses.vtrace(
        data["behavior_logp"],
        data["target_logp"],
        data["rewards"],
        data["values"],
        data["bootstrap_value"],
        discounts,
        rho_bar=rho_bar,
        c_bar=c_bar,
    )
    vs, pg = vtrace_reference(
        *(data[k].numpy() for k in ("behavior_logp", "target_logp", "rewards", "values", "bootstrap_value")),
        discounts.numpy(),
        rho_bar,
        c_bar,
    )
    np.testing.assert_allclose(out.vs.numpy(), vs, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out.pg_advantages.numpy(), pg, rtol=1e-10, atol=1e-12)


def test_vtrace_on_policy_gives_bootstrapped_discounted_returns() -> None:
    data = random_rollout(4, T=5, B=2)
    discounts = torch.full((5, 2), 0.8, dtype=torch.float64)
    same = data["behavior_logp"]
    out = losses.vtrace(same, same, data["rewards"], data["values"], data["bootstrap_value"], discounts)
    expected = data["bootstrap_value"].clone()
    for t in reversed(range(5)):
        expected = data["rewards"][t] + 0.8 * expected
        torch.testing.assert_close(out.vs[t], expected)


def gae_reference(rewards, values, bootstrap_value, terminated, truncated, final_values, gamma, lam):
    T, B = rewards.shape
    advantages = np.zeros((T, B))
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            if terminated[t, b]:
                next_value = 0.0
            elif truncated[t, b]:
                next_value = 0.0 if final_values is None else final_values[t, b]
            else:
                next_value = bootstrap_value[b] if t == T - 1 else values[t + 1, b]
            delta = rewards[t, b] + gamma * next_value - values[t, b]
            done = terminated[t, b] or truncated[t, b]
            running = delta + (0.0 if done else gamma * lam * running)
            advantages[t, b] = running
    return advantages


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("use_final_values", [False, True])
def test_gae_matches_a_loop(seed: int, use_final_values: bool) -> None:
    data = random_rollout(seed, T=9, B=4)
    final_values = data["final_values"] if use_final_values else None
    advantages, returns = losses.gae(
        data["rewards"],
        data["values"],
        data["bootstrap_value"],
        data["terminated"],
        data["truncated"],
        gamma=0.97,
        lam=0.9,
        final_values=final_values,
    )
    expected = gae_reference(
        *(data[k].numpy() for k in ("rewards", "values", "bootstrap_value", "terminated", "truncated")),
        None if final_values is None else final_values.numpy(),
        0.97,
        0.9,
    )
    np.testing.assert_allclose(advantages.numpy(), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(returns, advantages + data["values"])


def test_gae_with_lambda_one_and_no_dones_is_the_discounted_return_minus_value() -> None:
    data = random_rollout(5, T=6, B=2)
    no = torch.zeros(6, 2, dtype=torch.bool)
    _, returns = losses.gae(data["rewards"], data["values"], data["bootstrap_value"], no, gamma=0.9, lam=1.0)
    expected = data["bootstrap_value"].clone()
    for t in reversed(range(6)):
        expected = data["rewards"][t] + 0.9 * expected
        torch.testing.assert_close(returns[t], expected)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.floats(-10, 10), min_size=4, max_size=4), min_size=1, max_size=5))
def test_rloo_matches_an_explicit_leave_one_out_mean(rows: list[list[float]]) -> None:
    rewards = torch.tensor(rows, dtype=torch.float64)
    advantages = losses.rloo_advantages(rewards)
    for p, row in enumerate(rows):
        for i, reward in enumerate(row):
            others = [r for j, r in enumerate(row) if j != i]
            assert advantages[p, i].item() == pytest.approx(reward - sum(others) / len(others), abs=1e-9)


def test_kl_penalized_rewards_and_estimators() -> None:
    logp = torch.tensor([[[-1.0, -0.5, -2.0]]])
    ref = torch.tensor([[[-1.5, -0.5, -1.0]]])
    mask = torch.tensor([[[True, True, False]]])
    log_ratio = [0.5, 0.0]
    for estimator, kl in (
        ("k1", log_ratio),
        ("k2", [0.5 * x * x for x in log_ratio]),
        ("k3", [math.exp(-x) - 1 + x for x in log_ratio]),
    ):
        out = losses.kl_penalized_rewards(torch.tensor([[2.0]]), logp, ref, beta=0.5, mask=mask, estimator=estimator)
        assert out.item() == pytest.approx(2.0 - 0.5 * sum(kl))
    assert torch.all(losses.approx_kl(torch.randn(100), torch.randn(100), "k3") >= 0)


def test_k3_is_an_unbiased_kl_estimate() -> None:
    g = torch.Generator().manual_seed(0)
    policy = torch.softmax(torch.randn(5, generator=g, dtype=torch.float64), 0)
    reference = torch.softmax(torch.randn(5, generator=g, dtype=torch.float64), 0)
    samples = torch.multinomial(policy, 200_000, replacement=True, generator=g)
    estimate = losses.approx_kl(policy.log()[samples], reference.log()[samples], "k3").mean()
    exact = (policy * (policy.log() - reference.log())).sum()
    assert estimate.item() == pytest.approx(exact.item(), rel=0.03)


def reinforce_pp_reference(final_rewards, mask, kl, beta, group_ids=None):
    rows = []
    final = list(final_rewards)
    if group_ids is not None:
        means = {g: np.mean([r for r, h in zip(final_rewards, group_ids) if h == g]) for g in set(group_ids)}
        final = [r - means[g] for r, g in zip(final_rewards, group_ids)]
    for b, row_mask in enumerate(mask):
        valid = [t for t, m in enumerate(row_mask) if m]
        token_rewards = [0.0] * len(row_mask)
        for t in valid:
            token_rewards[t] = (final[b] if t == valid[-1] else 0.0) - beta * kl[b][t]
        rows.append([sum(token_rewards[t:]) for t in range(len(row_mask))])
    values = [rows[b][t] for b in range(len(rows)) for t in range(len(rows[b])) if mask[b][t]]
    mean, std = np.mean(values), np.std(values)
    return [[(rows[b][t] - mean) / std if mask[b][t] else 0.0 for t in range(len(rows[b]))] for b in range(len(rows))]


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_matches_an_explicit_computation(baseline: bool) -> None:
    g = torch.Generator().manual_seed(1)
    B, L = 6, 5
    lengths = [5, 3, 1, 4, 2, 5]
    mask = torch.tensor([[t < n for t in range(L)] for n in lengths])
    mask[3] = torch.tensor([False, True, True, True, False])  # left padding too
    final = torch.randn(B, generator=g, dtype=torch.float64)
    kl = torch.rand(B, L, generator=g, dtype=torch.float64)
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2])
    out = losses.reinforce_pp_advantages(
        final, mask, kl=kl, beta=0.1, baseline=baseline, group_ids=group_ids if baseline else None, eps=0.0
    )
    expected = reinforce_pp_reference(
        final.tolist(), mask.tolist(), kl.tolist(), 0.1, group_ids.tolist() if baseline else None
    )
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-9, atol=1e-12)
    assert out[mask].mean().abs() < 1e-9 and out[~mask].abs().sum() == 0


def test_reinforce_pp_token_rewards_and_bad_input() -> None:
    mask = torch.tensor([[True, True], [True, False]])
    token_rewards = torch.tensor([[1.0, 2.0], [3.0, 99.0]], dtype=torch.float64)
    out = losses.reinforce_pp_advantages(token_rewards, mask, eps=0.0)
    returns = np.array([3.0, 2.0, 3.0])  # invalid token rewards are ignored
    np.testing.assert_allclose(out[mask].numpy(), (returns - returns.mean()) / returns.std())
    with pytest.raises(ValueError, match="baseline: needs"):
        losses.reinforce_pp_advantages(token_rewards, mask, baseline=True)
    with pytest.raises(ValueError, match="group_ids"):
        losses.reinforce_pp_advantages(torch.ones(2), mask, baseline=True)
    with pytest.raises(ValueError, match="mask: row 1 has no valid token"):
        losses.reinforce_pp_advantages(torch.ones(2), torch.tensor([[True], [False]]))
    with pytest.raises(ValueError, match="rewards: expected shape"):
        losses.reinforce_pp_advantages(torch.ones(3), mask)


def ppo_reference(logp, old_logp, advantages, clip_coef):
    """CleanRL's formulation: max of the two negated surrogates."""
    ratio = (logp - old_logp).exp()
    return torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean()


def test_decoupled_ppo_equals_standard_ppo_when_behavior_is_proximal() -> None:
    g = torch.Generator().manual_seed(2)
    prox = -torch.rand(64, generator=g, dtype=torch.float64)
    advantages = torch.randn(64, generator=g, dtype=torch.float64)
    logp_a = (prox + 0.3 * torch.randn(64, generator=g, dtype=torch.float64)).requires_grad_()
    logp_b = logp_a.detach().clone().requires_grad_()
    decoupled, stats = losses.decoupled_ppo_loss(logp_a, prox, prox, advantages, clip_coef=0.2, behavior_cap=2.0)
    standard = ppo_reference(logp_b, prox, advantages, 0.2)
    torch.testing.assert_close(decoupled, standard)
    decoupled.backward()
    standard.backward()
    torch.testing.assert_close(logp_a.grad, logp_b.grad)
    assert stats["behavior_weight_mean"].item() == 1.0 and stats["behavior_ess"].item() == pytest.approx(1.0)
    assert 0 < stats["clip_fraction"].item() < 1


def test_decoupled_ppo_weights_each_sample_by_the_truncated_behavior_ratio() -> None:
    g = torch.Generator().manual_seed(3)
    prox = -torch.rand(32, generator=g, dtype=torch.float64)
    behavior = prox + torch.randn(32, generator=g, dtype=torch.float64)
    advantages = torch.randn(32, generator=g, dtype=torch.float64)
    logp = (prox + 0.1 * torch.randn(32, generator=g, dtype=torch.float64)).requires_grad_()
    mask = torch.rand(32, generator=g) < 0.8
    loss, stats = losses.decoupled_ppo_loss(logp, prox, behavior, advantages, behavior_cap=1.5, mask=mask)
    ratio = (logp.detach() - prox).exp()
    weight = (prox - behavior).exp().clamp(max=1.5)
    per_sample = weight * torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    torch.testing.assert_close(loss, -per_sample[mask].mean())
    assert stats["behavior_clipped_fraction"].item() == pytest.approx(
        ((prox - behavior).exp() > 1.5)[mask].double().mean().item()
    )
    loss.backward()
    assert torch.all(logp.grad[~mask] == 0)


@settings(max_examples=40, deadline=None)
@given(
    log_ratios=st.lists(st.floats(-50, 800), min_size=1, max_size=12),
    cap=st.floats(0.05, 20.0),
)
def test_truncation_caps_hold_in_both_modes(log_ratios: list[float], cap: float) -> None:
    log_ratio = torch.tensor(log_ratios, dtype=torch.float64)
    behavior = torch.zeros_like(log_ratio) - 3.0
    target = behavior + log_ratio  # ratios up to e^800: finite only in log space
    truncated, stats = losses.truncated_importance_weights(target, behavior, cap)
    masked, _ = losses.truncated_importance_weights(target, behavior, cap, mode="mask")
    over = log_ratio > math.log(cap)
    assert torch.isfinite(truncated).all() and torch.all(truncated <= cap * (1 + 1e-12))
    torch.testing.assert_close(truncated[over], torch.full_like(truncated[over], cap))
    torch.testing.assert_close(truncated[~over], log_ratio[~over].exp())
    assert torch.all(masked[over] == 0)
    torch.testing.assert_close(masked[~over], truncated[~over])
    assert stats["clipped_fraction"].item() == pytest.approx(over.double().mean().item())
    assert 0 < stats["ess"].item() <= 1 + 1e-12


def test_sequence_level_weights_and_masks() -> None:
    target = torch.tensor([[-1.0, -1.0, -5.0], [-1.0, -2.0, -2.0]])
    behavior = torch.tensor([[-1.5, -1.5, -0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    weights, stats = losses.truncated_importance_weights(target, behavior, cap=2.0, level="sequence", mask=mask)
    # Row 0: exp(0.5 + 0.5) = e > 2 -> 2; row 1: exp(0 - 1 - 1).
    torch.testing.assert_close(weights, torch.tensor([2.0, math.exp(-2.0)]))
    assert stats["clipped_fraction"].item() == 0.5
    token_weights, _ = losses.truncated_importance_weights(target, behavior, cap=2.0, mask=mask)
    assert token_weights[0, 2] == 0 and token_weights.requires_grad is False
    with pytest.raises(ValueError, match="cap"):
        losses.truncated_importance_weights(target, behavior, cap=0.0)
    with pytest.raises(ValueError, match="mode"):
        losses.truncated_importance_weights(target, behavior, cap=1.0, mode="clip")
    with pytest.raises(ValueError, match=r"behavior_logp: expected shape \(2, 3\)"):
        losses.truncated_importance_weights(target, behavior[:, :2], cap=1.0)


def test_weights_are_detached_and_diagnostics() -> None:
    target = torch.tensor([-1.0, -0.5], requires_grad=True)
    weights, _ = losses.truncated_importance_weights(target, torch.tensor([-1.0, -1.0]), cap=10.0)
    assert not weights.requires_grad
    assert losses.effective_sample_size(torch.tensor([1.0, 3.0])).item() == pytest.approx(16 / (2 * 10))
    assert losses.effective_sample_size(torch.tensor([5.0, 1.0]), mask=torch.tensor([False, True])).item() == 1.0
    assert losses.effective_sample_size(torch.zeros(3)).item() == 0.0
    assert losses.clipped_fraction(torch.tensor([0.5, 1.0, 3.0]), high=2.0).item() == pytest.approx(1 / 3)
    assert (
        losses.clipped_fraction(torch.tensor([0.5, 1.0, 3.0]), 0.8, 2.0, torch.tensor([True, True, False])).item()
        == 0.5
    )


def test_shape_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="bootstrap_value"):
        losses.vtrace(*(torch.zeros(3, 2) for _ in range(4)), torch.zeros(3), torch.ones(3, 2))
    with pytest.raises(ValueError, match="terminated"):
        losses.gae(torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(2), torch.zeros(3, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="k >= 2"):
        losses.rloo_advantages(torch.zeros(3, 1))
    with pytest.raises(ValueError, match="estimator"):
        losses.approx_kl(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="advantages"):
        losses.ppo_clip_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2))


def test_docs_examples_run(capsys) -> None:
    markdown = (Path(__file__).parent.parent / "docs" / "losses.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", markdown, flags=re.DOTALL)
    assert len(blocks) >= 4
    for block in blocks:
        exec(compile(block, "docs/losses.md", "exec"), {})
    assert "tensor([2.0000, 1.2214])" in capsys.readouterr().out
