"""Every agent's command line behaves the same way (issue 38): Ctrl-C stops it with exit code 130, its
checkpoint written and said where, nothing of it left running; ``--resume`` goes on in the same run folder
and step axis, says when there is nothing left to do, and refuses another env or a missing checkpoint in
one line; ``--version``; where the results go, said at the start and at the end; an env that fails in its
worker is one line; run folders hold no colon."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from terminal import sigint_as_in_a_terminal

BIN = Path(sys.executable).parent

USER_ENVS = '''
"""A user's module: a numeric env that fails on its 4th step, and a text game without gymnasium spaces."""
import gymnasium as gym
import numpy as np


class FailsOnStep(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        if self.t > 3:
            raise ValueError("the sensor is unplugged")
        return np.zeros(2, np.float32), 1.0, False, False, {}


class LetterGame:
    def reset(self):
        return "say a"

    def step(self, text):
        return "", float(text == "a"), True


class NeedsALicense(gym.Env):
    def __init__(self):
        raise RuntimeError("no license server")


def reward_without_prompt(completion):
    return 1.0


gym.register("FailsOnStep-v0", entry_point=FailsOnStep)
gym.register("Letter-v0", entry_point=LetterGame)
gym.register("NeedsALicense-v0", entry_point=NeedsALicense)
'''

LM_SHORT = ["--prompts-per-update", "2", "--group-size", "2", "--eval-prompts", "0", "--no-progress"]
PPO_SHORT = ["--num-envs", "2", "--num-steps", "16", "--update-epochs", "1", "--no-progress"]

# agent -> (options of a long run, the checkpoint file it writes in --checkpoint-dir, or None without one)
LONG_RUNS = {
    "ppo": ([*PPO_SHORT, "--total-timesteps", "10000000"], "ppo.pt"),
    "sac": (
        [
            "--env",
            "Pendulum-v1",
            "--num-envs",
            "1",
            "--learning-starts",
            "64",
            "--checkpoint-every",
            "64",
            "--total-timesteps",
            "10000000",
            "--no-progress",
        ],
        "sac.pt",
    ),  # fmt: skip
    "ppo_chunks": (["--iterations", "1000", "--eval-rounds", "0", "--no-progress", "--ticks-per-rollout", "8"], None),
    "rloo": ([*LM_SHORT, "--total-prompts", "100000"], "rloo.pt"),
    "reinforce_pp": ([*LM_SHORT, "--total-prompts", "100000"], "reinforce_pp.pt"),
    "grpo": ([*LM_SHORT, "--total-prompts", "100000"], "grpo.pt"),
}


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("my_project")
    (folder / "user_envs.py").write_text(textwrap.dedent(USER_ENVS))
    return folder


def environment(marker: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ASYNCVEC_TRACEBACK")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", ASYNCVEC_TEST_RUN=marker)
    return env


def run(command: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """``command`` from ``cwd`` as a user runs it: no PYTHONPATH, the venv's commands on PATH."""
    return subprocess.run(command, cwd=cwd, env=environment(), capture_output=True, text=True, timeout=timeout)


def script(agent: str) -> str:
    return "asyncvec-" + agent.replace("_", "-")


def processes_marked(marker: str) -> list[int]:
    """Processes whose environment holds ``ASYNCVEC_TEST_RUN=marker`` (a run's and everything it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"ASYNCVEC_TEST_RUN={marker}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def one_line_error(done: subprocess.CompletedProcess, *parts: str) -> str:
    """The one error line of a run that ended with exit code 2 (a value an option's check refuses too: no tyro
    box)."""
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    assert "Traceback" not in done.stderr and "Error parsing" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, done.stderr[-3000:]
    for part in parts:
        assert part in errors[0], errors[0]
    return errors[0]


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
@pytest.mark.parametrize("agent", list(LONG_RUNS))
def test_ctrl_c_stops_every_agent_with_130_and_its_checkpoint(agent, tmp_path):
    options, checkpoint_name = LONG_RUNS[agent]
    marker = uuid.uuid4().hex
    checkpoint = tmp_path / "ckpt" / checkpoint_name if checkpoint_name else None
    proc = subprocess.Popen(
        [script(agent), *options, "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "runs")]
        if checkpoint
        else [script(agent), *options, "--log-dir", str(tmp_path / "runs")],
        cwd=tmp_path,
        env=environment(marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    try:
        deadline = time.monotonic() + 240
        ready = (lambda: checkpoint.exists()) if checkpoint else (lambda: any((tmp_path / "runs").glob("*/events.*")))
        while not ready() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert ready(), proc.communicate(timeout=60)
        time.sleep(1.0 if checkpoint else 4.0)  # into training (ppo_chunks: past its first iteration)
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the whole process group
        interrupted = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - interrupted
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, (proc.returncode, out[-2000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    stopped = [line for line in out.splitlines() if "stopped at" in line]
    assert len(stopped) == 1, out
    if checkpoint:
        assert checkpoint.exists() and f"checkpoint at {checkpoint} (at " in stopped[0], stopped[0]
        assert stopped[0].endswith(", the last complete update)"), stopped[0]
    else:
        assert "checkpoint at none (this agent keeps none)" in stopped[0], stopped[0]
    assert took < 30, (
        f"{agent} took {took:.1f} s to stop after Ctrl-C (alone about 1 s); where it waited:\n{err[-6000:]}"
    )
    deadline = time.monotonic() + 10
    while processes_marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_marked(marker), f"processes of the interrupted {agent} run are still alive"


def test_option_errors_are_one_line_and_name_the_option_meant(tmp_path):
    """The docs promise one line, exit 2: a value a field's check refuses printed as tyro's 6-9-line box, and
    --lr suggested --anneal-lr."""
    bad_json = run([script("ppo"), "--env-kwargs", "g=9.81"], tmp_path)
    line = one_line_error(bad_json, "ppo: error: --env-kwargs must be a JSON object")
    assert bad_json.stderr.strip() == line.strip(), bad_json.stderr  # the line is all stderr holds
    no_folder = run([script("ppo"), "--resume"], tmp_path)
    assert "--resume needs --checkpoint-dir" in one_line_error(no_folder, "ppo: error:")
    typo = run([script("ppo"), "--lr", "0.001"], tmp_path)
    line = one_line_error(typo, "unrecognized option --lr")
    assert "(did you mean --learning-rate?)" in line and "anneal" not in line, line


def test_sac_resume_of_a_finished_run_says_there_is_nothing_left_to_do(tmp_path):
    """It crashed with a 16-line traceback (AttributeError: 'SAC' object has no attribute 'close'), exit 1."""
    common = ["--env", "Pendulum-v1", "--num-envs", "2", "--total-timesteps", "64", "--learning-starts", "32"]
    common += ["--checkpoint-dir", "ckpt", "--no-progress", "--no-track"]
    first = run([script("sac"), *common], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run([script("sac"), *common, "--resume"], tmp_path)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert "nothing left to do" in again.stdout and "raise --total-timesteps" in again.stdout, again.stdout


def test_ppo_resume_goes_on_in_the_same_run_folder_and_step_axis(tmp_path):
    common = [*PPO_SHORT, "--checkpoint-dir", "ckpt", "--log-dir", "runs"]
    first = run([script("ppo"), *common, "--total-timesteps", "64"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.startswith("PPO: logs: runs/CartPole-v1__ppo__async__1__"), first.stdout
    again = run([script("ppo"), *common, "--total-timesteps", "64", "--resume"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing left to do" in again.stdout and "raise --total-timesteps" in again.stdout, again.stdout
    assert "steps/s" not in again.stdout, again.stdout
    more = run([script("ppo"), *common, "--total-timesteps", "128", "--resume"], tmp_path)
    assert more.returncode == 0, more.stderr[-3000:]
    assert (
        "PPO 128 steps (resumed at step 64: 64 in this run) in" in more.stdout
        and "no episode finished yet" not in more.stdout
    ), more.stdout
    folders = list((tmp_path / "runs").iterdir())
    assert len(folders) == 1, folders  # one TensorBoard run: the curve does not split
    steps = tensorboard_steps(folders[0], "charts/version")
    assert steps == [32, 64, 96, 128], steps  # the resumed run's steps go on from the checkpoint's


def tensorboard_steps(folder: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return sorted(event.step for event in events.Scalars(tag))


def test_rloo_checkpoint_and_resume(tmp_path):
    common = [*LM_SHORT, "--checkpoint-dir", "ckpt", "--log-dir", "runs"]
    first = run([script("rloo"), *common, "--total-prompts", "4"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "ckpt" / "rloo.pt").exists()
    more = run([script("rloo"), *common, "--total-prompts", "8", "--resume"], tmp_path)
    assert more.returncode == 0, more.stderr[-3000:]
    folders = list((tmp_path / "runs").iterdir())
    assert len(folders) == 1, folders
    assert tensorboard_steps(folders[0], "charts/reward") == [2, 4, 6, 8]
    import torch

    state = torch.load(tmp_path / "ckpt" / "rloo.pt", weights_only=False)
    assert (state["updates"], state["prompts_done"], state["run_name"]) == (4, 8, folders[0].name)
    assert state["version"] >= 1 and {"learner", "optimizer", "rng"} <= set(state)
    done = run([script("rloo"), *common, "--total-prompts", "8", "--resume"], tmp_path)
    assert done.returncode == 0 and "nothing left to do" in done.stdout and "--total-prompts" in done.stdout


@pytest.mark.parametrize(
    "agent, options, parts",
    [
        ("ppo", ["--env", "Acrobot-v1"], ["PPO: error: --resume:", "--env CartPole-v1, not Acrobot-v1", "pass --env"]),
        ("ppo", ["--checkpoint-dir", "elsewhere"], ["PPO: error: --resume: no checkpoint at elsewhere/ppo.pt"]),
        ("sac", ["--env", "Pendulum-v1"], ["SAC: error: --resume: no checkpoint at ckpt/sac.pt"]),
        ("rloo", [], ["RLOO: error: --resume: no checkpoint at ckpt/rloo.pt"]),
    ],
    ids=["ppo-other-env", "ppo-no-checkpoint", "sac-no-checkpoint", "rloo-no-checkpoint"],
)
def test_resume_that_cannot_go_on_is_one_line(agent, options, parts, tmp_path):
    if agent == "ppo":
        first = run([script("ppo"), *PPO_SHORT, "--total-timesteps", "32", "--checkpoint-dir", "ckpt"], tmp_path)
        assert first.returncode == 0, first.stderr[-3000:]
    done = run([script(agent), "--checkpoint-dir", "ckpt", *options, "--resume"], tmp_path)
    one_line_error(done, *parts)


@pytest.mark.parametrize("agent", list(LONG_RUNS))
def test_version_on_every_agent(agent, tmp_path):
    import asyncvec

    done = run([script(agent), "--version"], tmp_path, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, f"asyncvec {asyncvec.__version__}"), done.stderr[-2000:]


def test_env_failing_in_its_worker_is_one_line_with_the_traceback_once(user_folder):
    done = run([script("ppo"), "--env", "user_envs:FailsOnStep-v0", *PPO_SHORT, "--log-dir", "runs"], user_folder)
    line = one_line_error(
        done,
        "PPO: error: your env failed:",
        "ValueError: the sensor is unplugged (at user_envs.py:",
        "in step)",
        "full traceback in runs/user_envs_FailsOnStep-v0__ppo__async__1__",  # no colon in the run folder
    )
    path = user_folder / line.split("full traceback in ")[1].split(" (")[0]
    assert path.read_text().count('raise ValueError("the sensor is unplugged")') == 1, path.read_text()
    loud = subprocess.run(
        [script("ppo"), "--env", "user_envs:FailsOnStep-v0", *PPO_SHORT, "--no-track"],
        cwd=user_folder,
        env={**environment(), "ASYNCVEC_TRACEBACK": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert loud.returncode != 0 and "Traceback" in loud.stderr, loud.stderr[-3000:]


@pytest.mark.parametrize(
    "command, parts",
    [
        (
            ["asyncvec-rloo", "--env", "user_envs:Letter-v0"],
            [
                "user_envs:Letter-v0 is registered as user_envs.LetterGame, which is not a gymnasium env",
                "asyncvec.lm.StringEnv(LetterGame(**kwargs))",
            ],
        ),  # fmt: skip
        (["asyncvec-ppo", "--env-kwargs", '{"gravity": 1}'], ["PPO: error: CartPole-v1: gym.make(", "--env-kwargs"]),
        (["asyncvec-sac", "--env", "Pendulum-v1", "--env-kwargs", "g=2"], ["--env-kwargs must be a JSON object"]),
        (
            ["asyncvec-sac", "--env", "user_envs:NeedsALicense-v0"],
            [
                "SAC: error: RuntimeError: no license server (at user_envs.py:",
                "while building the agent",
                "full traceback in",
            ],
        ),  # fmt: skip
        (["asyncvec-rloo", "--model", "no_such_model"], ["RLOO: error: --model no_such_model: no such folder"]),
    ],
    ids=[
        "text-env-without-spaces",
        "ppo-env-kwargs-refused",
        "sac-env-kwargs-not-json",
        "env-constructor-fails",
        "no-model-folder",
    ],  # fmt: skip
)
def test_user_errors_are_one_line(user_folder, command, parts):
    done = run(command, user_folder)
    one_line_error(done, *parts)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])


def test_a_reward_with_the_wrong_signature_is_named(user_folder):
    done = run(["asyncvec-rloo", "--reward", "user_envs:reward_without_prompt"], user_folder)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "must have the signature f(prompt, completion, **info)" in " ".join(done.stderr.replace("│", " ").split())


def test_missing_extra_exits_2(capsys):
    from asyncvec.agents.common import exit_on_missing_extra
    from asyncvec.extras import MissingExtraError

    with pytest.raises(SystemExit) as stop, exit_on_missing_extra("RLOO"):
        raise MissingExtraError("--backend ray needs ray, which is not installed; install it with: pip ...")
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("RLOO: error: --backend ray needs ray")  # as every one-line error


def test_env_kwargs_reach_gym_make_and_no_track_writes_no_logs(tmp_path):
    done = run(
        [script("sac"), "--env", "Pendulum-v1", "--env-kwargs", '{"g": 2.0}', "--num-envs", "1",
         "--total-timesteps", "64", "--learning-starts", "32", "--no-progress", "--no-track"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "runs").exists()
    assert "logs: not written (--track, the default, writes them; --no-track turned it off)" in done.stdout


def test_lm_run_is_quiet_and_counts_prompts(tmp_path):
    done = run([script("rloo"), *LM_SHORT[:-1], "--total-prompts", "4"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr[-3000:]
    assert "prompt/s" in done.stderr and "step/s" not in done.stderr, done.stderr[-3000:]
    assert "reward curve" not in done.stdout and "training reward" in done.stdout, done.stdout
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("RLOO: logs: runs/asyncvec_SingleDigitSums-v0__rloo__async__1__"), lines
    assert lines[-1].startswith("logs: runs/") and lines[-1].endswith(
        "checkpoint: none (--checkpoint-dir DIR saves one after every update)"
    ), lines


def test_the_past_key_values_notice_alone_is_silenced():
    import warnings

    from asyncvec.lm.learner import quiet_model_libraries

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_model_libraries()
        warnings.warn("Passing a tuple of `past_key_values` is deprecated and will be removed", FutureWarning)
        warnings.warn("another deprecation", FutureWarning)
    assert [str(w.message) for w in caught] == ["another deprecation"]


def test_train_returns_where_its_results_went(tmp_path, no_leftover_children):
    from asyncvec.agents.ppo import PPO, Args

    args = Args(num_envs=2, num_steps=16, total_timesteps=32, progress=False, log_dir=str(tmp_path / "runs"),
                checkpoint_dir=str(tmp_path / "ckpt"), env="gymnasium.envs.classic_control:CartPole-v1")  # fmt: skip
    result = PPO(args).train()
    assert result.checkpoint_path == str(tmp_path / "ckpt" / "ppo.pt")
    assert result.log_path is not None and ":" not in Path(result.log_path).name
    assert Path(result.log_path).parent == tmp_path / "runs" and any(Path(result.log_path).glob("events.*"))
