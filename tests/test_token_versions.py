"""Per-token versions (in-flight weight updates) on the learning side: completions and turns whose
tokens span versions, carried into the learner's tensors, with the importance weights, the
staleness, the drops (max_lag on the oldest token) and the loss checked against plain loops over
tokens; a batch without token_versions behaves exactly as before."""

import dataclasses
import math
from concurrent.futures import Future

import gymnasium as gym
import numpy as np
import pytest
import torch
from test_inference_policy import no_leftover_threads  # noqa: F401  (autouse fixture)

from asyncvec.agents import reinforce_pp, rloo
from asyncvec.buffers import CompletionGroups
from asyncvec.inference import HFTextPolicy, PolicyOutput, build_tiny_lm
from asyncvec.lm import completion_logps, load_causal_lm, rewards, training
from asyncvec.lm.episodes import Episode, EpisodeCollector, EpisodeGroups, Turn, make_text_vector_env
from asyncvec.lm.groups import GroupCollector, ScoredCompletion
from asyncvec.lm.learner import EpisodeBatch, LMBatch
from asyncvec.versioning import per_token_versions

pytestmark = pytest.mark.timeout(240)

QUIET = {"progress": False, "eval_prompts": 0, "mode": "sync"}
CURRENT = 3  # the learner's version in the hand-built batches
PROMPT = "3+4="


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("tiny"), n_layer=1, n_embd=32, seed=0)


# ------------------------------------------------------------------------ the checked fill
def test_per_token_versions_fills_a_missing_list_and_keeps_a_given_one():
    assert per_token_versions(2, None, 3) == (2, 2, 2)
    assert per_token_versions(2, [2, 2, 4], 3) == (2, 2, 4)
    assert per_token_versions(2, np.array([2, 3]), 2) == (2, 3)
    assert per_token_versions(5, None, 0) == () and per_token_versions(5, [], 0) == ()


@pytest.mark.parametrize(
    "version, token_versions, message",
    [
        (1, [1, 2], "expected one version per token \\(3\\), got 2"),
        (2, [2, 3, 2], "expected versions that never decrease"),
        (2, [1, 2, 2], "the first \\(oldest\\) token has version 1, the sample's policy_version is 2"),
        (0, [0, -1, 0], "expected ints >= 0"),
        (0, [True, True, True], "expected ints >= 0"),
        (0, [0.0, 0.0, 0.0], "expected ints"),
    ],
)
def test_bad_token_versions_are_refused_naming_the_field(version, token_versions, message):
    with pytest.raises(ValueError, match="token_versions: " + message):
        per_token_versions(version, token_versions, 3)
    with pytest.raises(ValueError, match="token_versions: " + message):
        CompletionGroups(2).add("p", "c", 1.0, [-0.1] * 3, version, token_versions)
    turn = Turn((5,), (7, 8, 1), (-0.1,) * 3, "78", version, 0.0, token_versions=tuple(token_versions))
    with pytest.raises(ValueError, match="token_versions: " + message):
        turn.versions


def test_completion_groups_keep_each_tokens_version_and_the_oldest_as_the_completions():
    groups = CompletionGroups(group_size=3)
    groups.add(0, "a", 1.0, [-0.1, -0.2, -0.3], version=1, token_versions=(1, 2, 3))
    groups.add(0, "b", 0.0, [-0.4], version=2)  # no token_versions: every token has the completion's version
    groups.add(0, "c", 0.0, [], version=3)  # nothing sampled (a deadline miss)
    batch = groups.pop(timeout=0)
    assert batch.policy_version.tolist() == [[1, 2, 3]]
    assert batch.token_versions.tolist() == [[[1, 2, 3], [2, -1, -1], [-1, -1, -1]]]
    assert (batch.token_versions >= 0).tolist() == batch.mask.tolist()  # aligned with the mask
    assert batch.staleness(4).tolist() == [[3, 2, 1]]  # the oldest token's


# ------------------------------------------------------------------------ hand-built batches
def build_batch(agent, groups):
    """``groups``: per prompt, a list of (reward, token_ids, token_versions or None, version). The
    behaviour log-probs are the learner's own, moved per version of age down by 0.4 at even
    positions and up by 0.15 at odd ones, so the importance weights differ per token and some clip."""
    prompt_ids = agent.tokenizer(PROMPT).input_ids
    buffer = CompletionGroups(len(groups[0]))
    for prompt_id, samples in enumerate(groups):
        for reward, token_ids, token_versions, version in samples:
            with torch.no_grad():
                learner = completion_logps(agent.learner, [prompt_ids], [token_ids], len(token_ids))[0].tolist()
            versions = token_versions or (version,) * len(token_ids)
            logps = [lp + (0.15 if t % 2 else -0.4) * (CURRENT - v) for t, (lp, v) in enumerate(zip(learner, versions))]
            output = PolicyOutput(
                action="7",
                behavior_logp=float(sum(logps)),
                policy_version=version,
                latency_s=0.0,
                text="7",
                token_ids=tuple(token_ids),
                token_logps=tuple(logps),
                token_versions=token_versions,
            )
            buffer.add(
                prompt_id, ScoredCompletion(PROMPT, output, reward, False), reward, logps, version, token_versions
            )
    return buffer.pop(len(groups), timeout=0)


SPANNING = [
    # group 0: its first completion's oldest token is 2 versions old (> max_staleness 1): dropped whole
    [(1.0, [10, 11, 1], (1, 2, 3), 1), (0.0, [12, 1], None, 3)],
    # group 1: each completion spans versions, the oldest token 1 version old: kept
    [(1.0, [13, 14, 1], (2, 2, 3), 2), (0.0, [15, 1], (2, 3), 2)],
    # group 2: fresh; one completion has no token_versions
    [(0.0, [16, 17, 18, 1], (3, 3, 3, 3), 3), (1.0, [10, 1], None, 3)],
]


def plain_loops(batch, current, max_staleness):
    """What is trained on, by loops over the samples and their tokens: the kept groups, their
    samples (rows), how many samples are dropped, each sample's staleness, each row's token ages."""
    kept, dropped, per_sample = [], 0, []
    for samples in batch.completions:
        ages = [current - s.output.policy_version for s in samples]
        oldest = [current - min(s.output.token_versions or (s.output.policy_version,)) for s in samples]
        assert ages == oldest  # a sample's version is its oldest token's
        per_sample += ages
        if max(ages) > max_staleness:
            dropped += len(samples)
        else:
            kept.append(samples)
    rows = [s for samples in kept for s in samples]
    token_ages = [
        [current - v for v in (s.output.token_versions or (s.output.policy_version,) * len(s.output.token_ids))]
        for s in rows
    ]
    return kept, rows, dropped, per_sample, token_ages


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agent_cls", [rloo.RLOO, reinforce_pp.ReinforcePP], ids=["rloo", "reinforce_pp"])
def test_a_batch_spanning_versions_matches_a_plain_loop_over_tokens(tiny_dir, agent_cls, level):
    args_cls = rloo.Args if agent_cls is rloo.RLOO else reinforce_pp.Args
    cap = 1.3
    args = args_cls(
        model=str(tiny_dir), group_size=2, max_staleness=1, is_cap=cap, is_level=level, update_epochs=1, **QUIET
    )
    with agent_cls(args) as agent:
        for _ in range(CURRENT):
            agent.publish()
        batch = build_batch(agent, SPANNING)
        kept, rows, dropped, per_sample, token_ages = plain_loops(batch, CURRENT, 1)
        data = training.trainable_batch(batch, agent.parts, agent.args, 2 if agent_cls is rloo.RLOO else 1)
        step = training.LearnerStep(data, agent.parts, agent.args)
        advantages = agent.compute_advantages(data, step.prox_logp, step.ref_logp)
        loss, _ = agent.policy_loss(step.prox_logp.clone(), step.prox_logp, advantages, step.weights, data.mask)
        stats = agent.versions.staleness_stats()

    # what is trained on: the spanning group whose oldest token is too old is out, whole
    assert len(data) == len(rows) == 4 and data.group_ids.tolist() == [1, 1, 2, 2]
    assert data.info["stale_groups"] == 1 and data.info["stale_samples"] == dropped == 2
    assert stats.dropped == 2 and stats.count == 6  # one staleness per sample: its oldest token's
    assert stats.histogram[:3] == [per_sample.count(0), per_sample.count(1), per_sample.count(2)] == [3, 2, 1]
    # per-token versions aligned with the mask, -1 off it
    for i, s in enumerate(rows):
        n = len(s.output.token_ids)
        want = list(s.output.token_versions or (s.output.policy_version,) * n)
        assert data.token_versions[i].tolist() == want + [-1] * (data.mask.shape[1] - n)
        assert data.mask[i].tolist() == [True] * n + [False] * (data.mask.shape[1] - n)
    # per-token staleness of the trained tokens
    ages = [a for row in token_ages for a in row]
    assert data.info["token_staleness_mean"] == pytest.approx(sum(ages) / len(ages))
    assert data.info["token_staleness_max"] == max(ages) == 1
    assert data.info["spanning_samples"] == sum(len(set(row)) > 1 for row in token_ages) == 2

    # truncated IS weights: each token against its own version's log-prob
    prox, behavior = step.prox_logp.tolist(), data.behavior_logp.tolist()
    weights = []
    for i, s in enumerate(rows):
        n = len(s.output.token_ids)
        assert behavior[i][:n] == pytest.approx(list(s.output.token_logps))
        log_ratios = [prox[i][t] - s.output.token_logps[t] for t in range(n)]
        if level == "token":
            weights.append([min(math.exp(r), cap) for r in log_ratios])
        else:  # prod_t pi_t / mu_{v_t, t}: the ratio of a sequence sampled across versions
            weights.append([min(math.exp(sum(log_ratios)), cap)] * n)
        assert step.weights[i, :n].tolist() == pytest.approx(weights[i], rel=1e-5)
        assert (step.weights[i, n:] == 0).all()
    assert 0 < step.is_stats["clipped_fraction"] < 1  # some clipped, some not

    # the loss at pi = pi_prox, by a loop over tokens
    if agent_cls is rloo.RLOO:  # -mean_i sum_t w_it A_i; A_i leave-one-out within the group
        rewards = [s.reward for s in rows]
        groups = data.group_ids.tolist()
        total = 0.0
        for i in range(len(rows)):
            others = [rewards[j] for j in range(len(rows)) if groups[j] == groups[i] and j != i]
            advantage = rewards[i] - sum(others) / len(others)
            total += sum(w * advantage for w in weights[i])
        want = -total / len(rows)
    else:  # -mean_t w_t A_t; A_t the return R normalized over every trained token
        returns = [s.reward for i, s in enumerate(rows) for _ in weights[i]]
        mean = sum(returns) / len(returns)
        std = math.sqrt(sum((g - mean) ** 2 for g in returns) / len(returns) + 1e-8)
        flat = [w for row in weights for w in row]
        want = -sum(w * (g - mean) / std for w, g in zip(flat, returns)) / len(flat)
    assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_a_batch_without_token_versions_trains_exactly_as_before(tiny_dir):
    """The same completions, once without token_versions and once with every token's version
    spelled out (all equal): the same rows, tensors, weights and statistics."""
    uniform = [[(r, ids, None, v) for r, ids, _, v in group] for group in SPANNING]
    spelled = [[(r, ids, (v,) * len(ids), v) for r, ids, _, v in group] for group in SPANNING]
    results = []
    for groups in (uniform, spelled):
        args = rloo.Args(model=str(tiny_dir), group_size=2, max_staleness=1, is_cap=1.3, **QUIET)
        with rloo.RLOO(args) as agent:
            for _ in range(CURRENT):
                agent.publish()
            data = training.trainable_batch(build_batch(agent, groups), agent.parts, agent.args, 2)
            step = training.LearnerStep(data, agent.parts, agent.args)
            results.append((data, step.weights, agent.versions.staleness_stats()))
    (a, weights_a, stats_a), (b, weights_b, stats_b) = results
    assert a.info == b.info and stats_a == stats_b
    for name in ("behavior_logp", "mask", "token_versions", "rewards", "group_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(weights_a, weights_b)
    # without in-flight updates the per-token staleness is the per-sample one
    assert a.info["spanning_samples"] == 0
    ages = [CURRENT - v for v, m in zip(a.token_versions.flatten().tolist(), a.mask.flatten().tolist()) if m]
    assert a.info["token_staleness_mean"] == pytest.approx(np.mean(ages))


def test_an_update_on_a_spanning_batch_trains_and_reports_per_token_staleness(tiny_dir):
    args = reinforce_pp.Args(model=str(tiny_dir), group_size=2, max_staleness=1, **QUIET)
    with reinforce_pp.ReinforcePP(args) as agent:
        for _ in range(CURRENT):
            agent.publish()
        before = [p.detach().clone() for p in agent.learner.parameters()]
        stats = agent.update(build_batch(agent, SPANNING))
        moved = any(not torch.equal(a, b) for a, b in zip(before, agent.learner.parameters()))
    assert moved and math.isfinite(stats["losses/loss"])
    assert stats["samples_used"] == 4 and stats["spanning_samples"] == 2 and stats["token_staleness_max"] == 1


# ------------------------------------------------------------------------------ multi-turn
def _turn(prompt, completion, version, reward, token_versions=None):
    logps = tuple(-0.5 - 0.1 * t for t in range(len(completion)))
    return Turn(
        tuple(prompt), tuple(completion), logps, "x", version, 0.0, reward=reward, token_versions=token_versions
    )


def test_episode_turns_spanning_versions_keep_each_tokens_version():
    current, max_staleness = 4, 1
    turns = [
        _turn([1, 2], [3, 4], version=2, reward=0.0, token_versions=(2, 4)),  # oldest token 2 old: masked whole
        _turn([1, 2, 3, 4, 5], [6, 7, 8], version=3, reward=0.0, token_versions=(3, 3, 4)),  # spans, kept
        _turn([1, 2, 3, 4, 5, 6, 7, 8, 9], [10], version=4, reward=1.0),  # no token_versions
    ]
    other = [_turn([1, 2], [11, 12], version=3, reward=0.5, token_versions=(3, 4))]
    batch = EpisodeGroups([[Episode(0, 0, 0, turns, terminated=True), Episode(1, 0, 0, other, terminated=True)]], [0])
    data = EpisodeBatch.from_episodes(batch, current_version=current, max_staleness=max_staleness)

    # a plain loop over the turns and their tokens
    width = data.mask.shape[1]
    want_versions, want_mask, ages, spanning, stale = [], [], [], 0, 0
    for episode in (turns, other):
        versions, mask = [-1] * width, [False] * width
        for turn in episode:
            start = len(turn.prompt_ids)
            tokens = turn.token_versions or (turn.policy_version,) * len(turn.completion_ids)
            if current - tokens[0] > max_staleness:  # the oldest token decides
                stale += 1
                continue
            spanning += len(set(tokens)) > 1
            for t, v in enumerate(tokens):
                versions[start + t], mask[start + t] = v, True
                ages.append(current - v)
        want_versions.append(versions)
        want_mask.append(mask)
    assert data.mask.tolist() == want_mask and data.token_versions.tolist() == want_versions
    assert data.info["stale_samples"] == stale == 1 and data.info["samples_used"] == 3
    assert data.info["spanning_samples"] == spanning == 2
    assert data.info["token_staleness_mean"] == pytest.approx(sum(ages) / len(ages))
    assert data.info["token_staleness_max"] == max(ages) == 1
    # each trained token keeps its own behaviour log-prob; the stale turn's tokens are out
    assert data.behavior_logp[0, 5:8].tolist() == pytest.approx([-0.5, -0.6, -0.7])
    assert data.behavior_logp[0, 2:4].tolist() == [0.0, 0.0]
    # the episode's staleness (recorded by the learner) is per turn: its oldest token's
    assert sorted(batch.staleness(current).tolist()) == [0, 1, 1, 2]


# ------------------------------------------------------------------- from the collectors
def same_weights(folder):
    model, _ = load_causal_lm(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


class PublishAfterFirstToken:
    """A real text policy whose answers at version ``v >= 1`` are labelled as if ``v`` had been
    published after each completion's first token: token 0 at ``v - 1`` (the sample's
    ``policy_version``), the rest at ``v``. Where versions ``v - 1`` and ``v`` hold the same weights
    (the collector tests) the labels are honest; in a training run they are bookkeeping only. The
    inference tests check that real in-flight updates label honestly; these check that what the
    policy reports reaches the learner untouched and is counted."""

    def __init__(self, policy):
        self._policy = policy

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def _relabel(self, future):
        relabelled = Future()

        def done(answered):
            try:
                out = answered.result()
                if out.token_ids and out.policy_version >= 1:
                    v = out.policy_version
                    versions = (v - 1,) + (v,) * (len(out.token_ids) - 1)
                    out = dataclasses.replace(out, policy_version=v - 1, token_versions=versions)
                relabelled.set_result(out)
            except BaseException as exc:
                relabelled.set_exception(exc)

        future.add_done_callback(done)
        return relabelled

    def submit(self, obs, **kwargs):
        return self._relabel(self._policy.submit(obs, **kwargs))

    def submit_group(self, prompt, k):
        return [self._relabel(future) for future in self._policy.submit_group(prompt, k)]


def test_group_collector_carries_each_tokens_version_to_the_learner(tiny_dir):
    with (
        HFTextPolicy(tiny_dir, action_parser=str, action_space=gym.spaces.Text(8), max_new_tokens=3) as policy,
        rewards.RewardService("exact_answer") as rewarder,
        GroupCollector(PublishAfterFirstToken(policy), rewarder, ["1+2=", "3+4=", "5+1="], group_size=2) as collector,
    ):
        policy.load_weights(same_weights(tiny_dir), 1)  # versions 0 and 1: the same weights
        batch = collector.collect(3, timeout=120)
    tokenizer = policy.tokenizer
    data = LMBatch.from_groups(batch, tokenizer, current_version=1, max_staleness=1)
    samples = [s for group in batch.completions for s in group]
    assert len(data) == len(samples) == 6 and (batch.policy_version == 0).all()
    for i, s in enumerate(samples):
        n = len(s.output.token_ids)
        assert batch.token_versions.reshape(6, -1)[i, :n].tolist() == [0] + [1] * (n - 1)
        assert data.token_versions[i, :n].tolist() == [0] + [1] * (n - 1) and (data.token_versions[i, n:] == -1).all()
    assert data.info["spanning_samples"] == sum(len(s.output.token_ids) > 1 for s in samples)
    # too old for max_staleness 0 by its first token, although its others are fresh: every group is dropped
    assert len(LMBatch.from_groups(batch, tokenizer, current_version=1, max_staleness=0)) == 0


def test_episode_collector_carries_each_tokens_version_into_its_turns(tiny_dir):
    vec = make_text_vector_env("asyncvec/GuessNumber-v0", 2, env_kwargs={"max_number": 8, "max_turns": 2})
    try:
        with (
            HFTextPolicy(tiny_dir, None, str, action_space=gym.spaces.Text(64), max_new_tokens=3) as policy,
            EpisodeCollector(vec, PublishAfterFirstToken(policy), group_size=2) as collector,
        ):
            policy.load_weights(same_weights(tiny_dir), 1)  # versions 0 and 1: the same weights
            batch = collector.collect(1, timeout=120)
    finally:
        vec.close()
    turns = [t for group in batch.episodes for e in group for t in e.turns if t.trainable]
    assert turns and all(t.versions == (0,) + (1,) * (len(t.completion_ids) - 1) for t in turns)
    data = EpisodeBatch.from_episodes(batch, current_version=1, max_staleness=1)
    trained = data.token_versions[data.mask].tolist()
    assert trained == [v for t in turns for v in t.versions] and (data.token_versions[~data.mask] == -1).all()


@pytest.mark.parametrize("agent_cls", [rloo.RLOO, reinforce_pp.ReinforcePP], ids=["rloo", "reinforce_pp"])
def test_a_run_on_completions_spanning_versions_trains_and_counts_them(tiny_dir, agent_cls):
    args_cls = rloo.Args if agent_cls is rloo.RLOO else reinforce_pp.Args
    args = args_cls(model=str(tiny_dir), total_prompts=8, prompts_per_update=4, group_size=2, **QUIET)
    with HFTextPolicy(tiny_dir, None, str, action_space=gym.spaces.Text(8), max_new_tokens=4) as policy:
        result = agent_cls(args, policy=PublishAfterFirstToken(policy)).train()
    # sync mode: each completion's first token is labelled 1 version behind the learner, the rest 0
    assert result.updates == 2 and result.stale_fraction == 0.0 and result.staleness_mean == 1.0
    assert 0 < result.spanning_fraction <= 1
    assert all(row["token_staleness_max"] == 1 and 0 < row["token_staleness_mean"] < 1 for row in result.history)


def test_the_agents_take_inflight_updates_from_the_command_line(tiny_dir):
    """--inflight-updates reaches the hf policy: an async run publishes into running batches and trains on them."""
    args = rloo.Args(model=str(tiny_dir), total_prompts=16, prompts_per_update=4, group_size=2, max_new_tokens=12,
                     inflight_updates=True, progress=False, eval_prompts=0, mode="async")  # fmt: skip
    agent = rloo.RLOO(args)
    assert agent.parts.policy.inflight_updates
    result = agent.train()
    assert result.updates == 4 and result.final_version == result.start_version + 4
    assert all("engine/inflight_swaps" in row for row in result.history)
    with pytest.raises(ValueError, match="--inflight-updates needs --backend hf or vllm, or --backend openai with "):
        rloo.Args(backend="openai", base_url="http://127.0.0.1:1", inflight_updates=True)
    args = rloo.Args(backend="openai", base_url="http://127.0.0.1:1", server_kind="vllm", inflight_updates=True)
    assert args.inflight_updates  # a vLLM server takes in-flight updates (tests/test_vllm_server_inflight.py)
