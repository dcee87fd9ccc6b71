"""``ProcessCollector``: acting in a child process of its own (real spawn, real env workers, a real torch policy).

Its learning equivalences (lag 0 is the sync run bitwise; lag 1 independent of speeds) are in
test_lag0_env_agents.py; here: what crosses the pipe, faults (an env that raises, a killed child), a stop that
leaves nothing behind, and an env registered only in the learner's process.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from toy_envs import CounterEnv, FaultyEnv, SleepyEnv

from asyncvec import AsyncLLMVectorEnv, TorchPolicy, VersionManager
from asyncvec.collection import CollectorError, next_segment
from asyncvec.collection.process import ProcessCollector

pytestmark = pytest.mark.timeout(240)

SPACES = (gym.spaces.Box(-100.0, 100.0, (3,), np.float32), gym.spaces.Discrete(3))


def collector(make_env, versions: VersionManager, lag: int = 1, num_envs: int = 2, **kwargs) -> ProcessCollector:
    module = torch.nn.Linear(3, 3)
    make_env = make_env if isinstance(make_env, list) else [make_env] * num_envs
    make_envs = functools.partial(AsyncLLMVectorEnv, make_env, **kwargs)
    make_policy = functools.partial(TorchPolicy, module, SPACES[1])
    return ProcessCollector(make_envs, make_policy, module.state_dict(), 4, num_envs, *SPACES, versions, lag, seed=0)


def test_each_segment_is_acted_by_the_version_its_lag_fixes(no_leftover_children):
    versions = VersionManager(max_lag=1)
    with collector(CounterEnv, versions, lag=1) as acting:
        seen = []
        for _ in range(4):
            segment = next_segment(acting, acting)
            seen.append(sorted(set(segment.policy_version.ravel().tolist())))
            versions.publish({k: v + 1 for k, v in torch.nn.Linear(3, 3).state_dict().items()})
        returns = acting.recent_returns()
    assert seen == [[0], [0], [1], [2]], seen  # segment k by version k - 1 (the first two by the first version)
    assert returns and all(r > 0 for r in returns)  # CounterEnv's episodes, from the segments' rewards


def test_an_env_that_raises_stops_the_learner_with_the_error_named(tmp_path, no_leftover_children):
    make_env = functools.partial(FaultyEnv, "raise", 3, str(tmp_path / "marker"))
    with collector(make_env, VersionManager(max_lag=1)) as acting:
        with pytest.raises(CollectorError, match="ZeroDivisionError: the simulator divided by zero") as raised:
            next_segment(acting, acting)
    assert "traceback" in "\n".join(raised.value.__notes__)


def test_a_killed_acting_process_is_an_error_not_a_hang(no_leftover_children):
    with collector(CounterEnv, VersionManager(max_lag=1)) as acting:
        next_segment(acting, acting)
        os.kill(acting._process.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(CollectorError, match="the collector process died"):
            while True:
                next_segment(acting, acting)
    assert time.monotonic() - started < 30


def test_restarts_and_placement_come_back_at_stop(tmp_path, no_leftover_children):
    make_env = [CounterEnv, functools.partial(FaultyEnv, "kill", 3, str(tmp_path / "marker"))]
    acting = collector(make_env, VersionManager(max_lag=1), max_restarts=1).start()
    try:
        next_segment(acting, acting)
    finally:
        acting.stop()
    assert acting.restarts == [0, 1], acting.restarts  # the env that killed its worker, rebuilt once
    assert acting.placement is not None and not acting.placement.in_process
    assert not acting.running


class ScriptOnlyEnv(CounterEnv):
    """Registered below under an id the child could not resolve by importing anything."""


def test_an_env_registered_only_in_the_learners_process_is_built_in_the_acting_one(no_leftover_children):
    from asyncvec.agents.common import make_vector_env, registered_spec

    gym.register("ScriptOnly-v0", entry_point=ScriptOnlyEnv, max_episode_steps=5)
    try:
        module = torch.nn.Linear(3, 3)
        acting = ProcessCollector(
            functools.partial(make_vector_env, "ScriptOnly-v0", 2),
            functools.partial(TorchPolicy, module, SPACES[1]),
            module.state_dict(), 4, 2, *SPACES, VersionManager(max_lag=1),
            env_specs=registered_spec("ScriptOnly-v0"),
        )  # fmt: skip
        with acting:
            assert next_segment(acting, acting).reward.shape == (4, 2)
    finally:
        gym.registry.pop("ScriptOnly-v0")


def test_lag_must_be_0_or_1():
    with pytest.raises(ValueError, match="lag must be 0 or 1"):
        collector(CounterEnv, VersionManager(max_lag=2), lag=2)
    with pytest.raises(ValueError, match="policy_lag must be between 0 and lag"):
        module = torch.nn.Linear(3, 3)
        ProcessCollector(
            functools.partial(AsyncLLMVectorEnv, [CounterEnv] * 2), functools.partial(TorchPolicy, module, SPACES[1]),
            module.state_dict(), 4, 2, *SPACES, VersionManager(max_lag=2), 2, partial_batches=True, policy_lag=3,
        )  # fmt: skip


def test_partial_batches_load_each_publish_as_it_arrives(no_leftover_children):
    """``partial_batches=True`` (PPO above ``--max-staleness 1``): envs answered one at a time (a straggler's 50 ms
    steps beside a fast env), the child acting with the newest version it has: no pace ties a segment to a version."""
    module = torch.nn.Linear(3, 3)
    make_envs = functools.partial(
        AsyncLLMVectorEnv, [functools.partial(SleepyEnv, 0.0), functools.partial(SleepyEnv, 0.05)], batch_size=1
    )
    make_policy = functools.partial(TorchPolicy, module, SPACES[1], max_batch_size=2, max_wait_ms=0.0)
    versions = VersionManager(max_lag=3)
    acting = ProcessCollector(
        make_envs, make_policy, module.state_dict(), 4, 2, *SPACES, versions, 3, seed=0, partial_batches=True
    )
    with acting:
        next_segment(acting, acting)
        for _ in range(3):  # three publishes at once: the child loads each as it comes, whatever the segments
            versions.publish({k: v + 1 for k, v in module.state_dict().items()})
        seen: set[int] = set()
        deadline = time.monotonic() + 60
        while 3 not in seen and time.monotonic() < deadline:
            seen |= set(next_segment(acting, acting).policy_version.ravel().tolist())
        steps = acting.metrics()["env_steps"]
    assert 3 in seen and max(seen) <= 3, seen  # (a lockstep lag-1 child acts a segment by the version before)
    assert steps > 0 and acting._process.exitcode == 0


def test_a_script_without_a_main_guard_trains_async_ppo(tmp_path, no_leftover_children):
    """The acting process starts as gymnasium's AsyncVectorEnv starts its workers (the default start method): a
    user's script calling PPO at module level works (under spawn it re-ran the script in the child and hung)."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "from asyncvec.agents.ppo import PPO, Args\n"
        "result = PPO(Args(num_envs=2, num_steps=16, total_timesteps=128, progress=False, track=False)).train()\n"
        "print('trained', result.global_step, result.staleness_histogram[:2])\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained 128 [32, 96]" in done.stdout, done.stdout


def test_a_learner_killed_outright_leaves_no_acting_process_behind(tmp_path):
    """SIGKILL of the learner closes its end of the pipe: the acting process stops its envs and exits."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        "from asyncvec.agents.ppo import PPO, Args\n"
        "print(os.getpid(), flush=True)\n"
        "PPO(Args(num_envs=2, num_steps=16, total_timesteps=10**9, progress=False, track=False)).train()\n"
    )
    learner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    pid = int(learner.stdout.readline())

    def descendants(root: int) -> set[int]:
        found, todo = set(), [root]
        while todo:
            for path in glob.glob(f"/proc/{todo.pop()}/task/*/children"):
                with contextlib.suppress(FileNotFoundError):
                    children = {int(p) for p in open(path).read().split()}
                    todo.extend(children - found)
                    found |= children
        return found

    deadline = time.monotonic() + 120
    while len(descendants(pid)) < 3 and time.monotonic() < deadline:  # the acting process and its env workers
        time.sleep(0.2)
    family = descendants(pid)
    assert len(family) >= 3, family
    learner.kill()
    learner.wait(30)
    deadline = time.monotonic() + 60
    alive = family
    while alive and time.monotonic() < deadline:
        alive = {
            p for p in family if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]
        }
        time.sleep(0.2)
    assert not alive, f"left alive after the learner's SIGKILL: {alive}"
