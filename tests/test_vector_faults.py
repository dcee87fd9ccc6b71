"""Faults: an env that raises, a worker killed by SIGKILL, a hung worker, a bad action, close()."""

from __future__ import annotations

import gc
import os
import signal
import time
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
from conftest import live_children
from gymnasium.vector import AutoresetMode
from toy_envs import CounterEnv, FaultyEnv

from asyncvec import AsyncLLMVectorEnv
from asyncvec.envs.slow import SlowEnv
from asyncvec.vector.errors import ClosedEnvironmentError, WorkerError
from asyncvec.vector.faults import Fault, FaultKind, MaxRestarts

FAULTS = ["raise", "kill", "hang"]


def make_envs(tmp_path, fault, num_envs=3, faulty=1, **kwargs):
    fns = [partial(CounterEnv, max_len=50) for _ in range(num_envs)]
    fns[faulty] = partial(FaultyEnv, fault, 3, str(tmp_path / "fault-once"), max_len=50)
    kwargs.setdefault("step_timeout", 2.0)
    kwargs.setdefault("envs_per_worker", 1)  # a fault takes only its own env (tests that share workers say so)
    return AsyncLLMVectorEnv(fns, **kwargs)


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_without_restarts_raises_and_leaves_no_child(tmp_path, fault, no_leftover_children):
    envs = make_envs(tmp_path, fault)
    envs.reset(seed=0)
    expected = {"raise": "ZeroDivisionError", "kill": "WorkerDied", "hang": "StepTimeout"}[fault]
    start = time.monotonic()
    with pytest.raises(WorkerError, match=f"env 1 failed in step\\(\\): {expected}") as err:
        for _ in range(5):
            envs.step(np.ones(3, dtype=np.int64))
    assert time.monotonic() - start < 30, "a fault must never be waited on forever"
    assert err.value.env_index == 1
    if fault == "raise":
        assert "the simulator divided by zero" in str(err.value)
        assert "Traceback" in err.value.worker_traceback and "toy_envs.py" in err.value.worker_traceback
        assert isinstance(err.value.__cause__, ZeroDivisionError)
    if fault == "kill":
        assert "killed by signal 9" in str(err.value)
    assert envs.closed
    with pytest.raises(ClosedEnvironmentError):
        envs.step(np.ones(3, dtype=np.int64))


@pytest.mark.parametrize("envs_per_worker", [1, 2])
@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.value)
@pytest.mark.parametrize("fault", FAULTS)
def test_restart_in_place_lockstep(tmp_path, fault, mode, envs_per_worker, no_leftover_children):
    """Env 1 faults at step 3. With 2 envs per worker, a raising env is rebuilt alone inside its
    worker, while a dead or hung worker takes env 0, its neighbour, with it."""
    envs = make_envs(tmp_path, fault, num_envs=4, envs_per_worker=envs_per_worker, max_restarts=1, autoreset_mode=mode)
    rebuilt = [0, 1] if envs_per_worker == 2 and fault != "raise" else [1]
    try:
        obs, _ = envs.reset(seed=0)
        last = obs.copy()
        for t in range(1, 6):
            obs, rewards, term, trunc, info = envs.step(np.ones(4, dtype=np.int64))
            if t == 3:
                assert np.flatnonzero(info["_env_restarted"]).tolist() == rebuilt
                assert np.flatnonzero(trunc).tolist() == rebuilt and not term.any()
                assert (rewards[rebuilt] == 0.0).all()
                for i in rebuilt:
                    if mode == AutoresetMode.NEXT_STEP:
                        # the episode ends at the last observation seen before the fault
                        np.testing.assert_array_equal(obs[i], last[i])
                    else:
                        np.testing.assert_array_equal(info["final_obs"][i], last[i])
                        assert obs[i][0] == 0.0, "a fresh episode starts in the same step"
                # the other envs' transitions are intact
                np.testing.assert_array_equal(obs[[2, 3], 0], [3.0, 3.0])
            if t == 4 and mode == AutoresetMode.NEXT_STEP:
                assert (obs[rebuilt, 0] == 0.0).all() and (rewards[rebuilt] == 0.0).all(), "next step resets"
            last = obs.copy()
        assert envs.restarts == [1 if i in rebuilt else 0 for i in range(4)]
    finally:
        envs.close()


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_restart_in_place_partial_batches_lose_nothing(tmp_path, fault, no_leftover_children):
    envs = make_envs(tmp_path, fault, num_envs=4, faulty=2, batch_size=2, max_restarts=1, step_timeout=1.0)
    try:
        envs.async_reset(seed=0)
        steps = {i: 0 for i in range(4)}
        restarted = []
        deadline = time.monotonic() + 3.0  # longer than step_timeout, so the hang is noticed
        while time.monotonic() < deadline:
            _, _, _, trunc, info = envs.recv(timeout=20)
            for k, i in enumerate(info["env_id"].tolist()):
                steps[i] += 1
                if info.get("_env_restarted", np.zeros(len(trunc), bool))[k]:
                    restarted.append(i)
                    assert trunc[k]
            envs.send(np.ones(len(info["env_id"]), dtype=np.int64), info["env_id"])
        assert restarted == [2]
        assert all(n > 5 for n in steps.values()), steps
        assert envs.restarts == [0, 0, 1, 0]
    finally:
        envs.close()


def test_restart_budget_runs_out(tmp_path, no_leftover_children):
    class AlwaysFails(CounterEnv):
        def step(self, action):
            raise RuntimeError("broken for good")

    envs = AsyncLLMVectorEnv([CounterEnv, AlwaysFails], max_restarts=2)
    envs.reset(seed=0)
    with pytest.raises(WorkerError, match="after 2 restart") as err:
        for _ in range(10):
            envs.step(np.zeros(2, dtype=np.int64))
    assert err.value.env_index == 1


def test_reset_fault_is_retried_after_restart(tmp_path):
    marker = tmp_path / "reset-fault"

    class FailsFirstReset(CounterEnv):
        def reset(self, *, seed=None, options=None):
            if not marker.exists():
                marker.touch()
                raise OSError("simulator not ready")
            return super().reset(seed=seed, options=options)

    envs = AsyncLLMVectorEnv([CounterEnv, FailsFirstReset], max_restarts=1)
    try:
        obs, info = envs.reset(seed=5)
        assert info["env_restarted"].tolist() == [False, True]
        want, _ = CounterEnv().reset(seed=6)
        np.testing.assert_array_equal(obs[1], want)  # same seed as asked for
    finally:
        envs.close()


def test_env_that_fails_to_build():
    def broken():
        raise ImportError("no such simulator")

    calls = {"n": 0}

    def first_ok_then_broken():
        calls["n"] += 1
        if calls["n"] > 1:  # the parent's space probe succeeds; the worker's copy fails
            raise ImportError("no such simulator")
        return CounterEnv()

    with pytest.raises(ImportError):
        AsyncLLMVectorEnv([broken])
    with pytest.raises(WorkerError, match="env 0 failed in make\\(\\): ImportError: no such simulator"):
        AsyncLLMVectorEnv([first_ok_then_broken], context="fork")


@pytest.mark.parametrize(
    "actions, message",
    [
        (np.array([0, 5]), r"action 5 for env 1 is not in the action space Discrete\(3\)"),
        (np.array([0.5, 1.0]), r"for env 0 is not in the action space Discrete\(3\)"),
        (np.array([0, 1, 2]), r"Discrete\(3\)"),
    ],
)
def test_bad_action_raises_before_anything_is_sent(actions, message):
    envs = AsyncLLMVectorEnv([CounterEnv] * 2)
    try:
        envs.reset(seed=0)
        with pytest.raises(ValueError, match=message):
            envs.step(actions)
        obs, *_ = envs.step(np.array([1, 1]))  # nothing was sent: the env still works
        assert obs[:, 0].tolist() == [1.0, 1.0]
    finally:
        envs.close()


def test_bad_box_action_names_the_space():
    import gymnasium as gym

    envs = AsyncLLMVectorEnv([lambda: gym.make("Pendulum-v1")] * 2, batch_size=1)
    try:
        envs.async_reset(seed=0)
        _, _, _, _, info = envs.recv(timeout=10)
        env_id = int(info["env_id"][0])
        with pytest.raises(ValueError, match=r"shape \(2,\), expected \(1,\) of Box\(-2.0, 2.0, \(1,\), float32\)"):
            envs.send(np.zeros((1, 2)), [env_id])
        with pytest.raises(ValueError, match=rf"for env {env_id} is not in the action space Box"):
            envs.send(np.array([[3.5]]), [env_id])
        envs.send(np.array([[1.5]], dtype=np.float64), [env_id])  # castable and in bounds
        envs.recv(timeout=10)
    finally:
        envs.close()


def test_close_after_exception_and_garbage_collection(no_leftover_children):
    envs = AsyncLLMVectorEnv([CounterEnv] * 2, envs_per_worker=1)  # worker processes (not in process)
    pids = envs.worker_pids
    try:
        envs.reset(seed=0)
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        envs.close()
    assert not (set(pids) & live_children())

    envs = AsyncLLMVectorEnv([CounterEnv] * 2, envs_per_worker=1)
    pids = envs.worker_pids
    envs.async_reset()  # dropped with a command in flight
    del envs
    gc.collect()
    assert not (set(pids) & live_children())


def test_close_kills_a_worker_stuck_in_step(tmp_path, no_leftover_children):
    envs = make_envs(tmp_path, "hang", step_timeout=None, envs_per_worker=1)  # a worker process, killable
    envs.reset(seed=0)
    for _ in range(2):
        envs.step(np.ones(3, dtype=np.int64))
    envs.step_async(np.ones(3, dtype=np.int64))  # env 1 hangs in this step
    start = time.monotonic()
    envs.close(timeout=0.5)
    assert time.monotonic() - start < 10


def test_context_manager_closes():
    with AsyncLLMVectorEnv([CounterEnv] * 2, envs_per_worker=1) as envs:
        envs.reset(seed=0)
        pids = envs.worker_pids
    assert envs.closed
    assert not (set(pids) & live_children())


def test_worker_exits_when_parent_dies(tmp_path):
    """A worker whose parent was SIGKILLed exits on its own instead of lingering."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from toy_envs import CounterEnv
        from asyncvec import AsyncLLMVectorEnv
        envs = AsyncLLMVectorEnv([CounterEnv] * 2, envs_per_worker=1)
        print(*envs.worker_pids, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
            time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{p}") for p in pids), "workers outlived their parent"
    finally:
        parent.kill()


# ---------------------------------------------------------------- several envs per worker


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_in_a_shared_worker_names_the_env(tmp_path, fault, no_leftover_children):
    """Env 1 shares its worker with env 0: the error names env 1 (the one that failed), not the worker."""
    envs = make_envs(tmp_path, fault, num_envs=4, envs_per_worker=2)
    envs.reset(seed=0)
    expected = {"raise": "ZeroDivisionError", "kill": "WorkerDied", "hang": "StepTimeout"}[fault]
    with pytest.raises(WorkerError, match=f"env 1 failed in step\\(\\): {expected}") as err:
        for _ in range(5):
            envs.step(np.ones(4, dtype=np.int64))
    assert err.value.env_index == 1
    if fault != "raise":
        assert "also hosted envs [0]" in str(err.value)
    assert envs.closed


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_idle_env_of_a_dead_worker_comes_back_truncated(tmp_path, fault, no_leftover_children):
    """Env 0 waits (idle, episode running) while env 1, on the same worker, kills or hangs it."""
    envs = make_envs(tmp_path, fault, num_envs=2, envs_per_worker=2, batch_size=1, max_restarts=1, step_timeout=1.0)
    try:
        envs.async_reset(seed=0)
        envs.recv(timeout=10)
        envs.recv(timeout=10)
        envs.send(np.array([1]), [0])
        obs0, *_ = envs.recv(timeout=10)  # env 0: t=1, then it waits
        for t in range(1, 4):
            envs.send(np.array([1]), [1])
            _, _, _, trunc, info = envs.recv(timeout=20)
            assert info["env_id"].tolist() == [1]
        assert trunc[0] and info["env_restarted"][0], "env 1's third step was lost with its worker"
        envs.send(np.array([1]), [0])
        obs, rewards, term, trunc, info = envs.recv(timeout=10)
        assert info["env_id"].tolist() == [0] and trunc[0] and not term[0] and rewards[0] == 0.0
        assert info["env_restarted"][0] and fault_name(fault) in info["restart_reason"][0]
        np.testing.assert_array_equal(obs[0], obs0[0])  # ends at the last observation it had
        envs.send(np.array([1]), [0])
        obs, rewards, _, trunc, info = envs.recv(timeout=10)
        assert obs[0][0] == 0.0 and rewards[0] == 0.0 and not trunc[0], "then NEXT_STEP resets it"
        assert "env_restarted" not in info
        assert envs.restarts == [1, 1]
    finally:
        envs.close()


def fault_name(fault: str) -> str:
    return {"kill": "WorkerDied", "hang": "StepTimeout"}[fault]


def test_observation_of_the_wrong_shape_names_the_env():
    class ShortObs(CounterEnv):
        def step(self, action):
            obs, *rest = super().step(action)
            return obs[:2], *rest

    envs = AsyncLLMVectorEnv([CounterEnv, ShortObs], envs_per_worker=2)
    envs.reset(seed=0)
    with pytest.raises(
        WorkerError,
        match=r"env 1 failed in step\(\): ValueError: observation of env 1 has shape \(2,\), expected \(3,\)",
    ):
        envs.step(np.ones(2, dtype=np.int64))
    assert envs.closed


# ---------------------------------------------------------------- reproducible restarts


def run_with_a_fault(marker, fault, mode, envs_per_worker, steps=12, **kwargs):
    """Steps 4 envs (env 1 faults once at its step 3) and returns everything they answered."""
    fns = [partial(CounterEnv, max_len=50) for _ in range(4)]
    fns[1] = partial(FaultyEnv, fault, 3, str(marker), max_len=50)
    envs = AsyncLLMVectorEnv(fns, max_restarts=1, autoreset_mode=mode, envs_per_worker=envs_per_worker, **kwargs)
    try:
        obs, _ = envs.reset(seed=10)
        trace = [obs.copy()]
        for _ in range(steps):
            obs, rewards, term, trunc, info = envs.step(np.ones(4, dtype=np.int64))
            trace += [obs.copy(), rewards.copy(), term.copy(), trunc.copy()]
            if "final_obs" in info:
                trace.append(np.stack([o if o is not None else np.zeros(3, np.float32) for o in info["final_obs"]]))
        return trace, envs.restarts
    finally:
        envs.close()


@pytest.mark.parametrize(
    "fault, mode, envs_per_worker",
    [
        ("raise", AutoresetMode.NEXT_STEP, 1),
        ("raise", AutoresetMode.SAME_STEP, None),  # the default: a worker per env
        ("kill", AutoresetMode.SAME_STEP, 2),
        ("kill", AutoresetMode.NEXT_STEP, 2),
    ],
    ids=lambda v: getattr(v, "value", str(v)),
)
def test_runs_with_a_restart_are_reproducible(tmp_path, fault, mode, envs_per_worker):
    """Two runs with the same seeds, actions and fault give the same episodes, also after the
    restart: a rebuilt env's next reset is seeded with ``restart_seed(its seed, its restart count)``."""
    first, restarts = run_with_a_fault(tmp_path / "first", fault, mode, envs_per_worker)
    second, _ = run_with_a_fault(tmp_path / "second", fault, mode, envs_per_worker)
    rebuilt = [1] if fault == "raise" else [0, 1]  # a killed worker takes env 0, its neighbour, with it
    assert restarts == [1 if i in rebuilt else 0 for i in range(4)]
    assert len(first) == len(second)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "fault, placement", [("raise", {}), ("raise", {"in_process": True}), ("kill", {"envs_per_worker": 1})]
)
def test_a_rebuilt_env_resets_with_its_restart_seed(tmp_path, fault, placement):
    """Env 1 (seed 11) faults on its first step; the next step is its rebuilt env's reset,
    seeded with ``restart_seed(11, 1)``, and the episode goes on as a fresh env's would."""
    from asyncvec.vector import restart_seed

    marker = str(tmp_path / "fault-once")
    envs = AsyncLLMVectorEnv([CounterEnv, partial(FaultyEnv, fault, 1, marker)], max_restarts=1, **placement)
    reference = CounterEnv()
    try:
        envs.reset(seed=10)
        _, _, _, trunc, info = envs.step(np.ones(2, dtype=np.int64))
        assert trunc[1] and info["env_restarted"][1]
        obs, rewards, *_ = envs.step(np.ones(2, dtype=np.int64))  # NEXT_STEP: the reset step
        want, _ = reference.reset(seed=restart_seed(11, 1))
        np.testing.assert_array_equal(obs[1], want)
        obs, rewards, *_ = envs.step(np.ones(2, dtype=np.int64))
        want, reward, *_ = reference.step(1)
        np.testing.assert_array_equal(obs[1], want)
        assert rewards[1] == reward
    finally:
        envs.close()


def test_fault_settings_set_after_construction_apply() -> None:
    """step_timeout and max_restarts are read where they are used: setting them later takes effect."""
    envs = AsyncLLMVectorEnv([lambda: SlowEnv(gym.make("CartPole-v1"), latency_ms=5000)] * 2, in_process=False)
    try:
        envs.reset(seed=0)
        envs.step_timeout, envs.max_restarts = 0.5, 0
        assert (envs.step_timeout, envs.max_restarts) == (0.5, 0)
        with pytest.raises(WorkerError, match="StepTimeout"):
            envs.step(envs.action_space.sample())
        with pytest.raises(ValueError, match="max_restarts must be >= 0"):
            envs.max_restarts = -1
    finally:
        envs.close()


def test_a_step_timeout_set_on_envs_placed_in_process_is_refused_saying_why() -> None:
    envs = AsyncLLMVectorEnv([lambda: gym.make("CartPole-v1")] * 2, in_process=True)
    try:
        with pytest.raises(ValueError, match="chosen by placement for a cheap env.*in_process=False"):
            envs.step_timeout = 1.0
        assert envs.step_timeout is None
    finally:
        envs.close()


class NoHangs:
    """A fault policy of a user's own: restart envs that raised or died, never a hang; keeps what it was asked."""

    def __init__(self):
        self.faults: list[Fault] = []

    def restart(self, fault: Fault) -> bool:
        self.faults.append(fault)
        return fault.kind is not FaultKind.STEP_TIMEOUT


@pytest.mark.parametrize("envs_per_worker", [1, 2])
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_policy_decides_what_restarts(tmp_path, fault, envs_per_worker, no_leftover_children):
    policy = NoHangs()
    envs = make_envs(tmp_path, fault, num_envs=4, envs_per_worker=envs_per_worker, fault_policy=policy)
    try:
        assert envs.fault_policy is policy and envs.max_restarts is None
        envs.reset(seed=0)
        if fault == "hang":
            with pytest.raises(WorkerError, match="env 1 failed in step\\(\\): StepTimeout"):
                for _ in range(5):
                    envs.step(np.ones(4, dtype=np.int64))
            assert envs.closed
        else:
            for _ in range(5):
                envs.step(np.ones(4, dtype=np.int64))
            rebuilt = [0, 1] if envs_per_worker == 2 and fault == "kill" else [1]
            assert envs.restarts == [1 if i in rebuilt else 0 for i in range(4)]
        kind = {"raise": FaultKind.ENV_RAISED, "kill": FaultKind.WORKER_DIED, "hang": FaultKind.STEP_TIMEOUT}[fault]
        (seen,) = policy.faults
        assert (seen.env, seen.kind, seen.command, seen.restarts) == (1, kind, "step", 0)
        assert seen.envs == ((0, 1) if envs_per_worker == 2 and fault != "raise" else (1,))
        assert seen.error[0] == {"raise": "ZeroDivisionError", "kill": "WorkerDied", "hang": "StepTimeout"}[fault]
    finally:
        envs.close()


def test_fault_policy_arguments_are_checked():
    with pytest.raises(ValueError, match="max_restarts=1 or fault_policy, not both"):
        AsyncLLMVectorEnv([CounterEnv], max_restarts=1, fault_policy=NoHangs())
    with pytest.raises(TypeError, match="fault_policy must have a restart\\(fault\\) -> bool method, got int"):
        AsyncLLMVectorEnv([CounterEnv], fault_policy=3)
    with AsyncLLMVectorEnv([CounterEnv], max_restarts=2) as envs:
        assert envs.fault_policy == MaxRestarts(2)
        envs.fault_policy = NoHangs()
        assert envs.max_restarts is None
        envs.max_restarts = 1
        assert envs.fault_policy == MaxRestarts(1)
        with pytest.raises(TypeError, match="fault_policy must have"):
            envs.fault_policy = "restart"
