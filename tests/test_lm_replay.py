"""``--record-schedule`` / ``--replay``: an async LM run's batches (which samples, of which versions,
entered which update) are kept, and a replay without generation ends with the same parameters."""

from __future__ import annotations

import pytest
import torch
from test_agents_interrupt import one_line_error, run, script

from asyncvec.agents import grpo, rloo
from asyncvec.inference import build_tiny_lm
from asyncvec.lm import sft_warm_start
from asyncvec.lm.prompts import solved_prompts
from asyncvec.schedule import ScheduleError

# policy_wait_ms=0 and one version of staleness allowed: generation runs ahead, so batches mix versions
RUN = {
    "progress": False,
    "eval_prompts": 0,
    "prompts_per_update": 4,
    "group_size": 4,
    "total_prompts": 20,
    "learning_rate": 3e-3,
    "policy_wait_ms": 0.0,
    "max_staleness": 1,
    "mode": "async",
}


@pytest.fixture(scope="module")
def warm_dir(tmp_path_factory):
    base = build_tiny_lm(tmp_path_factory.mktemp("base"), n_layer=1, n_embd=32, seed=0)
    return sft_warm_start(base, tmp_path_factory.mktemp("sft"), solved_prompts("asyncvec/SingleDigitSums-v0", 0), 150)


@pytest.fixture(scope="module")
def recorded(warm_dir, tmp_path_factory):
    """An async RLOO run with its schedule recorded: (its schedule folder, its final parameters)."""
    logs = tmp_path_factory.mktemp("runs")
    with rloo.RLOO(rloo.Args(model=str(warm_dir), log_dir=str(logs), record_schedule=True, **RUN)) as agent:
        agent.train()
        return agent.run_dir / "schedule", {k: v.detach().clone() for k, v in agent.learner.state_dict().items()}


def test_a_replay_ends_with_the_recorded_runs_parameters_bitwise(warm_dir, recorded, tmp_path):
    schedule, parameters = recorded
    assert len(list(schedule.glob("update_*.pt"))) == 5
    options = {**RUN, "log_dir": str(tmp_path), "track": False, "mode": "sync"}
    with rloo.RLOO(rloo.Args(model=str(warm_dir), replay=str(schedule), **options)) as agent:
        result = agent.train()
        replayed = agent.learner.state_dict()
    assert result.updates == 5 and result.prompts == 20
    assert all(torch.equal(replayed[name], parameters[name]) for name in parameters)
    # a fresh async run of the same options is another run: the schedule is what made the replay exact
    with rloo.RLOO(rloo.Args(model=str(warm_dir), **options)) as fresh:  # closed: no thread left behind
        start = {k: v.clone() for k, v in fresh.learner.state_dict().items()}
    assert any(not torch.equal(start[name], parameters[name]) for name in parameters), "training changed nothing"


def test_a_schedule_that_cannot_be_replayed_is_one_clear_error(warm_dir, recorded, tmp_path):
    schedule, _ = recorded
    base = {**RUN, "log_dir": str(tmp_path), "track": False}
    cases = [
        (rloo.RLOO, rloo.Args(model=str(warm_dir), replay=str(tmp_path / "nowhere"), **base), "no recorded schedule"),
        (grpo.GRPO, grpo.Args(model=str(warm_dir), replay=str(schedule), **base), "recorded by rloo, not grpo"),
        (
            rloo.RLOO,
            rloo.Args(model=str(warm_dir), replay=str(schedule), **{**base, "learning_rate": 1e-3}),
            "recorded with --learning-rate 0.003, not 0.001",
        ),
    ]
    for agent_cls, args, message in cases:
        with pytest.raises(ScheduleError, match=message):
            agent_cls(args)
    cut = tmp_path / "cut"
    cut.mkdir()
    for path in schedule.iterdir():
        if path.name != "update_000001.pt":
            (cut / path.name).write_bytes(path.read_bytes())
    with pytest.raises(ScheduleError, match="update 1 is missing .* the schedule is cut"):
        rloo.RLOO(rloo.Args(model=str(warm_dir), replay=str(cut), **base))
    with pytest.raises(ValueError, match="leave out --resume"):
        rloo.Args(replay=str(schedule), resume=True, checkpoint_dir="ck")
    # the last update file cut to a third: refused before anything runs (it ended the run mid-training, exit 1)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    files = sorted(schedule.iterdir())
    for path in files:
        (truncated / path.name).write_bytes(path.read_bytes())
    last = sorted(truncated.glob("update_*.pt"))[-1]
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 3])
    with pytest.raises(ScheduleError, match=f"{last.name} is unreadable .* the schedule is cut"):
        rloo.RLOO(rloo.Args(model=str(warm_dir), replay=str(truncated), **base))


def test_replay_of_a_missing_folder_on_the_command_line_is_one_line(tmp_path):
    done = run([script("rloo"), "--replay", "nowhere", "--no-progress", "--eval-prompts", "0"], tmp_path)
    line = one_line_error(done, "RLOO: error: --replay nowhere: no recorded schedule there")
    assert done.returncode == 2 and "--record-schedule" in line, line  # the line names the fix too
