"""Multi-turn LM episodes: prefix-stable conversations, the episode collector (async and lockstep,
groups of one reset seed, context overflow, env errors, deadline misses), text-env wrappers and
their bad input, EpisodeBatch masking and per-turn advantages, and the agents on multi-turn envs."""

from __future__ import annotations

import itertools
import math
import tempfile
import time

import gymnasium as gym
import pytest
import torch

import asyncvec.envs  # noqa: F401  (registers the ids)
import asyncvec.envs.text
import asyncvec.lm
import asyncvec.lm.chat
import asyncvec.lm.episodes
import asyncvec.lm.text_env
from asyncvec.agents import reinforce_pp, rloo
from asyncvec.inference import HFTextPolicy, build_tiny_lm
from asyncvec.inference.tiny_models import build_char_tokenizer
from asyncvec.lm import (
    Conversation,
    Episode,
    EpisodeBatch,
    EpisodeCollector,
    EpisodeGroups,
    StringEnv,
    TextEnv,
    Turn,
    load_causal_lm,
    make_text_vector_env,
)
from asyncvec.lm.build import is_multi_turn
from asyncvec.lm.prompts import expert_conversations
from asyncvec.lm.training import trainable_batch
from asyncvec.losses import approx_kl, discounted_returns, masked_normalize

pytestmark = pytest.mark.timeout(240)
GUESS8 = {"max_number": 8, "max_turns": 3, "transcript": False}


@pytest.fixture(scope="module")
def tiny_dir():
    return build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32, max_positions=256, seed=0)


def _policy(folder, **kwargs):
    return HFTextPolicy(folder, None, str, action_space=gym.spaces.Text(64), max_new_tokens=3, **kwargs)


# ------------------------------------------------------------------------------ conversations
def test_plain_conversation_is_prefix_stable_and_keeps_sampled_ids():
    tok = build_char_tokenizer()
    chat = Conversation(tok, system_prompt="Guess.")
    prompts = []
    for obs, completion in [("start", [13, 1]), ("higher", [14, 1]), ("lower", [])]:
        prompts.append(chat.add_observation(obs))
        chat.add_completion(completion)
    for before, after in zip(prompts, prompts[1:]):
        assert after[: len(before)] == before
    assert prompts[1][len(prompts[0]) : len(prompts[0]) + 2] == [13, 1]  # the sampled ids, eos kept


def test_chat_template_conversation_appends_only_new_text():
    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    chat = Conversation(tok, system_prompt="Play")
    first = chat.add_observation("hi")
    assert chat.uses_template
    assert tok.decode(first) == "<system>Play<eos>\n<user>hi<eos>\n<assistant>"
    chat.add_completion(tok("7").input_ids + [tok.eos_token_id], "7")
    second = chat.add_observation("no")
    assert second[: len(first)] == first
    assert tok.decode(second[len(first) :]) == "7<eos>\n<user>no<eos>\n<assistant>"  # the eos is not doubled


@pytest.mark.parametrize("template", [False, True], ids=["plain", "template"])
def test_an_encode_cache_gives_the_same_ids(template):
    tok = build_char_tokenizer()
    if template:
        tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    cache = {}
    for _ in range(2):  # the second conversation reads its texts from the cache
        plain, cached = (
            Conversation(tok, system_prompt="Go."),
            Conversation(tok, system_prompt="Go.", encode_cache=cache),
        )
        for obs in ("start", "higher", "higher"):
            assert cached.add_observation(obs) == plain.add_observation(obs)
            plain.add_completion([13, 1], "7")
            cached.add_completion([13, 1], "7")
        assert cached.add_observation("lower") == plain.add_observation("lower")
        assert cached.fit(len(plain) - 1).ids == plain.fit(len(plain) - 1).ids
    assert cache  # filled, and shared by the conversations


def test_plain_format_can_be_forced_over_a_template():
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not Conversation(tok, use_chat_template=False).uses_template


# ------------------------------------------------------------------------------ the collector
@pytest.mark.parametrize("lockstep", [False, True], ids=["async", "lockstep"])
def test_collector_groups_share_a_seed_and_turns_carry_everything(tiny_dir, lockstep):
    vec = make_text_vector_env("asyncvec/GuessNumber-v0", 4, env_kwargs=GUESS8)
    try:
        with _policy(tiny_dir) as policy, EpisodeCollector(vec, policy, group_size=2, lockstep=lockstep) as collector:
            batch = collector.collect(3, timeout=120)
        assert len(batch) == 3 and len(set(batch.seeds)) == 3
        for group, seed in zip(batch.episodes, batch.seeds):
            assert len(group) == 2 and all(e.seed == seed for e in group)
            for episode in group:
                assert episode.terminated or episode.truncated
                for turn, nxt in zip(episode.turns, episode.turns[1:]):
                    assert nxt.prompt_ids[: len(turn.prompt_ids)] == turn.prompt_ids
                    assert nxt.prompt_ids[len(turn.prompt_ids) :][: len(turn.completion_ids)] == turn.completion_ids
                for turn in episode.turns:
                    assert len(turn.completion_logps) == len(turn.completion_ids) > 0
                    assert turn.policy_version == 0 and turn.env_latency_s > 0 and not turn.missed_deadline
        stats = collector.stats()
        assert stats["episodes"] >= 6 and stats["turns"] == stats["samples"] >= 6
    finally:
        vec.close()


def test_context_overflow_ends_the_episode_truncated(tiny_dir):
    vec = make_text_vector_env("asyncvec/GuessNumber-v0", 2, env_kwargs=GUESS8)
    try:
        with (
            _policy(tiny_dir) as policy,
            EpisodeCollector(vec, policy, group_size=2, max_context_tokens=60) as collector,
        ):
            batch = collector.collect(2, timeout=120)
        episodes = [e for g in batch.episodes for e in g]
        # The untrained model names the number about 1 turn in 13: that episode is won before it overflows.
        overflowed = [e for e in episodes if not e.terminated]
        assert overflowed and all(e.context_overflow and e.truncated for e in overflowed)
        assert not any(e.context_overflow for e in episodes if e.terminated)
        assert all(len(t.prompt_ids) + 3 <= 60 for e in episodes for t in e.turns)
        assert collector.stats()["context_overflows"] == len(overflowed)
    finally:
        vec.close()


def test_drop_oldest_goes_on_past_the_context_and_trains_each_turn_in_the_context_it_was_sampled_in(tiny_dir):
    folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32, max_positions=96, seed=0)  # ~3 turns fit
    model, _ = load_causal_lm(folder)
    vec = make_text_vector_env("asyncvec/GuessNumber-v0", 2, env_kwargs={**GUESS8, "max_turns": 6})
    try:
        with (
            _policy(folder) as policy,
            EpisodeCollector(vec, policy, group_size=2, on_overflow="drop_oldest") as collector,
        ):
            given, submit = [], policy.submit  # the prompts the engine was given
            policy.submit = lambda prompt, **kwargs: given.append(tuple(prompt.prompt)) or submit(prompt, **kwargs)
            batch = collector.collect(2, timeout=120)
        episodes = [e for g in batch.episodes for e in g]
        assert not any(e.context_overflow for e in episodes)
        assert all(e.terminated or e.num_turns == 6 for e in episodes)  # the episodes went on
        assert any(t.segment > 0 for e in episodes for t in e.turns) and all(e.dropped_turns > 0 for e in episodes
                                                                            if e.num_turns == 6)  # fmt: skip
        stats = collector.stats()
        assert stats["dropped_turns"] == sum(e.dropped_turns for e in episodes) > 0 and stats["context_overflows"] == 0
        for episode in episodes:
            for turn, nxt in zip(episode.turns, episode.turns[1:]):
                assert len(turn.prompt_ids) + 3 <= 96 and turn.prompt_ids in given
                assert nxt.segment in (turn.segment, turn.segment + 1)
                if nxt.segment == turn.segment:  # prefix-stable within a segment
                    assert nxt.prompt_ids[: len(turn.prompt_ids)] == turn.prompt_ids
        data = EpisodeBatch.from_episodes(batch, current_version=0, max_staleness=0)
        assert len(data) == len(episodes) and data.info["dropped_turns"] == stats["dropped_turns"]
        with torch.no_grad():
            learner = data.logps(model, 1.0)
        for row, episode in enumerate(episodes):
            starts = data.segment_starts[row]
            assert len(starts) == episode.turns[-1].segment + 1
            for turn in episode.turns:
                start = starts[turn.segment]  # the row's segment: the engine's prompt, then the completion
                stop = start + len(turn.prompt_ids) + len(turn.completion_ids)
                assert tuple(data.sequences[row][start:stop]) == turn.prompt_ids + turn.completion_ids
                completion = slice(start + len(turn.prompt_ids), stop)
                assert data.mask[row, completion].all()
                want = torch.tensor(turn.completion_logps)
                assert torch.allclose(learner[row, completion], want, atol=1e-4)  # scored as the engine saw it
        assert data.mask.sum() == sum(len(t.completion_ids) for e in episodes for t in e.turns)
    finally:
        vec.close()


class _Exploding(gym.Env):
    """A text env that raises on its second step."""

    observation_space = action_space = asyncvec.lm.text_env.text_space(64)

    def reset(self, *, seed=None, options=None):
        self.turn = 0
        return "go", {}

    def step(self, action):
        self.turn += 1
        if self.turn == 2:
            raise RuntimeError("the env broke")
        return "again", 1.0, False, False, {}


def test_stop_frees_a_lock_an_interrupt_left_held_and_the_thread_ends(tiny_dir):
    vec = make_text_vector_env("asyncvec/GuessNumber-v0", 2, env_kwargs=GUESS8)
    try:
        with _policy(tiny_dir) as policy:
            collector = EpisodeCollector(vec, policy, group_size=2).start(total_groups=50, ahead=2)
            collector.pop(1, timeout=120)
            collector._cond.acquire()  # what a Ctrl-C landing as pop() enters its `with` leaves behind
            time.sleep(2.0)  # the thread ends an episode meanwhile and waits for the lock to record it
            collector.stop(timeout=30)
            assert not collector._thread.is_alive()
    finally:
        vec.close()


def test_an_env_that_raises_ends_its_episode_and_is_never_trained_on(tiny_dir):
    vec = make_text_vector_env(_Exploding, 2)
    try:
        with _policy(tiny_dir) as policy, EpisodeCollector(vec, policy, group_size=2) as collector:
            batch = collector.collect(1, timeout=120)
        episodes = batch.episodes[0]
        assert all(e.env_error and e.truncated for e in episodes)
        assert collector.stats()["env_errors"] == 2
        assert len(EpisodeBatch.from_episodes(batch, 0, max_staleness=0)) == 0
    finally:
        vec.close()


def test_deadline_misses_send_an_empty_completion_and_are_not_trained_on(tiny_dir):
    vec = make_text_vector_env("asyncvec/GuessNumber-v0", 2, env_kwargs=GUESS8)
    try:
        from asyncvec.inference import LatencyModel

        with (
            LatencyModel(_policy(tiny_dir), a_ms=300, b_ms=0, deadline_ms=50) as slow,
            EpisodeCollector(vec, slow, group_size=2, tokenizer=build_char_tokenizer(), max_new_tokens=3) as collector,
        ):
            batch = collector.collect(1, timeout=120)
        turns = [t for e in batch.episodes[0] for t in e.turns]
        assert turns and all(t.missed_deadline and not t.trainable for t in turns)
        assert collector.stats()["missed_deadlines"] == len(turns)
        assert len(EpisodeBatch.from_episodes(batch, 0, max_staleness=0)) == 0
    finally:
        vec.close()


def test_collector_rejects_envs_that_are_not_text():
    vec = make_text_vector_env(lambda: gym.make("FrozenLake-v1"), 1)
    try:
        with pytest.raises(TypeError, match="TextEnv"):
            EpisodeCollector(vec, object(), group_size=1, tokenizer=build_char_tokenizer())
    finally:
        vec.close()


# ------------------------------------------------------------------------------ text envs
def test_text_env_invalid_rules():
    lake = lambda: gym.make("FrozenLake-v1", is_slippery=False)  # noqa: E731  (a one-line env factory)
    env = TextEnv(lake(), action_names=asyncvec.envs.text.FROZEN_LAKE_ACTIONS, max_invalid=2)
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("")
    assert obs.startswith("Invalid action.") and reward == -0.1 and not (terminated or truncated)
    assert env.step("???")[3]  # the second invalid turn in a row ends it
    env = TextEnv(lake(), action_names=asyncvec.envs.text.FROZEN_LAKE_ACTIONS, invalid_action="end")
    env.reset(seed=0)
    assert env.step("fly")[3]
    assert env.step("DOWN please")[4]["invalid_action"] is False
    with pytest.raises(TypeError, match="Discrete"):
        TextEnv(gym.make("Pendulum-v1"))


def test_frozen_lake_text_expert_reaches_the_goal():
    env = gym.make("asyncvec/FrozenLakeText-v0")
    env.reset(seed=0)
    expert = env.get_wrapper_attr("expert_completion")
    total, turns, done = 0.0, 0, False
    while not done:
        _, reward, terminated, truncated, _ = env.step(expert())
        total, turns, done = total + reward, turns + 1, terminated or truncated
    assert total == 1.0 and turns == 6


def test_string_env_gives_text_spaces_and_rejects_non_text():
    class Counter:
        def reset(self):
            self.n = 0
            return "count"

        def step(self, text):
            self.n += 1
            return str(self.n), 1.0, self.n >= 2

    vec = make_text_vector_env(lambda: StringEnv(Counter()), 1)
    try:
        vec.async_reset()
        assert vec.recv(timeout=30)[0][0] == "count"
    finally:
        vec.close()

    class Numbers:
        def reset(self):
            return 3

        def step(self, text):
            return 3, 0.0, True

    with pytest.raises(TypeError, match="expected str"):
        StringEnv(Numbers()).reset()


def test_calculator_tool_env_outcomes():
    env = asyncvec.envs.text.CalculatorToolEnv(tool_median_ms=1.0, tool_sigma=0.0, tool_timeout_ms=0.5)
    env.reset(seed=0)
    obs, _, _, _, info = env.step("call: 2*3")
    assert obs == "error: timeout" and info["tool_timeout"]
    env = asyncvec.envs.text.CalculatorToolEnv(tool_median_ms=1.0)
    env.reset(seed=0)
    assert env.step("call: import os")[0] == "error: cannot evaluate"
    assert env.step("hm")[0].startswith("error: say")
    assert env.step("answer: 1")[1:3] == (0.0, True)


# ------------------------------------------------------------------------------ learner side
def _turn(prompt, completion, version, reward, missed=False):
    logps = tuple(-0.5 for _ in completion)
    return Turn(tuple(prompt), tuple(completion), logps, "x", version, 0.0, missed, missed, reward)


def test_episode_batch_masks_observations_stale_and_missed_turns():
    turns = [
        _turn([1, 2], [3, 4], version=0, reward=0.0),  # stale at version 2 with max_staleness 1
        _turn([1, 2, 3, 4, 5], [], version=2, reward=0.0, missed=True),  # deadline miss
        _turn([1, 2, 3, 4, 5, 6], [7, 8], version=2, reward=1.0),
    ]
    other = [_turn([1, 2], [9], version=2, reward=0.0)]
    batch = EpisodeGroups([[Episode(0, 0, 0, turns, terminated=True), Episode(1, 0, 0, other, truncated=True)]], [0])
    data = EpisodeBatch.from_episodes(batch, current_version=2, max_staleness=1, gamma=0.5)
    assert data.mask[0].int().tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert data.mask[1].int().tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert data.rewards.tolist() == [0.25, 0.0]  # gamma^2 * 1 for the third turn
    assert data.info["stale_samples"] == 1 and data.info["missed_deadlines"] == 1 and data.info["samples_used"] == 2
    assert data.behavior_logp[0, 6].item() == -0.5 and data.behavior_logp[0, 2].item() == 0.0
    per_turn = data.turn_advantages()
    expected = masked_normalize(torch.tensor([1.0, 0.0]), torch.tensor([True, True]))  # G of turn 2 vs turn 0
    assert per_turn[0, 6].item() == pytest.approx(expected[0].item())
    assert per_turn[1, 2].item() == pytest.approx(expected[1].item())
    assert per_turn[0, 2].item() == 0.0


def test_per_turn_advantages_subtract_each_turns_kl_from_its_reward():
    first = [_turn([1, 2], [3, 4], version=0, reward=0.0), _turn([1, 2, 3, 4, 5], [6], version=0, reward=1.0)]
    other = [_turn([1, 2], [9], version=0, reward=0.5)]
    batch = EpisodeGroups([[Episode(0, 0, 0, first, terminated=True), Episode(1, 0, 0, other, terminated=True)]], [0])
    data = EpisodeBatch.from_episodes(batch, current_version=0, max_staleness=0, gamma=1.0)
    kl = torch.full(data.mask.shape, 100.0)  # off the trained tokens: must not count
    kl[0, 2], kl[0, 3], kl[0, 5], kl[1, 2] = 0.2, 0.4, 0.6, 0.8
    beta = 0.5
    rewards = [0.0 - beta * (0.2 + 0.4), 1.0 - beta * 0.6, 0.5 - beta * 0.8]  # turn 0 and 1 of episode 0, episode 1
    returns = torch.tensor([rewards[0] + rewards[1], rewards[1], rewards[2]])
    expected = masked_normalize(returns, torch.ones(3, dtype=torch.bool))
    got = data.turn_advantages(kl, beta)
    assert got[0, 2].item() == got[0, 3].item() == pytest.approx(expected[0].item())
    assert got[0, 5].item() == pytest.approx(expected[1].item())
    assert got[1, 2].item() == pytest.approx(expected[2].item())
    assert (got[~data.mask] == 0).all()
    assert torch.equal(data.turn_advantages(kl, 0.0), data.turn_advantages())
    with pytest.raises(ValueError, match="kl: expected shape"):
        data.turn_advantages(kl[:, :2], beta)


def test_episode_logps_score_only_model_tokens(tiny_dir):
    model, _ = load_causal_lm(tiny_dir)
    turns = [_turn([5, 6], [7, 1], 0, 0.0), _turn([5, 6, 7, 1, 8], [9, 1], 0, 1.0)]
    data = EpisodeBatch.from_episodes(EpisodeGroups([[Episode(0, 0, 0, turns)]], [0]), 0, 0)
    with torch.no_grad():
        got = data.logps(model, 1.0)
        logits = model(torch.tensor([data.sequences[0]])).logits[0]
    want = torch.log_softmax(logits[5], -1)[data.sequences[0][6]]  # token 6 (9) after positions 0..5
    assert got[0, 6].item() == pytest.approx(want.item(), abs=1e-5)
    assert (got[0, ~data.mask[0]] == 0).all() and data.mask[0].int().tolist() == [0, 0, 1, 1, 0, 1, 1]


def test_learner_logps_of_sampled_episodes_equal_the_behavior_logps(tiny_dir):
    """On real sampled episodes, before and after new weights are published: the learner's
    teacher-forced log-prob of every trained token equals the one the policy reported (ratio 1),
    and the trained tokens are exactly the turns' sampled ids (eos included), nothing else."""
    learner, tokenizer = load_causal_lm(tiny_dir)
    vec = make_text_vector_env("asyncvec/GuessNumber-v0", 4, env_kwargs=GUESS8)
    try:
        with _policy(tiny_dir) as policy, EpisodeCollector(vec, policy, group_size=2, tokenizer=tokenizer) as collector:
            for version in (0, 1):
                if version:  # a different policy, published as the learner would
                    with torch.no_grad():
                        for parameter in learner.parameters():
                            parameter.add_(0.05 * torch.randn_like(parameter))
                    policy.load_weights({k: v.clone() for k, v in learner.state_dict().items()}, version)
                batch = collector.collect(2, timeout=120)
                data = EpisodeBatch.from_episodes(batch, version, max_staleness=0)
                with torch.no_grad():
                    logps = data.logps(learner, 1.0)
                assert data.mask.any()
                assert torch.allclose(logps[data.mask], data.behavior_logp[data.mask], atol=1e-4)
                episodes = [e for group in batch.episodes for e in group]
                for row, episode in enumerate(episodes):
                    trained = [t for t, m in zip(data.sequences[row], data.mask[row].tolist()) if m]
                    assert trained == [i for turn in episode.turns for i in turn.completion_ids]
                    assert all(turn.policy_version == version for turn in episode.turns)
    finally:
        vec.close()


def test_discounted_returns_against_a_loop():
    rewards = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    got = discounted_returns(rewards, mask, 0.9)
    for b in range(3):
        n = int(mask[b].sum())
        for t in range(5):
            want = sum(0.9 ** (i - t) * rewards[b, i].item() for i in range(t, n)) if t < n else 0.0
            assert got[b, t].item() == pytest.approx(want, abs=1e-5)


# ------------------------------------------------------------------------------ agents
@pytest.mark.parametrize("agent, args_cls", [(rloo.RLOO, rloo.Args), (reinforce_pp.ReinforcePP, reinforce_pp.Args)])
def test_agents_train_on_a_multi_turn_env(tiny_dir, agent, args_cls):
    args = args_cls(
        model=str(tiny_dir), env="asyncvec/GuessNumber-v0", env_kwargs='{"max_number": 8, "max_turns": 3, '
        '"transcript": false}', total_prompts=4, prompts_per_update=2, group_size=2, num_envs=4,
        eval_prompts=4, progress=False, mode="async", max_new_tokens=3, gamma=0.9,
    )  # fmt: skip
    result = agent(args).train()
    assert result.updates == 2 and result.final_version == 2 and result.samples >= 8
    assert len(result.eval_details) == 2 and not math.isnan(result.eval_details[0]["turns_mean"])
    assert result.history[0]["samples_used"] > 0


@pytest.mark.parametrize("agent, args_cls", [(rloo.RLOO, rloo.Args), (reinforce_pp.ReinforcePP, reinforce_pp.Args)])
def test_per_turn_advantages_train_with_a_kl_penalty(tiny_dir, agent, args_cls):
    """--per-turn with --kl-coef: each turn's reward less beta times its tokens' KL (as the agent computes it)."""
    args = args_cls(
        model=str(tiny_dir), env="asyncvec/GuessNumber-v0", env_kwargs='{"max_number": 8, "max_turns": 3, '
        '"transcript": false}', group_size=2, num_envs=2,
        eval_prompts=0, progress=False, mode="sync", max_new_tokens=3, per_turn=True, kl_coef=0.1,
        learning_rate=1e-2,
    )  # fmt: skip
    learner = agent(args)
    try:
        batch = learner.collector.collect(1, timeout=120)
        data = trainable_batch(batch, learner.parts, args, min_group_samples=2 if agent is rloo.RLOO else 1)
        logp = torch.where(data.mask, torch.full(data.mask.shape, -1.0), 0.0)
        ref_logp = torch.where(data.mask, -torch.rand(data.mask.shape, generator=torch.Generator().manual_seed(0)), 0.0)
        kl = approx_kl(logp, ref_logp, args.kl_estimator)
        assert torch.equal(learner.compute_advantages(data, logp, ref_logp), data.turn_advantages(kl, 0.1))
        assert not torch.equal(data.turn_advantages(kl, 0.1), data.turn_advantages())  # the penalty counts
        stats = learner.update(batch)
    finally:
        learner.close()
    assert "kl_ref" in stats and stats["samples_used"] > 0


@pytest.mark.parametrize("agent, args_cls", [(rloo.RLOO, rloo.Args), (reinforce_pp.ReinforcePP, reinforce_pp.Args)])
def test_an_update_raises_the_better_episodes_likelihood(tiny_dir, agent, args_cls):
    """The objective's direction on real episodes: in each group the rewarded episode's model
    tokens gain log-likelihood, the other's lose it."""
    args = args_cls(
        model=str(tiny_dir), env="asyncvec/GuessNumber-v0", env_kwargs='{"max_number": 8, "max_turns": 3, '
        '"transcript": false}', group_size=2, num_envs=2, eval_prompts=0, progress=False, mode="sync",
        learning_rate=1e-2, max_new_tokens=3,
    )  # fmt: skip
    learner = agent(args)
    try:
        batch = learner.collector.collect(2, timeout=120)
        version = learner.versions.current_version
        for group in batch.episodes:
            for i, episode in enumerate(group):
                for turn in episode.turns:
                    turn.reward, turn.policy_version = 0.0, version
                episode.turns[-1].reward = 1.0 if i == 0 else 0.0
        data = EpisodeBatch.from_episodes(batch, version, 2)
        with torch.no_grad():
            before = (data.logps(learner.learner, 1.0) * data.mask).sum(-1)
        for _ in range(3):
            learner.update(batch)
        with torch.no_grad():
            change = (data.logps(learner.learner, 1.0) * data.mask).sum(-1) - before
    finally:
        learner.close()
    assert data.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert (change[data.rewards > 0] > 0).all() and (change[data.rewards == 0] < 0).all(), change.tolist()


def test_the_experts_conversations_fit_the_context_as_the_collectors_do(tmp_path):
    """--sft-steps on a model shorter than the expert's conversations: its prompts are cut as the
    collector cuts them (drop_oldest: the oldest turns go; truncate: the episode ends), and a
    warm start plus RL runs on a 128-position model (it raised IndexError when whole conversations
    were rendered)."""
    small = build_tiny_lm(tmp_path / "small", n_layer=1, n_embd=32, max_positions=128, seed=0)
    tokenizer = load_causal_lm(small)[1]
    lake = {"env": "asyncvec/FrozenLakeText-v0", "env_kwargs": '{"max_turns": 8}', "max_new_tokens": 6}

    def examples(on_overflow, context=128, count=60):
        args = rloo.Args(**lake, on_overflow=on_overflow)
        return list(itertools.islice(expert_conversations(args, tokenizer, context), count))

    whole = examples("drop_oldest", context=None, count=6)  # one expert episode: 6 moves
    assert max(len(ids) for ids, _ in whole) > 128 - 6
    dropped, truncated = examples("drop_oldest"), examples("truncate")
    assert max(len(ids) for ids, _ in dropped + truncated) <= 128 - 6
    assert [answer for _, answer in dropped[:6]] == [answer for _, answer in whole]  # every move, in shorter prompts
    fitting = sum(len(ids) <= 128 - 6 for ids, _ in whole)  # truncate keeps the moves whose prompt fits
    assert [answer for _, answer in truncated[:fitting]] == [answer for _, answer in whole[:fitting]]
    assert truncated[fitting][0] == truncated[0][0]  # then the next episode starts
    with pytest.raises(ValueError, match="leaves no room for --max-new-tokens 6"):
        examples("drop_oldest", context=20)
    args = rloo.Args(
        model=str(small), **lake, on_overflow="drop_oldest", sft_steps=2, total_prompts=2, prompts_per_update=2,
        group_size=2, num_envs=2, eval_prompts=0, progress=False, mode="sync",
    )  # fmt: skip
    assert rloo.RLOO(args).train().updates == 1


def test_the_experts_answers_can_be_rendered_and_the_conversation_keeps_the_rendered_ones(tmp_path):
    # e.g. benchmarks/inflight_llm.py's long completions: the action first, then the model writes on
    tokenizer = load_causal_lm(build_tiny_lm(tmp_path / "m", n_layer=1, n_embd=32, max_positions=512, seed=0))[1]
    args = rloo.Args(env="asyncvec/FrozenLakeText-v0", env_kwargs='{"max_turns": 8}', max_new_tokens=16)
    plain = list(itertools.islice(expert_conversations(args, tokenizer), 6))
    dotted = list(itertools.islice(expert_conversations(args, tokenizer, render_answer=lambda a: a + "...."), 6))
    assert [answer for _, answer in dotted] == [answer + "...." for _, answer in plain]  # the env still parses them
    assert tokenizer.decode(dotted[1][0]).count("....") == 1 and "...." not in tokenizer.decode(plain[1][0])


def test_an_env_says_whether_it_is_multi_turn():
    # the example envs and the TextEnv wrapper declare metadata["multi_turn"]; nothing is stepped to guess it
    assert is_multi_turn("asyncvec/CalculatorTool-v0", {}) and is_multi_turn("asyncvec/GuessNumber-v0", {})
    assert is_multi_turn("asyncvec/FrozenLakeText-v0", {})
    assert not is_multi_turn("asyncvec/SingleDigitSums-v0", {}) and not is_multi_turn("asyncvec/Arithmetic-v0", {})
    assert asyncvec.lm.StringEnv(_Undeclared(), multi_turn=False).metadata["multi_turn"] is False


class _Undeclared(gym.Env):
    """A text env that declares nothing about turns, and raises if it is stepped before a reset.
    Its episode ends on a number (its final answer); the reward is 1 for "7"."""

    observation_space = action_space = asyncvec.lm.text_space()
    steps = 0
    """steps taken by all instances"""

    def __init__(self) -> None:
        self.was_reset = False

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.was_reset = True
        return "ask", {}

    def step(self, action):
        if not self.was_reset:
            raise AssertionError("stepped before reset: a probe")
        type(self).steps += 1
        answered = action.strip().isdigit()
        return "again", float(action.strip() == "7"), answered, False, {}


def test_an_env_that_declares_nothing_is_played_turn_by_turn_without_a_probe_step():
    gym.register("tests/Undeclared-v0", _Undeclared, max_episode_steps=4)
    try:
        _Undeclared.steps = 0
        assert is_multi_turn("tests/Undeclared-v0", {}) and _Undeclared.steps == 0  # made and closed, never stepped
        args = rloo.Args(
            env="tests/Undeclared-v0", total_prompts=4, prompts_per_update=2, group_size=2, num_envs=2,
            max_new_tokens=2, eval_prompts=0, progress=False, mode="sync",
        )  # fmt: skip
        with rloo.RLOO(args) as agent:
            assert isinstance(agent.collector, asyncvec.lm.EpisodeCollector)
            result = agent.train()
        assert result.updates == 2 and result.samples >= 8  # 2 updates of 2 groups of 2 episodes, each a turn or more
        with pytest.raises(ValueError, match=r"declares no metadata\['multi_turn'\]"):
            rloo.RLOO(rloo.Args(env="tests/Undeclared-v0", reward="length_penalty", progress=False))
    finally:
        del gym.registry["tests/Undeclared-v0"]


def test_multi_turn_options_are_checked():
    with pytest.raises(ValueError, match="--gamma"):
        rloo.Args(gamma=1.5)
    with pytest.raises(ValueError, match="TextEnv"):
        is_multi_turn("FrozenLake-v1", {})
