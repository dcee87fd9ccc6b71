"""GRPO (agents/grpo.py, asyncvec.losses.grpo_advantages): the group-normalized advantages and the
loss against explicit loops, what is left out of a batch, bad options, and learning on single-digit
sums in async mode."""

import math

import numpy as np
import pytest
import torch
from test_inference_policy import no_leftover_threads  # noqa: F401  (autouse fixture)
from test_lm_agents import GROUPS, QUIET, hand_built_batch, sample

from asyncvec.agents import grpo
from asyncvec.inference import build_tiny_lm
from asyncvec.lm import sft_warm_start, training
from asyncvec.lm.prompts import solved_prompts
from asyncvec.losses import grpo_advantages

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("tiny"), n_layer=1, n_embd=32, seed=0)


@pytest.fixture(scope="module")
def warm_dir(tmp_path_factory):
    """As tests/test_lm_agents.py's: a char-level GPT-2 (2 layers, 64 wide) after a short supervised warm start."""
    base = build_tiny_lm(tmp_path_factory.mktemp("base"), n_layer=2, n_embd=64, seed=0)
    return sft_warm_start(base, tmp_path_factory.mktemp("sft"), solved_prompts("asyncvec/SingleDigitSums-v0", 0), 400)


# --------------------------------------------------------------------------- the advantages
def explicit_grpo(rewards, groups, eps=1e-4):
    """``(r_i - mean) / (std + eps)`` over each group, with the sample (n - 1) standard deviation."""
    advantages = []
    for i, g in enumerate(groups):
        mates = [rewards[j] for j in range(len(groups)) if groups[j] == g]
        mean = sum(mates) / len(mates)
        std = math.sqrt(sum((r - mean) ** 2 for r in mates) / (len(mates) - 1))
        advantages.append((rewards[i] - mean) / (std + eps))
    return advantages


def test_grpo_advantages_match_a_plain_loop():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.rand(5, 4, generator=generator)
    rewards[2] = 1.0  # a group whose rewards are all equal: no signal
    expected = [explicit_grpo(row.tolist(), [0] * 4) for row in rewards]
    assert torch.allclose(grpo_advantages(rewards), torch.tensor(expected), atol=1e-6)
    assert (grpo_advantages(rewards)[2] == 0).all()
    # flat rewards with ragged groups in any order
    group_ids = torch.tensor([3, 1, 3, 1, 1, 8, 3, 8])
    flat = torch.randn(8, generator=generator)
    got = grpo_advantages(flat, group_ids=group_ids, eps=1e-2)
    assert torch.allclose(got, torch.tensor(explicit_grpo(flat.tolist(), group_ids.tolist(), eps=1e-2)), atol=1e-6)
    assert not got.requires_grad


@pytest.mark.parametrize(
    "rewards, group_ids, message",
    [
        (torch.ones(3, 1), None, r"\[num_prompts, k\] with k >= 2"),
        (torch.ones(4), None, r"\[num_prompts, k\] with k >= 2"),
        (torch.ones(3), torch.tensor([0, 0, 1]), r"groups \[1\] have one reward"),
        (torch.ones(3), torch.tensor([0, 0]), "two \\[B\\] tensors"),
    ],
)
def test_grpo_advantages_refuse_what_they_cannot_normalize(rewards, group_ids, message):
    with pytest.raises(ValueError, match=message):
        grpo_advantages(rewards, group_ids=group_ids)


def test_the_agent_normalizes_each_group_of_trainable_completions(tiny_dir):
    with grpo.GRPO(grpo.Args(model=str(tiny_dir), group_size=4, **QUIET)) as agent:
        data = training.trainable_batch(hand_built_batch(GROUPS), agent.parts, agent.args, agent.min_group_samples)
        assert data.info["samples_used"] == 7  # the flagged sample is out: a group of 3 and a group of 4
        logp, ref = -torch.rand(data.mask.shape), -torch.rand(data.mask.shape)
        advantages = agent.compute_advantages(data, logp, ref)  # the KL is not in the advantages
    expected = explicit_grpo(data.rewards.tolist(), data.group_ids.tolist())
    for i, row_mask in enumerate(data.mask):
        assert torch.allclose(advantages[i][row_mask], torch.full((int(row_mask.sum()),), expected[i]), atol=1e-6)
        assert (advantages[i][~row_mask] == 0).all()


def test_a_group_left_with_one_trainable_completion_is_not_trained_on(tiny_dir):
    groups = [[sample(1.0, 2), sample(0.0, 3, flagged=True)], [sample(0.0, 2), sample(1.0, 1)]]
    with grpo.GRPO(grpo.Args(model=str(tiny_dir), group_size=2, **QUIET)) as agent:
        data = training.trainable_batch(hand_built_batch(groups), agent.parts, agent.args, agent.min_group_samples)
    assert data.info["samples_used"] == 2 and data.group_ids.tolist() == [1, 1]


# --------------------------------------------------------------------------------- the loss
def test_the_loss_is_the_clipped_objective_less_the_k3_kl_per_token_mean(tiny_dir):
    beta, eps = 0.1, 0.2
    with grpo.GRPO(grpo.Args(model=str(tiny_dir), kl_coef=beta, clip_coef=eps, **QUIET)) as agent:
        mask = torch.tensor([[True, True, False], [True, True, True]])
        prox = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, -1.0, -3.0]])
        logp = torch.tensor([[-0.5, -2.1, -9.0], [-0.5, -1.5, -2.9]], requires_grad=True)
        ref = torch.tensor([[-1.2, -1.8, -1.0], [-0.7, -1.0, -3.5]])
        advantages = torch.tensor([[1.0], [-2.0]]) * mask
        weights = torch.tensor([[1.0, 0.5, 0.0], [2.0, 1.0, 1.0]])
        loss, stats = agent.policy_loss(logp, prox, advantages, weights, mask, ref_logp=ref)
        loss.backward()
    per_completion = []
    for i in range(2):
        terms = []
        for t in range(int(mask[i].sum())):
            rho = math.exp(logp[i, t].item() - prox[i, t].item())
            a = advantages[i, t].item()
            clipped = min(rho * a, min(max(rho, 1 - eps), 1 + eps) * a)
            log_r = ref[i, t].item() - logp[i, t].item()  # log(pi_ref / pi_theta)
            kl = math.exp(log_r) - log_r - 1
            terms.append(weights[i, t].item() * (clipped - beta * kl))
        per_completion.append(sum(terms) / len(terms))
    assert loss.item() == pytest.approx(-sum(per_completion) / 2, abs=1e-6)
    assert stats["kl_loss_term"] > 0 and 0 < stats["clip_fraction"] < 1
    # the KL term pulls toward the reference: at rho = 1 with A = 0 the gradient is beta * w * (1 - pi_ref/pi) / |y| / N
    assert logp.grad[0, 2] == 0  # off the mask


def test_the_kl_term_pulls_the_learner_toward_the_reference(tiny_dir):
    with grpo.GRPO(grpo.Args(model=str(tiny_dir), kl_coef=0.5, **QUIET)) as agent:
        mask = torch.ones(1, 2, dtype=torch.bool)
        logp = torch.tensor([[-1.0, -3.0]], requires_grad=True)
        ref = torch.tensor([[-2.0, -2.0]])  # the reference finds token 0 less likely, token 1 more
        loss, _ = agent.policy_loss(logp, logp.detach(), torch.zeros(1, 2), torch.ones(1, 2), mask, ref_logp=ref)
        loss.backward()
    # d/dlogp of beta * (e^(ref - logp) - (ref - logp) - 1) = beta * (1 - e^(ref - logp)), averaged over 2 tokens
    expected = 0.5 * (1 - torch.exp(ref - logp.detach())) / 2
    assert torch.allclose(logp.grad, expected) and logp.grad[0, 0] > 0 > logp.grad[0, 1]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"clip_coef": 1.5}, r"--clip-coef must be a number in \(0, 1\)"),
        ({"kl_estimator": "k1"}, "--kl-estimator k1 does not regularize as a loss term"),
        ({"group_size": 1}, "--group-size must be an int >= 2"),
    ],
)
def test_bad_arguments_name_the_flag(options, message):
    with pytest.raises(ValueError, match=message):
        grpo.Args(**options)


# ----------------------------------------------------------------------------- learning
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grpo_learns_single_digit_sums_in_async_mode(warm_dir):
    args = grpo.Args(
        model=str(warm_dir),
        mode="async",
        total_prompts=6400,
        target_reward=0.8,
        eval_prompts=400,
        progress=False,
        seed=0,
    )
    result = grpo.GRPO(args).train()
    # The warm start leaves the sampled answers mostly wrong...
    assert result.eval_reward_before < 0.6, result.eval_reward_before
    # ...GRPO brings the mean training reward of the last 10 updates to 0.8, confirmed by a fresh batch.
    assert result.reached_target, f"mean reward of the last updates stayed below 0.8: {result.reward_curve[-20:]}"
    assert np.mean(result.reward_curve[-5:]) >= 0.75
    after, before = result.eval_reward_after, result.eval_reward_before
    assert after >= 0.65 and after - before >= 0.15, (before, after)
    assert result.final_version == result.updates  # every update trained and published
    assert result.stale_fraction == 0.0 and 0 < result.staleness_mean <= 1.0
