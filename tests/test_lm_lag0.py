"""Asynchrony you can check, language-model side: at ``--max-staleness 0`` the async path of every LM
agent trains the same parameters as its sync path (bitwise), runs repeat exactly, and the admission
control starts nothing that would be too stale when its turn comes."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
import pytest
import torch

from asyncvec.agents import grpo, reinforce_pp, rloo
from asyncvec.inference import HFTextPolicy, build_tiny_lm
from asyncvec.lm import load_causal_lm, sft_warm_start
from asyncvec.lm.groups import GroupCollector
from asyncvec.lm.options import NOT_REPLAYED
from asyncvec.lm.prompts import solved_prompts
from asyncvec.lm.rewards import RewardService
from asyncvec.schedule import read_schedule
from asyncvec.versioning import AdmissionControl

# policy_wait_ms=0: the next batch's generation starts while the learner trains (async really runs ahead)
RUN = {
    "progress": False,
    "track": False,
    "eval_prompts": 0,
    "prompts_per_update": 4,
    "group_size": 4,
    "total_prompts": 16,
    "learning_rate": 3e-3,
    "policy_wait_ms": 0.0,
}
AGENTS = {"rloo": (rloo.RLOO, rloo.Args), "reinforce_pp": (reinforce_pp.ReinforcePP, reinforce_pp.Args)}
AGENTS["grpo"] = (grpo.GRPO, grpo.Args)


@pytest.fixture(scope="module")
def warm_dir(tmp_path_factory):
    """A tiny GPT-2 that solves some sums after a short warm start, so updates change the weights."""
    base = build_tiny_lm(tmp_path_factory.mktemp("base"), n_layer=1, n_embd=32, seed=0)
    return sft_warm_start(base, tmp_path_factory.mktemp("sft"), solved_prompts("asyncvec/SingleDigitSums-v0", 0), 150)


def _train(agent: str, model_dir, **options) -> tuple[dict[str, torch.Tensor], object]:
    agent_cls, args_cls = AGENTS[agent]
    with agent_cls(args_cls(model=str(model_dir), **{**RUN, **options})) as learner:
        result = learner.train()
        return {name: value.detach().clone() for name, value in learner.learner.state_dict().items()}, result


@pytest.mark.parametrize("agent", list(AGENTS))
def test_async_at_max_staleness_0_trains_the_parameters_sync_does(agent, warm_dir):
    # --bitwise-sampling: each completion's log-probs do not depend on which requests shared its batch
    sync, sync_result = _train(agent, warm_dir, mode="sync", bitwise_sampling=True)
    async_, async_result = _train(agent, warm_dir, mode="async", max_staleness=0, bitwise_sampling=True)
    start = load_causal_lm(warm_dir)[0].state_dict()
    assert any(not torch.equal(sync[name], start[name]) for name in start), "the updates changed nothing"
    assert async_result.updates == sync_result.updates == 4
    assert async_result.stale_fraction == 0.0
    different = [name for name in sync if not torch.equal(sync[name], async_[name])]
    assert not different, f"async at max staleness 0 differs from sync in {different}"


def test_with_batched_sampling_lag_0_trains_on_the_same_samples_up_to_the_engines_last_bits(warm_dir, tmp_path):
    # Batched (the default), what differs is one op: the engine's forward pass over a batch whose shape
    # timing decides, which moves a completion's log-probs in the last bits (<= ~5e-7) and not its tokens.
    # (Through the importance weights and Adam's eps that becomes 3e-5 to 1.2e-4 in the parameters after
    # these 4 updates, measured; a run on other samples is ~2e-2 away.) The recorded schedules show it.
    updates = {}
    for mode, options in {"sync": {}, "async": {"max_staleness": 0}}.items():
        logs = tmp_path / mode
        agent_cls, args_cls = AGENTS["rloo"]
        args = args_cls(model=str(warm_dir), mode=mode, log_dir=str(logs), record_schedule=True, **{**RUN, **options})
        with agent_cls(args) as agent:
            agent.train()
            updates[mode] = list(read_schedule(agent.run_dir / "schedule", "rloo", args.flat(), NOT_REPLAYED))
    assert len(updates["sync"]) == len(updates["async"]) == 4
    largest = 0.0
    for sync, async_ in zip(updates["sync"], updates["async"], strict=True):
        assert (sync.version, sync.position) == (async_.version, async_.position)
        assert sync.batch.prompt_ids == async_.batch.prompt_ids
        assert np.array_equal(sync.batch.rewards, async_.batch.rewards)
        assert np.array_equal(sync.batch.policy_version, async_.batch.policy_version)
        for group, other in zip(sync.batch.completions, async_.batch.completions, strict=True):
            assert [s.output.token_ids for s in group] == [s.output.token_ids for s in other]
        largest = max(largest, float(np.abs(sync.batch.logps - async_.batch.logps).max()))
    assert largest <= 1e-6, f"behaviour log-probs {largest:.1e} apart"


def test_a_sync_run_repeats_exactly(warm_dir):
    # seeded completions, groups in prompt order, completions in request order: nothing depends on timing
    options = {"mode": "sync", "reward_workers": 3, "bitwise_sampling": True}
    first, _ = _train("rloo", warm_dir, **options)
    again, _ = _train("rloo", warm_dir, **options)
    assert all(torch.equal(first[name], again[name]) for name in first)


def test_admission_starts_a_prompt_only_once_it_cannot_be_too_stale(warm_dir):
    gate = AdmissionControl(per_update=2, max_staleness=0)
    with (
        HFTextPolicy(warm_dir, action_parser=str, action_space=gym.spaces.Text(8), max_new_tokens=2) as policy,
        RewardService("exact_answer") as rewarder,
        GroupCollector(policy, rewarder, [f"{i}+1=" for i in range(9)], group_size=2, seed=0) as collector,
    ):
        collector.start(total_prompts=6, ahead=4, admission=gate)
        first = collector.pop(2, timeout=60)
        time.sleep(0.5)  # room for the collector to request more, which it must not before the update
        assert collector.stats()["prompts"] == 2 and first.prompt_ids == [0, 1]
        gate.update_done()
        second = collector.pop(2, timeout=60)
        assert second.prompt_ids == [2, 3] and collector.stats()["prompts"] == 4
    with pytest.raises(ValueError, match="lag 2 exceeds max_staleness 1"):
        AdmissionControl(per_update=2, max_staleness=1, lag=2)
    with pytest.raises(ValueError, match="--policy-lag 1 exceeds --max-staleness 0: under --staleness-control"):
        rloo.Args(mode="async", max_staleness=0, policy_lag=1)


def test_seeded_groups_do_not_depend_on_batching_or_arrival_order(warm_dir):
    """The same prompts with the same seed give the same completions, in request order, whether
    they meet in one batch or one at a time."""

    def completions(max_batch_size: int, bitwise: bool = False) -> list[list[tuple[tuple, tuple]]]:
        with (
            HFTextPolicy(
                warm_dir,
                action_parser=str,
                action_space=gym.spaces.Text(8),
                max_new_tokens=3,
                max_batch_size=max_batch_size,
                bitwise_seeds=bitwise,
            ) as policy,
            RewardService("exact_answer", num_workers=3) as rewarder,
            GroupCollector(policy, rewarder, [f"{i}+2=" for i in range(4)], group_size=3, seed=7) as collector,
        ):
            batch = collector.collect(4, timeout=60)
            return [[(s.output.token_ids, s.output.token_logps) for s in group] for group in batch.completions]

    def tokens(groups):
        return [[ids for ids, _ in group] for group in groups]

    together, apart = completions(64), completions(1)
    assert tokens(together) == tokens(apart)
    assert len({ids for group in tokens(together) for ids in group}) > 1, "every completion alike: nothing sampled"
    # bitwise_seeds: the log-probs too, bit for bit
    assert completions(64, bitwise=True) == completions(1, bitwise=True)


def test_multi_turn_lag_0_plays_the_episodes_sync_does(warm_dir, tmp_path):
    # Each turn has its own seed and a group lists its episodes in place order: the same episodes
    # (turns, rewards, versions) whichever env played them and whichever ended first.
    options = {
        **RUN,
        "env": "asyncvec/GuessNumber-v0",
        "env_kwargs": '{"max_number": 8, "max_turns": 3, "transcript": false}',
        "num_envs": 3,
        "max_new_tokens": 4,
        "total_prompts": 8,
        "prompts_per_update": 2,
        "group_size": 2,
        "record_schedule": True,
    }
    played = {}
    for mode, extra in {"sync": {}, "async": {"max_staleness": 0}}.items():
        args = rloo.Args(model=str(warm_dir), mode=mode, log_dir=str(tmp_path / mode), **{**options, **extra})
        with rloo.RLOO(args) as agent:
            agent.train()
            played[mode] = list(read_schedule(agent.run_dir / "schedule", "rloo", args.flat(), NOT_REPLAYED))

    def episodes(updates):
        return [
            [[(e.seed, e.member, [(t.completion_ids, t.reward, t.policy_version) for t in e.turns]) for e in group]
             for group in update.batch.episodes]
            for update in updates
        ]  # fmt: skip

    assert len(played["sync"]) == 4
    assert episodes(played["sync"]) == episodes(played["async"])
