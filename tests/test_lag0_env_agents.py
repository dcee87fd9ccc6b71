"""Lag 0 is sync: PPO's and SAC's async paths at lag 0 end with the sync path's parameters, bitwise.

Each pair of runs uses real env worker processes (AsyncLLMVectorEnv, partial batches in async) and real
gymnasium envs (PPO also behind a 3 ms LatencyModel, the remote-server path); every parameter and buffer of
every network is compared with ``torch.equal``.
"""

from __future__ import annotations

import time

import pytest
import torch

from asyncvec.agents import ppo, sac


def state(agent, *names: str) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the agent's networks ``names`` (and SAC's ``log_alpha``), by qualified name."""
    tensors = {f"{name}.{key}": value for name in names for key, value in getattr(agent, name).state_dict().items()}
    if hasattr(agent, "log_alpha"):
        tensors["log_alpha"] = agent.log_alpha.detach()
    return tensors


def assert_same_tensors(sync: dict[str, torch.Tensor], lag0: dict[str, torch.Tensor], initial: dict) -> None:
    assert sync.keys() == lag0.keys()
    different = {
        k: float((sync[k].double() - lag0[k].double()).abs().max()) for k in sync if not torch.equal(sync[k], lag0[k])
    }
    assert not different, f"async at lag 0 differs from sync (max abs difference per tensor): {different}"
    assert any(not torch.equal(sync[k], initial[k]) for k in sync), "the runs did not train"


@pytest.mark.parametrize(
    "env, policy_latency_ms, slow_learner",
    [("CartPole-v1", 0.0, False), ("Pendulum-v1", 0.0, False), ("CartPole-v1", 3.0, False), ("CartPole-v1", 0.0, True)],
)
def test_ppo_async_at_max_staleness_0_is_the_sync_run(
    env, policy_latency_ms, slow_learner, no_leftover_children, monkeypatch
):
    """``slow_learner``: each checkpoint write (after the publish) takes 0.3 s, as on a loaded machine: the
    collector released by the last publish stepped on meanwhile (6 episodes finished where sync finished 2)."""
    if slow_learner:
        monkeypatch.setattr(ppo.PPO, "save", lambda self: time.sleep(0.3))

    def run(mode: str):
        args = ppo.Args(
            env=env, mode=mode, num_envs=4, num_steps=8, total_timesteps=96, max_staleness=0, hidden=16,
            update_epochs=3, num_minibatches=2, seed=3, policy_latency_ms=policy_latency_ms, track=False,
            progress=False,
        )  # fmt: skip
        agent = ppo.PPO(args)
        initial = {k: v.clone() for k, v in state(agent, "actor", "critic").items()}
        result = agent.train()
        return state(agent, "actor", "critic"), initial, result

    sync, initial, sync_result = run("sync")
    lag0, _, result = run("async")
    assert result.updates == 3 and result.dropped_samples == 0 and result.staleness_mean == 0.0
    assert result.episodic_returns == sync_result.episodic_returns  # the same episodes, in the same order
    assert_same_tensors(sync, lag0, initial)


@pytest.mark.parametrize("n_step", [1, 3])
def test_sac_async_in_lockstep_is_the_sync_run(n_step, no_leftover_children):
    def run(mode: str):
        args = sac.Args(
            mode=mode, lockstep=mode == "async", num_envs=2, total_timesteps=80, learning_starts=32, batch_size=16,
            hidden=16, buffer_size=1000, n_step=n_step, seed=3, track=False, progress=False,
        )  # fmt: skip
        agent = sac.SAC(args)
        names = ("actor", "qf1", "qf2", "qf1_target", "qf2_target")
        initial = {k: v.clone() for k, v in state(agent, *names).items()}
        agent.train()
        return state(agent, *names), initial, agent.gradient_steps

    sync, initial, sync_steps = run("sync")
    lag0, _, lag0_steps = run("async")
    assert sync_steps == lag0_steps == 48  # utd 1 on the 80 - 32 steps after learning_starts, the last ones included
    assert_same_tensors(sync, lag0, initial)


def test_sac_lockstep_needs_async_at_lag_0():
    with pytest.raises(ValueError, match="--lockstep is async at lag 0"):
        sac.Args(mode="sync", lockstep=True)
    with pytest.raises(ValueError, match="--lockstep is async at lag 0"):
        sac.Args(lockstep=True, policy_lag=1, max_staleness=2)


@pytest.mark.parametrize("env", ["CartPole-v1", "Pendulum-v1"])
def test_ppo_async_at_max_staleness_1_acts_each_segment_with_the_version_before_whatever_the_speeds(
    env, no_leftover_children, monkeypatch
):
    """Lag 1 by construction: segment k + 1 is acted by the version published after update k - 1 while update k
    trains, so every sample after the first segment is exactly one version old, and the run does not depend on
    which side is faster (a learner slowed by 0.3 s per update ends with the same parameters, bitwise)."""

    def run(slow_learner: bool):
        with monkeypatch.context() as patch:
            if slow_learner:
                patch.setattr(ppo.PPO, "save", lambda self: time.sleep(0.3))
            args = ppo.Args(
                env=env, mode="async", num_envs=4, num_steps=8, total_timesteps=128, max_staleness=1, hidden=16,
                update_epochs=3, num_minibatches=2, seed=3, track=False, progress=False,
            )  # fmt: skip
            agent = ppo.PPO(args)
            initial = {k: v.clone() for k, v in state(agent, "actor", "critic").items()}
            result = agent.train()
            return state(agent, "actor", "critic"), initial, result

    fast, initial, fast_result = run(slow_learner=False)
    slow, _, slow_result = run(slow_learner=True)
    assert fast_result.updates == 4 and fast_result.dropped_samples == 0
    histogram = fast_result.staleness_histogram
    assert histogram[:2] == [32, 96] and not any(histogram[2:]), histogram  # staleness 0: the first segment only
    assert slow_result.staleness_histogram == histogram
    assert fast_result.episodic_returns == slow_result.episodic_returns
    assert_same_tensors(fast, slow, initial)
