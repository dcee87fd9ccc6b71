"""PPO and SAC: bad input, checkpoints and telemetry; the learning tests live in test_learning.py."""

from __future__ import annotations

import glob

import pytest

from agents import ppo, sac


def test_unknown_env_id_names_close_matches():
    with pytest.raises(ValueError, match=r"unknown env id 'CartPol-v1'; did you mean CartPole-v1"):
        ppo.PPO(ppo.Args(env="CartPol-v1"))


def test_sac_refuses_discrete_actions():
    with pytest.raises(ValueError, match=r"SAC needs a continuous \(Box\) action space; CartPole-v1 has Discrete\(2\)"):
        sac.SAC(sac.Args(env="CartPole-v1", num_envs=1))


@pytest.mark.parametrize(
    "kwargs, message",
    [({"policy_lag": 5, "max_staleness": 2}, "exceeds --max-staleness"), ({"num_envs": 0}, "--num-envs must be >= 1"), ({"is_cap": 0}, "--is-cap")],
)
def test_ppo_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ppo.Args(**kwargs)


def test_ppo_checkpoint_resume_and_tensorboard(tmp_path, no_leftover_children):
    common = dict(num_envs=2, num_steps=16, total_timesteps=64, update_epochs=2, progress=False,
                  checkpoint_dir=str(tmp_path / "ckpt"), log_dir=str(tmp_path / "runs"), track=True)
    first = ppo.train(ppo.Args(**common))
    assert first.global_step == 64 and first.updates == 2
    events = glob.glob(str(tmp_path / "runs" / "*" / "events.out.tfevents.*"))
    assert events, "--track writes TensorBoard event files"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(events[0])
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {"charts/episodic_return", "charts/env_steps_per_s", "losses/policy_loss", "staleness/mean",
            "charts/policy_latency_p99_ms", "charts/policy_batch_size", "losses/is_ess"} <= tags
    resumed = ppo.PPO(ppo.Args(**{**common, "total_timesteps": 128, "resume": True}))
    assert resumed.global_step == 64 and resumed.versions.current_version == 2
    result = resumed.train()
    assert result.global_step == 128 and result.updates == 4


def test_sac_checkpoint_holds_the_replay_buffer(tmp_path, no_leftover_children):
    common = dict(num_envs=1, total_timesteps=300, learning_starts=100, batch_size=32, hidden=32, progress=False,
                  checkpoint_dir=str(tmp_path / "ckpt"), mode="sync", n_step=3)
    first = sac.train(sac.Args(**common))
    assert first.global_step == 300 and first.gradient_steps > 0
    resumed = sac.SAC(sac.Args(**{**common, "total_timesteps": 400, "resume": True}))
    assert len(resumed.buffer) == 300 and resumed.global_step == 300
    assert resumed.versions.current_version == first.gradient_steps
    result = resumed.train()
    assert result.global_step == 400


@pytest.mark.parametrize("correction", ["none", "tis", "vtrace", "decoupled"])
def test_ppo_corrections_run_and_report_is_stats(correction):
    result = ppo.train(ppo.Args(num_envs=2, num_steps=16, total_timesteps=96, update_epochs=2, progress=False,
                                correction=correction, policy_lag=1))
    assert result.updates == 3
    last = result.history[-1]
    assert last["staleness/max"] >= 1, "policy_lag=1 makes samples one version stale"
    if correction in ("tis", "decoupled"):
        assert 0 < last["losses/is_ess"] <= 1
