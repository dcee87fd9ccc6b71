"""Tianshou through asyncvec.integrations.tianshou: partial batches (wait_num), restarts, DQN learning."""

from __future__ import annotations

import functools
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from tianshou.algorithm.modelfree.dqn import DQN, DiscreteQLearningPolicy
from tianshou.algorithm.optim import AdamOptimizerFactory
from tianshou.data import Collector, VectorReplayBuffer
from tianshou.trainer import OffPolicyTrainerParams
from tianshou.utils.net.common import Net
from toy_envs import CounterEnv, FaultyEnv, SleepyEnv

from asyncvec.integrations.tianshou import AsyncCollector, TianshouVectorEnv


def test_step_returns_the_ready_envs_and_the_slow_one_keeps_stepping(no_leftover_children):
    # env 3 takes 1 s a step, the others 1 ms: with wait_num=2, step() returns without waiting for it
    fns = [functools.partial(SleepyEnv, 0.001, max_len=50)] * 3 + [functools.partial(SleepyEnv, 1.0, max_len=50)]
    envs = TianshouVectorEnv(fns, wait_num=2)
    try:
        assert len(envs) == 4 and envs.is_async
        obs, info = envs.reset()
        assert obs.shape == (4, 3) and all(i["length"] >= 2 for i in info)
        steps = np.zeros(4, dtype=int)
        ready = list(range(4))
        for _ in range(8):  # step only the envs that came back
            obs, rew, term, trunc, info = envs.step(np.ones(len(ready), dtype=np.int64), ready)
            ready = [i["env_id"] for i in info]
            assert len(ready) >= 2 and obs.shape == (len(ready), 3) and rew.shape == (len(ready),)
            steps[ready] += 1
        # every round returned >= 2 fast envs (a fast env still in flight may miss a round on a loaded machine:
        # [7, 6, 3, 0] was seen); the slow one stepped at most twice
        assert steps[:3].sum() >= 16 and steps[:3].min() >= 1 and steps[3] <= 2, f"steps per env: {steps}"
        obs, rew, term, trunc, info = envs.step(None, envs.waiting_id)  # collect what is still in flight
        assert all(i["env_id"] in range(4) for i in info)
    finally:
        envs.close()


def test_resets_seeds_attributes_and_restarts(tmp_path, no_leftover_children):
    marker = str(tmp_path / "crashed")
    fns = [functools.partial(FaultyEnv, "raise", 2, marker, max_len=50), functools.partial(CounterEnv, max_len=50)]
    envs = TianshouVectorEnv(fns, wait_num=1, max_restarts=1, envs_per_worker=1)  # not probed: the fault is one-shot
    try:
        envs.seed(3)
        first, _ = envs.reset()
        envs.seed(3)
        again, _ = envs.reset()
        np.testing.assert_array_equal(first, again)  # seed() applies at the next reset, per env
        assert envs.get_env_attr("max_len") == [50, 50]
        envs.set_env_attr("max_len", 7, id=1)
        assert envs.get_env_attr("max_len") == [50, 7]
        assert envs.get_env_attr("reward_range") == [None, None]  # a missing attribute reads as None, as in Tianshou
        envs.set_env_attr("max_len", 50, id=1)  # env 1 steps on while env 0 is rebuilt (slow on a loaded machine)
        results = {}
        ready = [0, 1]
        for _ in range(40):
            obs, rew, term, trunc, info = envs.step(np.zeros(len(ready), dtype=np.int64), ready)
            ready = [i["env_id"] for i in info]
            results.update({i["env_id"]: (tr, i) for tr, i in zip(trunc, info)})
            if 0 in results and results[0][1].get("env_restarted"):
                break
        truncated, info = results[0]
        assert info["env_restarted"] and truncated, "the env that raised came back truncated"
        assert envs.vector_env.restarts == [1, 0]
        obs, info = envs.reset(0)  # Tianshou resets it; the rebuilt worker steps on
        assert obs.shape == (1, 3)
    finally:
        envs.close()


def test_bad_input_names_tianshou_and_the_expected_form(no_leftover_children):
    envs = TianshouVectorEnv([lambda: gym.make("CartPole-v1")] * 2, wait_num=1)
    try:
        envs.reset()
        with pytest.raises(ValueError, match=r"Tianshou passed actions of shape \(1, 2\); expected \(1,\)"):
            envs.step(np.zeros((2, 2), dtype=np.int64), [0, 1])
    finally:
        envs.close()
    with pytest.raises(TypeError, match="Tianshou cannot take the observation space Text"):
        TianshouVectorEnv([functools.partial(CounterEnv, obs_kind="text")] * 2)


def train_tianshou_dqn(seed: int, threshold: float, max_epochs: int):
    torch.manual_seed(seed)
    np.random.seed(seed)
    train_envs = TianshouVectorEnv([lambda: gym.make("CartPole-v1")] * 8, wait_num=4)
    test_envs = TianshouVectorEnv([lambda: gym.make("CartPole-v1")] * 4)
    try:
        train_envs.seed(seed)
        test_envs.seed(seed + 100)
        net = Net(state_shape=4, action_shape=2, hidden_sizes=[64, 64])
        policy = DiscreteQLearningPolicy(model=net, action_space=gym.spaces.Discrete(2), eps_training=0.1)
        algorithm = DQN(
            policy=policy,
            optim=AdamOptimizerFactory(lr=1e-3),
            gamma=0.9,
            n_step_return_horizon=3,
            target_update_freq=100,
        )
        train_collector = AsyncCollector(algorithm, train_envs, VectorReplayBuffer(20_000, 8), exploration_noise=True)
        test_collector = Collector(algorithm, test_envs)
        train_collector.reset()
        test_collector.reset()
        train_collector.collect(n_step=1000)
        result = algorithm.run_training(
            OffPolicyTrainerParams(
                training_collector=train_collector,
                test_collector=test_collector,
                max_epochs=max_epochs,
                epoch_num_steps=1000,
                collection_step_num_env_steps=16,
                test_step_num_episodes=8,
                batch_size=64,
                update_step_num_gradient_steps_per_sample=0.1,
                stop_fn=lambda mean_return: mean_return >= threshold,
                verbose=False,
                show_progress=False,
            )
        )
        return result, train_collector.collect_step
    finally:
        train_envs.close()
        test_envs.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tianshou_dqn_learns_cartpole_with_partial_batches(no_leftover_children, one_torch_thread):
    # Tianshou's own AsyncCollector + OffPolicyTrainer; 8 envs, wait_num=4. The score is the greedy
    # policy's mean return over 8 test episodes. Measured (seeds 0-2), two runs: 165/217/242 after 8k/4k/4k and
    # 182/214/251 after 6.0k/8.1k/7.1k training steps (plus 1k warm-up; 85-134 s, load 5): which envs are ready
    # depends on timing, so runs differ. Target 150 within 20k, 2.5x the most steps used; the assertion asks for 120
    # (a random policy scores about 22): a fresh-clone `make test` on 2026-12-04 ended at 146.8 after 20k steps.
    start = time.monotonic()
    result, steps = train_tianshou_dqn(seed=0, threshold=150, max_epochs=20)
    print(
        f"Tianshou DQN: best test return {result.best_score:.1f} after {steps} steps, {time.monotonic() - start:.0f} s"
    )
    assert result.best_score >= 120, f"best test return {result.best_score:.1f} after {steps} env steps"
