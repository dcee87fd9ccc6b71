"""RLOO and REINFORCE++ on language-model policies: learning on single-digit sums (async mode),
advantages and losses against explicit computations, stale/flagged sample handling, weight
publishing, bad input, an `asyncvec serve` backend, clean shutdown."""

import dataclasses
import math
import time

import gymnasium as gym
import httpx
import numpy as np
import pytest
import torch
from test_inference_policy import no_leftover_threads  # noqa: F401  (autouse fixture)

from asyncvec.agents import reinforce_pp, rloo
from asyncvec.buffers import CompletionGroups
from asyncvec.inference import AsyncvecServer, HFTextPolicy, PolicyOutput, build_tiny_lm
from asyncvec.lm import completion_logps, evaluation, load_causal_lm, rewards, sft_warm_start, training
from asyncvec.lm.groups import ScoredCompletion
from asyncvec.lm.prompts import iter_prompts, make_prompt_env, solved_prompts
from asyncvec.lm.results import summary

pytestmark = pytest.mark.timeout(240)

QUIET = {"progress": False, "eval_prompts": 0, "mode": "sync"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("tiny"), n_layer=1, n_embd=32, seed=0)


@pytest.fixture(scope="module")
def warm_dir(tmp_path_factory):
    """The demo's setup: a char-level GPT-2 (2 layers, 64 wide) after a short supervised warm start."""
    base = build_tiny_lm(tmp_path_factory.mktemp("base"), n_layer=2, n_embd=64, seed=0)
    return sft_warm_start(base, tmp_path_factory.mktemp("sft"), solved_prompts("asyncvec/SingleDigitSums-v0", 0), 400)


# ------------------------------------------------------------------------------ learning
@pytest.mark.slow
@pytest.mark.timeout(600)  # about a minute each on an idle 2-core machine, with room for a loaded one
@pytest.mark.parametrize(
    "agent, options",
    [
        (rloo.RLOO, {}),
        (reinforce_pp.ReinforcePP, {"kl_coef": 0.01}),
    ],
    ids=["rloo", "reinforce_pp"],
)
def test_agent_learns_single_digit_sums_in_async_mode(agent, options, warm_dir):
    args_cls = rloo.Args if agent is rloo.RLOO else reinforce_pp.Args
    args = args_cls(
        model=str(warm_dir),
        mode="async",
        total_prompts=6400,
        # 0.85 was reached after 362 of the 400 updates under a load of 4 on 2 cores, and missed once in CI
        target_reward=0.8,
        eval_prompts=400,
        progress=False,
        seed=0,
        **options,
    )
    result = agent(args).train()
    # The warm start leaves the sampled answers mostly wrong (measured: 0.40-0.54 over seeds)...
    assert result.eval_reward_before < 0.6, result.eval_reward_before
    # ...RL brings the mean reward of the last 5 updates (640 completions) to >= 0.8.
    assert result.reached_target, f"mean reward of the last 5 updates stayed below 0.8: {result.reward_curve[-20:]}"
    assert np.mean(result.reward_curve[-5:]) >= 0.75
    # 400 fresh completions of the final policy agree (measured 0.79-0.87, and 0.685 once in a fresh-clone
    # `make test` on 2026-12-04: stopping at a high point of a noisy curve makes them lower than the training
    # mean). The gain over the warm start is the sharp part: it stays >= 0.15.
    after, before = result.eval_reward_after, result.eval_reward_before
    assert after >= 0.65 and after - before >= 0.15, (before, after)
    assert result.final_version == result.updates  # every update trained and published
    assert result.stale_fraction == 0.0 and 0 < result.staleness_mean <= 1.0  # async: one version behind
    assert result.flagged_fraction == 0.0 and result.samples_per_s > 0


# ---------------------------------------------------------------------- hand-built batches
def output(token_ids, token_logps, version=0):
    if token_ids is None:  # the policy's deadline passed: the fallback action, nothing sampled
        return PolicyOutput(action="", behavior_logp=0.0, policy_version=version, latency_s=1.0, fallback=True)
    return PolicyOutput(
        action="7",
        behavior_logp=float(sum(token_logps)),
        policy_version=version,
        latency_s=0.0,
        text="7",
        token_ids=tuple(token_ids),
        token_logps=tuple(token_logps),
    )


def prepare(agent, groups):
    """What ``agent.update`` trains on: RLOO keeps groups of 2 trainable samples or more (its baseline)."""
    return training.trainable_batch(groups, agent.parts, agent.args, 2 if isinstance(agent, rloo.RLOO) else 1)


def hand_built_batch(groups, prompt="3+4="):
    """``groups``: per prompt, a list of (reward, token_ids, behavior_logps, version, flagged)."""
    buffer = CompletionGroups(len(groups[0]))
    for prompt_id, samples in enumerate(groups):
        for reward, token_ids, logps, version, flagged in samples:
            completion = ScoredCompletion(prompt, output(token_ids, logps, version), reward, flagged)
            buffer.add(prompt_id, completion, reward, logps, version)
    return buffer.pop(len(groups), timeout=0)


def sample(reward, length, version=0, flagged=False):
    return (reward, [10 + i for i in range(length - 1)] + [1], [-0.5] * length, version, flagged)


def missed(version=0):
    """A request answered by the deadline fallback."""
    return (0.0, None, [], version, False)


GROUPS = [
    [sample(1.0, 2), sample(0.0, 3), sample(0.0, 1, flagged=True), sample(1.0, 2)],
    [sample(0.0, 2), sample(1.0, 1), sample(0.0, 3), sample(1.0, 2)],
]


def explicit_rloo(rewards_, groups, logp, ref, mask, beta):
    penalized = [r - beta * float(((lp - rf) * m).sum()) for r, lp, rf, m in zip(rewards_, logp, ref, mask)]
    advantages = []
    for i, g in enumerate(groups):
        others = [penalized[j] for j in range(len(groups)) if groups[j] == g and j != i]
        advantages.append(penalized[i] - sum(others) / len(others))
    return advantages


def test_rloo_advantages_match_the_leave_one_out_formula(tiny_dir):
    with rloo.RLOO(rloo.Args(model=str(tiny_dir), kl_coef=0.1, group_size=4, **QUIET)) as agent:
        data = prepare(agent, hand_built_batch(GROUPS))
        assert data.info["samples_used"] == 7  # the flagged sample is out
        torch.manual_seed(0)
        logp, ref = -torch.rand(data.mask.shape), -torch.rand(data.mask.shape)
        advantages = agent.compute_advantages(data, logp * data.mask, ref * data.mask)
    expected = explicit_rloo(data.rewards.tolist(), data.group_ids.tolist(), logp, ref, data.mask, beta=0.1)
    for i, row_mask in enumerate(data.mask):
        assert torch.allclose(advantages[i][row_mask], torch.full((int(row_mask.sum()),), expected[i]), atol=1e-6)
        assert (advantages[i][~row_mask] == 0).all()


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_token_advantages_match_explicit_returns(tiny_dir, baseline):
    beta = 0.05
    with reinforce_pp.ReinforcePP(
        reinforce_pp.Args(
            model=str(tiny_dir), kl_coef=beta, group_size=4, baseline=baseline, kl_estimator="k1", **QUIET
        )
    ) as agent:
        data = prepare(agent, hand_built_batch(GROUPS))
        torch.manual_seed(1)
        logp, ref = -torch.rand(data.mask.shape), -torch.rand(data.mask.shape)
        advantages = agent.compute_advantages(data, logp, ref)
    rewards_, groups = data.rewards.tolist(), data.group_ids.tolist()
    returns = {}
    for i, row_mask in enumerate(data.mask):
        final = rewards_[i]
        if baseline:
            mates = [rewards_[j] for j in range(len(groups)) if groups[j] == groups[i]]
            final -= sum(mates) / len(mates)
        length = int(row_mask.sum())
        token_rewards = [
            (final if t == length - 1 else 0.0) - beta * float(logp[i, t] - ref[i, t]) for t in range(length)
        ]
        for t in range(length):
            returns[i, t] = sum(token_rewards[t:])
    values = list(returns.values())
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values) + 1e-8)
    for (i, t), value in returns.items():
        assert advantages[i, t].item() == pytest.approx((value - mean) / std, abs=1e-5)
    assert (advantages[~data.mask] == 0).all()


def test_rloo_loss_is_the_importance_weighted_sequence_log_likelihood(tiny_dir):
    with rloo.RLOO(rloo.Args(model=str(tiny_dir), **QUIET)) as agent:
        mask = torch.tensor([[True, True, False], [True, True, True]])
        prox = -torch.rand(2, 3)
        logp = prox.clone().requires_grad_(True)
        advantages = torch.tensor([[0.5], [-1.5]]) * mask
        weights = torch.tensor([[1.0, 2.0, 0.0], [0.5, 1.0, 1.0]])
        loss, _ = agent.policy_loss(logp, prox, advantages, weights, mask)
        loss.backward()
    # -mean over completions of sum over tokens of w * A * pi/pi_prox, at pi = pi_prox
    assert loss.item() == pytest.approx(-(0.5 * (1.0 + 2.0) + -1.5 * (0.5 + 1.0 + 1.0)) / 2)
    assert torch.allclose(logp.grad, -(weights * advantages * mask) / 2)


def test_flagged_samples_stay_out_of_advantages_and_loss(tiny_dir):
    def with_flagged_reward(value):
        return [[(value, *s[1:]) if s[4] else s for s in group] for group in GROUPS]

    with rloo.RLOO(rloo.Args(model=str(tiny_dir), **QUIET)) as agent:
        results = []
        for value in (100.0, -50.0):
            data = prepare(agent, hand_built_batch(with_flagged_reward(value)))
            assert data.info["samples_used"] == 7 and value not in data.rewards.tolist()
            advantages = agent.compute_advantages(data, torch.zeros(data.mask.shape), None)
            loss, _ = agent.policy_loss(
                torch.zeros(data.mask.shape), torch.zeros(data.mask.shape), advantages, data.mask.float(), data.mask
            )
            results.append((advantages, loss))
    # whatever the flagged sample's stand-in reward, nothing the learner computes changes
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1]


def test_rewarder_errors_and_timeouts_are_flagged_and_not_trained_on(tiny_dir):
    @rewards.register("test_lm_fails_on_zero")
    def fails_on_zero(prompt, completion, **info):
        if prompt.startswith("0+"):
            raise RuntimeError("no score for 0+x")
        return rewards.exact_answer(prompt, completion)

    @rewards.register("test_lm_slow")
    def slow(prompt, completion, **info):
        time.sleep(0.3)
        return 0.0

    try:
        args = rloo.Args(model=str(tiny_dir), reward="test_lm_fails_on_zero", total_prompts=64, group_size=2, **QUIET)
        prompts = iter_prompts(make_prompt_env(args.env), args.seed)
        zeros = sum(next(prompts).startswith("0+") for _ in range(64))
        result = rloo.RLOO(args).train()
        assert zeros > 0 and result.flagged_fraction == pytest.approx(zeros * 2 / result.samples)
        used = sum(row["samples_used"] for row in result.history)
        assert used == result.samples - 2 * zeros  # flagged out; each zero-prompt group loses both samples

        timeouts = rloo.Args(
            model=str(tiny_dir),
            reward="test_lm_slow",
            reward_timeout_s=0.05,
            total_prompts=2,
            prompts_per_update=2,
            group_size=2,
            **QUIET,
        )
        result = rloo.RLOO(timeouts).train()
        assert result.flagged_fraction == 1.0 and result.history[0]["samples_used"] == 0
        assert result.final_version == 0  # nothing learned, nothing published
    finally:
        rewards.unregister("test_lm_fails_on_zero")
        rewards.unregister("test_lm_slow")


def test_deadline_misses_are_never_trained_on(tiny_dir):
    """A request answered by the policy's deadline fallback has nothing sampled: it stays out of the
    rows, the baselines, the loss and the batch's mean reward; its group keeps the others."""
    groups = [
        [sample(1.0, 2), missed(), sample(0.0, 3), sample(1.0, 2)],
        [missed(), sample(1.0, 1), missed(), missed()],  # one trainable completion left
    ]
    with rloo.RLOO(rloo.Args(model=str(tiny_dir), group_size=4, **QUIET)) as agent:
        data = prepare(agent, hand_built_batch(groups))
        # RLOO: the second group has no leave-one-out baseline left and is skipped whole
        assert data.info["missed_deadlines"] == 4 and data.info["samples_used"] == 3
        assert data.group_ids.tolist() == [0, 0, 0] and data.info["reward"] == pytest.approx(0.75)
        got = agent.compute_advantages(data, torch.zeros(data.mask.shape), None)
        alone = prepare(agent, hand_built_batch([[sample(1.0, 2), sample(0.0, 3), sample(1.0, 2)]]))
        assert torch.equal(got, agent.compute_advantages(alone, torch.zeros(alone.mask.shape), None))
    with reinforce_pp.ReinforcePP(reinforce_pp.Args(model=str(tiny_dir), group_size=4, **QUIET)) as agent:
        data = prepare(agent, hand_built_batch(groups))
        assert data.info["samples_used"] == 4 and data.group_ids.tolist() == [0, 0, 0, 1]
        assert data.mask.sum(-1).tolist() == [2, 3, 2, 1]  # no row of a missed request


def test_a_run_whose_requests_all_miss_the_deadline_trains_on_nothing(tiny_dir):
    # The batcher waits 5 s to fill a batch, the deadline is 1 ms: every request gets the fallback, none is
    # sampled or scored (the batcher drops requests that were answered while they waited).
    args = rloo.Args(
        model=str(tiny_dir),
        deadline_ms=1.0,
        policy_wait_ms=5000.0,
        total_prompts=4,
        prompts_per_update=2,
        group_size=2,
        **QUIET,
    )
    result = rloo.RLOO(args).train()
    assert result.missed_deadline_fraction == 1.0 and result.samples == 8
    assert [row["samples_used"] for row in result.history] == [0, 0] and result.final_version == 0


# ------------------------------------------------------------------------- staleness, IS
def test_stale_groups_are_dropped_and_counted(tiny_dir):
    with rloo.RLOO(rloo.Args(model=str(tiny_dir), max_staleness=1, group_size=2, **QUIET)) as agent:
        for _ in range(3):
            agent.publish()  # learner at version 3
        batch = hand_built_batch(
            [
                [sample(1.0, 2, version=1), sample(0.0, 2, version=2)],  # staleness 2: dropped
                [sample(1.0, 2, version=2), sample(0.0, 2, version=2)],  # staleness 1: kept
                [sample(1.0, 2, version=3), sample(0.0, 2, version=3)],
            ]
        )
        data = prepare(agent, batch)
        assert data.info["stale_groups"] == 1 and data.info["samples_used"] == 4
        assert sorted(set(data.group_ids.tolist())) == [1, 2]
        stats = agent.versions.staleness_stats()
        assert stats.dropped == 2 and stats.histogram[:3] == [2, 3, 1]


def test_a_slow_weight_broadcast_makes_samples_stale(tiny_dir):
    # The policy gets each version one update late; with max_staleness 0 only the first batch is fresh.
    args = rloo.Args(
        model=str(tiny_dir),
        policy_lag=1,
        max_staleness=0,
        total_prompts=12,
        prompts_per_update=4,
        group_size=2,
        **QUIET,
    )
    result = rloo.RLOO(args).train()
    assert result.updates == 3 and result.stale_fraction == pytest.approx(2 / 3) and result.final_version == 1


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_weights_against_the_engine_logps_are_truncated_and_counted(tiny_dir, level):
    with rloo.RLOO(rloo.Args(model=str(tiny_dir), is_cap=2.0, is_level=level, group_size=2, **QUIET)) as agent:
        batch = hand_built_batch([[sample(1.0, 2), sample(0.0, 3)], [sample(1.0, 1), sample(0.0, 2)]])
        data = prepare(agent, batch)
        with torch.no_grad():
            learner = data.logps(agent.learner, agent.args.temperature)
        # the engine reports the learner's log-probs except one token it found e^3 times less likely
        for row, samples in enumerate(batch.completions):
            for i, s in enumerate(samples):
                logps = learner[2 * row + i][: len(s.output.token_ids)].tolist()
                if (row, i) == (0, 1):
                    logps[1] -= 3.0
                samples[i] = ScoredCompletion(s.prompt, output(s.output.token_ids, logps), s.reward, s.flagged)
        stats = agent.update(batch)
        entries = 4 if level == "sequence" else 8
        assert stats["is/clipped"] == 1 and stats["is/entries"] == entries
        assert stats["is/clipped_fraction"] == pytest.approx(1 / entries)


def test_learner_logps_match_the_sampled_token_logps(tiny_dir):
    """Fresh weights on both sides: pi_learner / mu = 1 for every sampled token."""
    with reinforce_pp.ReinforcePP(reinforce_pp.Args(model=str(tiny_dir), max_new_tokens=5, **QUIET)) as agent:
        data = prepare(agent, agent.collector.collect(6, timeout=60))
        with torch.no_grad():
            learner = data.logps(agent.learner, agent.args.temperature)
    assert data.mask.sum() > 6 and torch.allclose(learner, data.behavior_logp, atol=1e-4)


# ------------------------------------------------------------------------------ versions
def test_each_update_publishes_a_version_the_policy_answers_with(tiny_dir):
    with rloo.RLOO(rloo.Args(model=str(tiny_dir), group_size=2, **QUIET)) as agent:
        for expected in (1, 2):
            agent.update(agent.collector.collect(4, timeout=60))
            assert agent.publish() == expected
            answer = agent.policy.submit("3+4=").result(timeout=30)
            assert answer.policy_version == expected
        served = agent.policy.model.state_dict()
        for name, tensor in agent.learner.state_dict().items():
            assert torch.equal(served[name], tensor), name
        batch = agent.collector.collect(2, timeout=60)
        assert (batch.policy_version == 2).all()
    result = rloo.RLOO(
        rloo.Args(
            model=str(tiny_dir), total_prompts=12, prompts_per_update=4, group_size=2, **{**QUIET, "mode": "async"}
        )
    ).train()
    assert [row["charts/version"] for row in result.history] == [1, 2, 3] and result.final_version == 3


# ------------------------------------------------------------------------------ --target-reward
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_target_is_confirmed_by_a_batch_of_the_current_weights_only(tiny_dir, mode):
    args = rloo.Args(model=str(tiny_dir), group_size=2, prompts_per_update=2, **{**QUIET, "mode": mode})
    with rloo.RLOO(args) as agent:
        if mode == "async":
            agent.collector.start(100, ahead=2)
        for _ in range(2):  # two versions; in async mode the groups in flight meanwhile are older
            agent.update(agent.collector.pop(2, timeout=60) if mode == "async" else agent.collector.collect(2, 60))
            agent.publish()
        check = evaluation.confirm_target(agent.parts, dataclasses.replace(args, target_reward=2.0), prompts_left=100)
        # rewards are 0 or 1: 2.0 less the default tolerance 0.1 cannot be reached; the batch is returned to train on
        assert not check.confirmed and 0 <= check.reward <= 1 and check.popped >= 2
        assert (check.batch.staleness(agent.versions.current_version) == 0).all()
        if mode == "sync":
            assert check.popped == 2  # nothing in flight: the first batch is the current weights'
        assert evaluation.confirm_target(agent.parts, dataclasses.replace(args, target_reward=0.0), 100).confirmed
        ran_out = evaluation.confirm_target(agent.parts, args, prompts_left=1)  # less than prompts_per_update left
        assert ran_out.batch is None and ran_out.popped == 0 and not ran_out.confirmed


def test_a_run_stops_only_once_a_batch_of_the_final_weights_confirms_the_target(tiny_dir, monkeypatch):
    calls, real_check = [], evaluation.confirm_target

    def first_falls_short(*args, **kwargs):  # the real check; its first verdict turned into a miss
        check = real_check(*args, **kwargs)
        calls.append(check)
        return dataclasses.replace(check, confirmed=False) if len(calls) == 1 else check

    monkeypatch.setattr(training, "confirm_target", first_falls_short)  # where TrainingRun looks it up
    args = rloo.Args(
        model=str(tiny_dir), group_size=2, prompts_per_update=2, total_prompts=80, target_reward=-1.0,
        **{**QUIET, "mode": "async"},
    )  # fmt: skip
    result = rloo.RLOO(args).train()
    # 10 updates reach the (trivial) target; the first confirming batch is made to fall short and is
    # trained on (update 11); the second confirms it
    assert result.updates == 11 and result.reached_target and len(calls) == 2
    assert result.target_confirmations == [c.reward for c in calls]
    assert "target reached (checked on batches sampled by the weights of the moment: [" in summary("RLOO", result)
    budget = rloo.Args(
        model=str(tiny_dir), group_size=2, prompts_per_update=2, total_prompts=20, target_reward=-1.0, **QUIET
    )
    short = rloo.RLOO(budget).train()  # the target is reached on the last prompts: none are left to confirm it
    assert short.updates == 10 and not short.reached_target and math.isnan(short.target_confirmations[0])


@pytest.fixture(scope="module")
def asyncvec_server(tmp_path_factory):
    """`asyncvec serve` in a subprocess, loading new weights from its --weights-dir."""
    root = tmp_path_factory.mktemp("serve")
    model_dir = build_tiny_lm(root / "tiny", n_layer=1, n_embd=32, seed=0)
    (root / "weights").mkdir()
    with AsyncvecServer(model_dir, weights_dir=root / "weights", token="test-token") as server:
        yield {"url": server.url, "model_dir": model_dir, "weights_dir": root / "weights"}


def test_training_through_an_asyncvec_server(asyncvec_server, tmp_path):
    server = asyncvec_server
    args = rloo.Args(
        model=str(server["model_dir"]),
        backend="openai",
        base_url=server["url"],
        weights_dir=str(server["weights_dir"]),
        update_token="test-token",
        total_prompts=6,
        prompts_per_update=3,
        group_size=2,
        output_dir=str(tmp_path / "trained"),
        **{**QUIET, "mode": "async"},
    )
    first = rloo.RLOO(args).train()
    # version 1: the learner's starting weights, sent before training; then one version per update
    assert first.updates == 2 and first.samples >= 12 and (first.start_version, first.final_version) == (1, 3)
    assert httpx.get(server["url"] + "/weight_info", timeout=10).json()["weight_version"] == "3"
    # A second run against the same server first replaces the trained weights with its own starting ones.
    second = rloo.RLOO(args).train()
    assert (second.start_version, second.final_version) == (4, 6)
    policy_versions = {row["charts/version"] for row in second.history}
    assert policy_versions == {5, 6}


def test_multi_turn_episodes_through_an_asyncvec_server(asyncvec_server, tmp_path):
    # GuessNumber played through `asyncvec serve` (token-id prompts over HTTP), a version published per update
    # while the next episodes are in flight: every turn carries the version that sampled it.
    server = asyncvec_server
    args = rloo.Args(
        model=str(server["model_dir"]), backend="openai", base_url=server["url"], weights_dir=str(server["weights_dir"]),
        update_token="test-token", env="asyncvec/GuessNumber-v0",
        env_kwargs='{"max_number": 8, "max_turns": 3, "transcript": false}', max_new_tokens=3,
        total_prompts=6, prompts_per_update=2, group_size=2, num_envs=4, progress=False, eval_prompts=0, mode="async",
    )  # fmt: skip
    agent = rloo.RLOO(args)
    popped = []
    update = agent.update
    agent.update = lambda groups: (popped.append(groups), update(groups))[1]
    result = agent.train()
    assert result.updates == 3 and result.final_version == result.start_version + 3
    assert httpx.get(server["url"] + "/weight_info", timeout=10).json()["weight_version"] == str(result.final_version)
    turns = 0
    for groups in popped:
        for episode in (e for group in groups.episodes for e in group):
            assert (episode.terminated or episode.truncated) and not episode.env_error
            versions = [t.policy_version for t in episode.turns]
            assert versions == sorted(versions) and result.start_version <= versions[0] < result.final_version
            for turn, later in zip(episode.turns, episode.turns[1:]):  # the history is never re-tokenized
                assert (
                    later.prompt_ids[: len(turn.prompt_ids) + len(turn.completion_ids)]
                    == turn.prompt_ids + turn.completion_ids
                )
            for turn in episode.turns:
                assert len(turn.completion_logps) == len(turn.completion_ids) > 0 and max(turn.completion_logps) <= 0.0
                turns += 1
    assert (
        turns >= 3 * 2 * 2
        and max(t.policy_version for g in popped[-1].episodes for e in g for t in e.turns) > result.start_version
    )


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"env": "asyncvec/SingleDigitSum-v0"}, ValueError, "did you mean asyncvec/SingleDigitSums-v0"),
        ({"env": "CartPole-v1"}, ValueError, "not gymnasium.spaces.Text; wrap the env in asyncvec.lm.TextEnv"),
        ({"env": "Pendulum-v1"}, ValueError, "not gymnasium.spaces.Text; wrap it in a gymnasium wrapper"),
        (
            {"env": "asyncvec/GuessNumber-v0", "is_level": "sequence"},
            ValueError,
            "multi-turn episodes use --is-level token",
        ),
        ({"reward": "no_such_plugin"}, ValueError, "no reward plugin named 'no_such_plugin'"),
        ({"model": "/nonexistent/model"}, FileNotFoundError, "--model /nonexistent/model"),
        ({"backend": "openai", "base_url": "http://127.0.0.1:9"}, ValueError, "--base-url http://127.0.0.1:9"),
    ],
)
def test_bad_setup_fails_fast_with_a_clear_error(tiny_dir, options, error, message):
    with pytest.raises(error, match=message):
        rloo.RLOO(rloo.Args(**{"model": str(tiny_dir), **QUIET, **options}))


@pytest.mark.parametrize("env", ["asyncvec/SingleDigitSums-v0", "asyncvec/GuessNumber-v0"])
def test_a_given_policy_must_sample_as_the_learner_scores(tiny_dir, env):
    # the learner's log-probs (and so the importance weights) assume --temperature and no top-p
    for options, message in [
        ({}, "samples at temperature 1.0, but --temperature is 0.7"),
        ({"temperature": 0.7, "top_p": 0.9}, "samples with top_p=0.9"),
    ]:
        with HFTextPolicy(tiny_dir, None, str, action_space=gym.spaces.Text(64), **options) as policy:
            with pytest.raises(ValueError, match=message):
                rloo.RLOO(rloo.Args(**{"model": str(tiny_dir), **QUIET, "env": env, "temperature": 0.7}), policy=policy)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"group_size": 1}, "--group-size must be an int >= 2"),
        ({"is_cap": 0.0}, "--is-cap must be a finite number > 0"),
        ({"temperature": 0.0}, "--temperature must be > 0"),
        ({"backend": "openai"}, "--backend openai needs --base-url"),
        ({"base_url": "http://x"}, "--base-url is only used with --backend openai"),
        ({"clip_coef": 1.5}, r"--clip-coef must be a number in \(0, 1\)"),
    ],
)
def test_bad_arguments_name_the_flag(options, message):
    with pytest.raises(ValueError, match=message):
        reinforce_pp.Args(**options)


def test_a_failing_run_closes_everything(tiny_dir):
    args = rloo.Args(model=str(tiny_dir), mode="async", timeout_s=1e-3, progress=False, eval_prompts=0)
    with pytest.raises(TimeoutError, match="complete groups"):
        rloo.RLOO(args).train()  # no_leftover_threads checks that generator, policy, rewarder stopped


def test_warm_start_then_training_saves_the_trained_model(tiny_dir, tmp_path):
    args = rloo.Args(
        model=str(tiny_dir),
        sft_steps=3,
        total_prompts=4,
        prompts_per_update=2,
        group_size=2,
        output_dir=str(tmp_path / "trained"),
        **QUIET,
    )
    agent = rloo.RLOO(args)
    assert agent.parts.model_dir != tiny_dir and agent.parts.model_dir.name == "sft"  # the input folder stays untouched
    result = agent.train()
    trained, _ = load_causal_lm(tmp_path / "trained")
    original, _ = load_causal_lm(tiny_dir)
    changed = any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), original.state_dict().values()))
    assert result.updates == 2 and changed
    assert not agent.parts.model_dir.exists()  # the run's scratch folder is removed at close


def test_completion_logps_use_the_sampling_temperature(tiny_dir):
    model, tokenizer = load_causal_lm(tiny_dir)
    prompt = tokenizer("3+4=").input_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + [10]])).logits[0, len(prompt) - 1 : -1]
        got = completion_logps(model, [prompt], [[10, 1]], length=3, temperature=0.5)
    assert got[0, 0].item() == pytest.approx(torch.log_softmax(logits / 0.5, -1)[0, 10].item(), abs=1e-5)
    assert got[0, 2].item() == 0.0
