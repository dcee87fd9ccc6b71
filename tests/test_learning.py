"""Learning tests with honest thresholds (CPU). Each stops as soon as its target window is reached.

PPO: the plain defaults (nothing but the env id, mode and budget: one default for every env, no
setting by env id); the assertion is on the mean return of the last 20 episodes. The margins come
from benchmarks/defaults.py (3 seeds x sync/async, docs/agents.md "PPO defaults across tasks").
SAC: CleanRL settings with narrower networks (64 units) to fit the CPU budget; the assertion is on
the mean return of the last 10 episodes.
"""

from __future__ import annotations

import pytest

from asyncvec.agents import ppo, sac

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_ppo_defaults_learn_cartpole_async(no_leftover_children):
    # Solving it (475) is measured, not asserted: async at the defaults reached 475 in 2 of 3 seeds within 100k
    # steps (docs/agents.md, "Async vs sync env steps"; the third plateaued), and a test asking for 475 failed 1
    # full-suite run in 2 (323 after 100k). Learning is asserted: random play scores about 22.
    result = ppo.train(
        ppo.Args(env="CartPole-v1", mode="async", total_timesteps=100_000, target_return=475, progress=False)
    )
    assert result.reached_target_s is not None or result.final_return >= 200, (
        f"20-episode mean return {result.final_return:.1f} after {result.global_step} steps"
    )
    assert result.staleness_mean > 0, "async samples are stale: the learner trained while the envs acted"


def test_ppo_defaults_solve_acrobot_async(no_leftover_children):
    # Acrobot-v1 pays -1 a step until the tip swings above the bar: -500 (the floor) until the first success.
    # benchmarks/defaults.py: -100 reached in 8.7k-17.4k env steps over 3 seeds x 2 modes (async 13.1k-17.4k,
    # loads 13-18 on 2 cores); the budget is 60k.
    result = ppo.train(
        ppo.Args(env="Acrobot-v1", mode="async", total_timesteps=60_000, target_return=-100, progress=False)
    )
    assert result.reached_target_s is not None, (
        f"20-episode mean return {result.final_return:.1f} after {result.global_step} steps"
    )


def test_ppo_defaults_learn_pendulum_continuous_actions(no_leftover_children):
    # Continuous actions (a Gaussian policy, actions clipped for the env): random play scores about -1200;
    # benchmarks/defaults.py: the 20-episode mean passed -400 within 19.2k-36.4k env steps in all 6 runs (3 seeds
    # x 2 modes; -200 in 5 of 6: one sync seed hovered between -275 and -800). Here -400 within 80k.
    result = ppo.train(
        ppo.Args(env="Pendulum-v1", mode="sync", total_timesteps=80_000, target_return=-400, progress=False)
    )
    assert result.reached_target_s is not None, (
        f"20-episode mean return {result.final_return:.1f} after {result.global_step} steps"
    )


def test_ppo_with_correction_learns_under_a_forced_lag_of_8_versions():
    # Truncated IS keeps the PPO trust region around the behavior policy, so a stale advantage is
    # not applied again by every update (see docs/agents.md for the comparison of corrections).
    # Staleness is the lag plus the versions the learner advances while a segment is collected and waits in
    # the acting process's store (1-2; 3-4 now and then on a loaded machine: the envs may run a segment
    # ahead), so max_staleness leaves room above the lag: every sample is 8+ versions old, few are dropped
    # (measured: 0 and 230 of about 19k).
    result = ppo.train(
        ppo.Args(
            env="CartPole-v1",
            mode="async",
            policy_lag=8,
            max_staleness=12,
            correction="tis",
            total_timesteps=60_000,
            target_return=300,
            seed=1,
            progress=False,
        )
    )
    assert result.staleness_mean >= 8, "the lag forces samples 8+ versions old"
    assert result.dropped_samples <= 0.05 * result.global_step
    assert result.reached_target_s is not None, (
        f"20-episode mean return {result.final_return:.1f} after {result.global_step} steps"
    )


def test_sac_pendulum_reaches_minus_250_within_15k_steps(no_leftover_children):
    result = sac.train(
        sac.Args(
            env="Pendulum-v1",
            mode="async",
            total_timesteps=15_000,
            target_return=-250,
            hidden=64,
            seed=1,
            progress=False,
        )
    )
    assert result.reached_target_s is not None, (
        f"10-episode mean return {result.final_return:.1f} after {result.global_step} steps"
    )
    assert result.final_return >= -250
