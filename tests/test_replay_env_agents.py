"""Record and replay: an async PPO run's schedule replayed without the timing ends with its parameters, bitwise;
a folder that cannot be replayed is one line on the command line, exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncvec.agents import ppo, sac

# Lag 1 and a 3 ms policy: the envs run ahead of the learner, samples of two versions share a segment.
RECORDED = dict(
    env="CartPole-v1", num_envs=4, num_steps=8, total_timesteps=320, hidden=16, update_epochs=3, num_minibatches=2,
    seed=5, policy_lag=1, max_staleness=2, policy_latency_ms=3.0, track=False, progress=False,
)  # fmt: skip


def tensors(agent: ppo.PPO) -> dict[str, torch.Tensor]:
    return {
        **{f"actor.{k}": v for k, v in agent.actor.state_dict().items()},
        **{f"critic.{k}": v for k, v in agent.critic.state_dict().items()},
        **{f"optimizer.{i}.{k}": v for i, s in agent.optimizer.state_dict()["state"].items() for k, v in s.items()},
    }


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """An async run with --record-schedule: its parameters, result and schedule folder."""
    log_dir = tmp_path_factory.mktemp("runs")
    agent = ppo.PPO(ppo.Args(mode="async", record_schedule=True, log_dir=str(log_dir), **RECORDED))
    result = agent.train()
    return tensors(agent), result, agent.run_dir / "schedule", log_dir


def test_an_async_ppo_run_replays_bitwise(recorded, no_leftover_children):
    params, result, schedule, log_dir = recorded
    assert result.updates == 10 and result.staleness_mean > 0, "the recorded run should be asynchronous (stale)"
    assert len(list(schedule.glob("update_*.pt"))) == 10
    agent = ppo.PPO(ppo.Args(mode="async", replay=str(schedule), log_dir=str(log_dir), **RECORDED))
    replayed = agent.train()
    assert replayed.updates == 10 and replayed.global_step == result.global_step
    different = [k for k in params if not torch.equal(params[k], tensors(agent)[k])]
    assert not different, f"the replay differs from the recorded run in {different}"
    # the control: the sync run of the same seed (no staleness) ends elsewhere
    sync = ppo.PPO(ppo.Args(mode="sync", **RECORDED))
    sync.train()
    assert not torch.equal(params["actor.body.0.weight"], tensors(sync)["actor.body.0.weight"])


def cut_schedule(schedule: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "cut"
    folder.mkdir()
    for path in schedule.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "update_000003.pt").unlink()
    return folder


def half_written_schedule(schedule: Path, tmp_path: Path) -> Path:
    folder = cut_schedule(schedule, tmp_path)
    (folder / "update_000003.pt").write_bytes((schedule / "update_000003.pt").read_bytes()[:500])
    return folder


def other_agents_schedule(schedule: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "sac"
    folder.mkdir()
    meta = json.loads((schedule / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "agent": "sac"}))
    return folder


@pytest.mark.parametrize(
    "folder, options, message",
    [
        (lambda schedule, tmp: tmp / "nowhere", {}, "no recorded schedule there"),
        (lambda schedule, tmp: schedule, {"env": "Acrobot-v1"}, "recorded with --env CartPole-v1, not Acrobot-v1"),
        (other_agents_schedule, {}, "recorded by sac, not ppo"),
        (cut_schedule, {}, "update 3 is missing"),
        (half_written_schedule, {}, "update_000003.pt is unreadable"),
    ],
    ids=["missing", "other env", "other agent", "truncated", "cut file"],
)
def test_a_schedule_that_cannot_be_replayed_is_one_line_exit_2(
    recorded, tmp_path, capsys, folder, options, message, no_leftover_children
):
    schedule = folder(recorded[2], tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        ppo.main(ppo.Args(**{**RECORDED, **options, "replay": str(schedule)}))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and err.startswith("PPO: error: --replay"), err


def test_replay_refuses_what_cannot_replay():
    with pytest.raises(ValueError, match="leave out --resume"):
        ppo.Args(replay="x", resume=True, checkpoint_dir="c")
    with pytest.raises(ValueError, match="leave out --record-schedule"):
        ppo.Args(replay="x", record_schedule=True)
    with pytest.raises(ValueError, match="SAC records no schedule"):
        sac.Args(record_schedule=True)
