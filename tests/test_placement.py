"""How AsyncLLMVectorEnv places its envs when ``envs_per_worker`` is not given (asyncvec.vector.placement)."""

from __future__ import annotations

import logging
import os
import signal
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
from toy_envs import CounterEnv, SleepyEnv

from asyncvec import AsyncLLMVectorEnv
from asyncvec.envs.slow import SlowEnv
from asyncvec.vector.placement import StepProfile, choose_placement, profile_env


def profile(step_s, cpu_share, round_trip_s=100e-6):
    return StepProfile(step_s=step_s, cpu_share=cpu_share, round_trip_s=round_trip_s, steps=10)


@pytest.mark.parametrize(
    "num_envs, step_s, cpu_share, cores, in_process, envs_per_worker, num_workers",
    [
        (8, 5e-6, 1.0, 2, True, 8, 0),  # classic control: 8 steps in turn are cheaper than a round trip
        (8, 1e-3, 1.0, 2, False, 4, 2),  # a 1 ms simulator: one busy worker per core
        (8, 1e-3, 0.97, 2, False, 4, 2),  # a measured share a little under 1 is still one core
        (8, 1e-3, 1.0, 16, False, 1, 8),  # more cores than envs: one env each
        (1, 0.5, 0.0, 2, False, 1, 1),  # one slow env: a worker, so that its steps overlap the caller
        (16, 10e-3, 0.01, 2, False, 1, 16),  # sleeps: every env its own worker, they overlap
        (16, 1e-3, 0.5, 2, False, 4, 4),  # half waiting: twice as many workers as cores
        (64, 5e-6, 1.0, 2, False, 32, 2),  # many cheap envs: 64 in turn cost more than 2 workers of 32
        (3, 5e-6, 1.0, 1, True, 3, 0),
    ],
)
def test_the_rule(num_envs, step_s, cpu_share, cores, in_process, envs_per_worker, num_workers):
    placement = choose_placement(num_envs, profile(step_s, cpu_share), cores)
    assert (placement.in_process, placement.envs_per_worker, placement.num_workers) == (
        in_process,
        envs_per_worker,
        num_workers,
    ), placement
    assert placement.profile is not None and placement.reason


def test_the_rule_without_in_process_places_cheap_envs_on_the_cores():
    placement = choose_placement(8, profile(5e-6, 1.0), 2, can_run_in_process=False)
    assert not placement.in_process and placement.num_workers == 2 and placement.envs_per_worker == 4


def test_profile_tells_a_spinning_env_from_a_sleeping_one():
    """Both take 3 ms a step; one spins the CPU, the other sleeps (margins for a loaded 2-core machine)."""
    spinning = profile_env(partial(SlowEnv, gym.make("CartPole-v1"), latency_ms=3.0, busy=True))
    sleeping = profile_env(partial(SlowEnv, gym.make("CartPole-v1"), latency_ms=3.0))
    assert spinning.cpu_share > 0.4, spinning
    assert sleeping.cpu_share < 0.2, sleeping
    assert 2.5e-3 < spinning.step_s < 0.1 and 2.5e-3 < sleeping.step_s < 0.1
    assert spinning.round_trip_s is None or spinning.round_trip_s >= 0


def test_cheap_envs_run_in_process_and_match_gymnasium(no_leftover_children):
    fns = [partial(CounterEnv, max_len=5)] * 3
    ours = AsyncLLMVectorEnv(fns)
    sync = gym.vector.SyncVectorEnv(fns)
    try:
        assert ours.placement.in_process, ours.placement
        assert ours.worker_pids == [None, None, None]
        assert "round trip" in ours.placement.reason and ours.placement.profile.steps > 0
        np.testing.assert_array_equal(ours.reset(seed=1)[0], sync.reset(seed=1)[0])
        for t in range(20):
            actions = np.array([t % 3, 1, 2])
            for got, want in zip(ours.step(actions)[:4], sync.step(actions)[:4]):
                np.testing.assert_array_equal(got, want)
    finally:
        ours.close()
        sync.close()


def test_sleeping_envs_get_a_worker_each(no_leftover_children):
    with AsyncLLMVectorEnv([partial(SleepyEnv, 0.01)] * 3) as envs:
        assert not envs.placement.in_process and envs.placement.envs_per_worker == 1, envs.placement
        assert len(set(envs.worker_pids)) == 3


def test_step_timeout_keeps_envs_in_workers(no_leftover_children):
    with AsyncLLMVectorEnv([CounterEnv] * 2, step_timeout=5.0) as envs:
        assert not envs.placement.in_process
        assert all(pid is not None for pid in envs.worker_pids)


def test_explicit_envs_per_worker_wins_and_is_not_measured():
    with AsyncLLMVectorEnv([CounterEnv] * 4, envs_per_worker=2) as envs:
        assert envs.placement.profile is None and envs.placement.reason == "envs_per_worker given"
        assert (envs.placement.envs_per_worker, envs.placement.num_workers) == (2, 2)
    with AsyncLLMVectorEnv([CounterEnv] * 2, in_process=True) as envs:
        assert envs.placement.in_process and envs.placement.profile is None
    with AsyncLLMVectorEnv([CounterEnv] * 2, in_process=False) as envs:
        assert not envs.placement.in_process


def test_text_actions_are_not_probed():
    """Random strings are not meaningful actions of a text env: one env per worker, unmeasured."""
    import asyncvec.envs  # noqa: F401  (registers asyncvec/GuessNumber-v0)

    with AsyncLLMVectorEnv([lambda: gym.make("asyncvec/GuessNumber-v0")] * 2) as vector_env:
        assert vector_env.placement.envs_per_worker == 1 and vector_env.placement.profile is None
        assert "not fixed-shape" in vector_env.placement.reason


class KillsItsProcessOnStep(CounterEnv):
    """Kills the process it steps in: only the probe's child (and the workers) may host it."""

    def step(self, action):
        os.kill(os.getpid(), signal.SIGKILL)


class RaisesOnStep(CounterEnv):
    def step(self, action):
        raise RuntimeError("this env cannot step")


@pytest.mark.parametrize(
    "env_cls, why", [(KillsItsProcessOnStep, "WorkerDied"), (RaisesOnStep, "this env cannot step")]
)
def test_a_failed_measurement_falls_back_to_one_env_per_worker(env_cls, why, no_leftover_children):
    with AsyncLLMVectorEnv([env_cls] * 2) as envs:
        assert envs.placement.envs_per_worker == 1 and not envs.placement.in_process
        assert "measurement failed" in envs.placement.reason and why in envs.placement.reason


def test_the_choice_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="asyncvec.vector"):
        AsyncLLMVectorEnv([CounterEnv] * 2).close()
    assert any("places its envs" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"in_process": True, "envs_per_worker": 2}, "do not also give envs_per_worker"),
        ({"in_process": True, "step_timeout": 1.0}, "cannot enforce step_timeout"),
        ({"in_process": True, "backend": "ray"}, "needs the default backend"),
        ({"envs_per_worker": 0}, "envs_per_worker must be an int >= 1 or None"),
    ],
)
def test_contradictory_placement_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AsyncLLMVectorEnv([CounterEnv] * 2, **kwargs)


def test_an_in_process_env_that_raises_names_itself_and_closes(tmp_path):
    from toy_envs import FaultyEnv

    from asyncvec.vector.errors import ClosedEnvironmentError, WorkerError

    fns = [partial(CounterEnv, max_len=50), partial(FaultyEnv, "raise", 2, str(tmp_path / "once"), max_len=50)]
    envs = AsyncLLMVectorEnv(fns, in_process=True)
    envs.reset(seed=0)
    envs.step(np.ones(2, dtype=np.int64))
    with pytest.raises(WorkerError, match=r"env 1 failed in step\(\): ZeroDivisionError") as err:
        envs.step(np.ones(2, dtype=np.int64))
    assert err.value.env_index == 1 and isinstance(err.value.__cause__, ZeroDivisionError)
    with pytest.raises(ClosedEnvironmentError, match="closed itself"):
        envs.step(np.ones(2, dtype=np.int64))


class ActsOnTheWorld(CounterEnv):
    """An env whose steps must not be taken at random (hardware, a paid service): it says so."""

    metadata = {**CounterEnv.metadata, "asyncvec_probe": False}

    def step(self, action):
        raise AssertionError("the probe must not step an env that declares asyncvec_probe=False")


def test_an_env_can_refuse_the_probe():
    with AsyncLLMVectorEnv([ActsOnTheWorld] * 2) as envs:
        assert envs.placement.profile is None and envs.placement.envs_per_worker == 1
        assert "asyncvec_probe" in envs.placement.reason


class StartsAProcess(CounterEnv):
    """Starts (and joins) a child process when built: only a non-daemon worker may host it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        import multiprocessing

        child = multiprocessing.get_context("fork").Process(target=int)
        child.start()
        child.join()


def test_the_probe_runs_as_the_workers_do_daemon_false(no_leftover_children):
    with AsyncLLMVectorEnv([StartsAProcess] * 2, daemon=False, context="fork") as envs:
        assert envs.placement.profile is not None, envs.placement
