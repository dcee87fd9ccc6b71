"""Every split-phase call, with and without ``step_timeout``, on worker processes and Ray actors.

A call that is not a step or reset (``call``, ``get_attr``, ``set_attr``, ``render``) has no hang
deadline; with ``step_timeout`` set, that once reached ``multiprocessing.connection.wait`` as an
infinite timeout and left the env pending. Also: a call that fails never leaves the env pending
(it is answered and the env is idle, or the env closed itself and says why), and the adapters
that read attributes when they are built (SB3, Tianshou, ``make_vec``) build with ``step_timeout``.

One local Ray serves the whole module (started by the first Ray test).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from functools import partial

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode
from toy_envs import CounterEnv

from asyncvec import AsyncLLMVectorEnv
from asyncvec.vector.errors import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError, WorkerError

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _fail_to_load():
    raise RuntimeError("this answer cannot be read back")


class Unreadable:
    """Pickles in the worker, fails to unpickle in the parent."""

    def __reduce__(self):
        return _fail_to_load, ()


class CallEnv(CounterEnv):
    """A counter env with methods to call: a slow one and one whose answer cannot be read."""

    def slow(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def unreadable(self) -> Unreadable:
        return Unreadable()


@pytest.fixture(scope="module")
def ray_started():
    import ray

    if ray.is_initialized():  # left by an earlier module in this process: use it as it is
        yield
        return
    # A Ray of its own (never one that $RAY_ADDRESS names). Actors import this module and
    # toy_envs from here, and asyncvec from where the driver does.
    path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


@pytest.fixture(params=["process", "ray"])
def backend(request):
    if request.param == "ray":
        request.getfixturevalue("ray_started")
    return request.param


# The failure paths are the transport's, not the timeout's: on Ray (slower to start) only with one.
FAILURE_CASES = pytest.mark.parametrize(
    "backend, step_timeout",
    [("process", None), ("process", 3.0), ("ray", 3.0)],
    indirect=["backend"],
    ids=["process-no_timeout", "process-step_timeout", "ray-step_timeout"],
)


def make_envs(backend, step_timeout, **kwargs):
    # 3 envs, 2 per worker: one worker hosts two envs, the other one.
    return AsyncLLMVectorEnv(
        [partial(CallEnv, max_len=50)] * 3, backend=backend, step_timeout=step_timeout, envs_per_worker=2, **kwargs
    )


def assert_idle(envs):
    assert envs.in_flight == []
    assert envs.get_attr("max_len") == (50, 50, 50)  # a new call is accepted


@pytest.mark.parametrize("step_timeout", [None, 3.0], ids=["no_timeout", "step_timeout"])
def test_every_split_phase_call(backend, step_timeout):
    envs = make_envs(backend, step_timeout, batch_size=2)
    ones = np.ones(3, dtype=np.int64)
    try:
        # calls before any reset
        assert envs.get_attr("t") == (0, 0, 0)
        # lockstep reset and step, whole and split
        obs, _ = envs.reset(seed=0)
        assert obs[:, 0].tolist() == [0.0, 0.0, 0.0]
        envs.reset_async(seed=0)
        obs, _ = envs.reset_wait(timeout=30)
        assert obs[:, 0].tolist() == [0.0, 0.0, 0.0]
        obs, *_ = envs.step(ones)
        envs.step_async(ones)
        obs, *_ = envs.step_wait(timeout=30)
        assert obs[:, 0].tolist() == [2.0, 2.0, 2.0]
        # calls after a step: methods, attributes, with arguments, whole and split
        assert envs.get_attr("t") == (2, 2, 2)
        assert envs.call("get_wrapper_attr", "max_len") == (50, 50, 50)
        assert envs.call("slow", 0.01) == (0.01, 0.01, 0.01)
        envs.call_async("slow", 0.01)
        assert envs.call_wait(timeout=30) == (0.01, 0.01, 0.01)
        envs.call_async("get_wrapper_attr", "t")
        assert envs.call_wait() == (2, 2, 2)
        envs.set_attr("max_len", 40)
        envs.set_attr("max_len", [41, 42, 43])
        assert envs.get_attr("max_len") == (41, 42, 43)
        envs.set_attr("max_len", 50)
        frames = envs.render()
        assert len(frames) == 3 and frames[0].shape == (2, 2, 3)
        # EnvPool API: async_reset / recv, send / recv, with and without a recv timeout
        envs.async_reset(seed=1)
        first = envs.recv(timeout=30)[4]["env_id"].tolist()
        rest = envs.recv()[4]["env_id"].tolist()
        assert sorted(first + rest) == [0, 1, 2]
        envs.send(np.ones(3, dtype=np.int64))
        got = []
        while envs.in_flight:
            _, _, _, _, info = envs.recv(timeout=30)
            got += info["env_id"].tolist()
        assert sorted(got) == [0, 1, 2]
        # a lockstep call while sends are in flight is refused, and refusing leaves nothing pending
        envs.send(np.ones(1, dtype=np.int64), [0])
        with pytest.raises(AlreadyPendingCallError):
            envs.get_attr("t")
        envs.recv(timeout=30)
        assert_idle(envs)
        with pytest.raises(NoAsyncCallError):
            envs.call_wait()
        assert_idle(envs)
    finally:
        envs.close()


@FAILURE_CASES
def test_a_timed_out_wait_stays_pending_and_resumes(backend, step_timeout):
    envs = make_envs(backend, step_timeout)
    try:
        envs.reset(seed=0)
        envs.call_async("slow", 0.5)
        with pytest.raises(multiprocessing.TimeoutError, match="call_wait"):
            envs.call_wait(timeout=0.05)
        with pytest.raises(AlreadyPendingCallError):
            envs.get_attr("t")
        assert envs.call_wait(timeout=30) == (0.5, 0.5, 0.5)
        assert_idle(envs)
    finally:
        envs.close()


@FAILURE_CASES
def test_a_failed_call_leaves_nothing_pending(backend, step_timeout):
    envs = make_envs(backend, step_timeout)
    try:
        envs.reset(seed=0)
        # an env method raises: reported, the env stays usable
        with pytest.raises(WorkerError, match="env 0 failed in call\\(\\): AttributeError"):
            envs.get_attr("no_such_attribute")
        assert_idle(envs)
        # a value that cannot be sent: nothing stays pending
        with pytest.raises(Exception, match="(?i)pickle|lock"):
            envs.set_attr("lock", threading.Lock())
        assert_idle(envs)
        with pytest.raises(Exception, match="(?i)pickle|lock"):
            envs.call("get_wrapper_attr", threading.Lock())
        assert_idle(envs)
        with pytest.raises(Exception, match="(?i)pickle|lock"):
            envs.set_attr("max_len", [50, 50, threading.Lock()])  # the first worker's message went out
        assert_idle(envs)
        obs, *_ = envs.step(np.ones(3, dtype=np.int64))
        assert obs[:, 0].tolist() == [1.0, 1.0, 1.0]
    finally:
        envs.close()


@FAILURE_CASES
def test_an_answer_that_cannot_be_read_closes_the_env_and_says_why(backend, step_timeout):
    envs = make_envs(backend, step_timeout)
    try:
        envs.reset(seed=0)
        with pytest.raises(Exception, match="cannot be read back"):
            envs.call("unreadable")
        assert envs.closed
        with pytest.raises(ClosedEnvironmentError, match="closed itself after .*cannot be read back"):
            envs.get_attr("t")
    finally:
        envs.close()


@pytest.mark.parametrize("step_timeout", [None, 3.0], ids=["no_timeout", "step_timeout"])
def test_adapters_that_read_attributes_build_with_step_timeout(step_timeout):
    """SB3's VecEnv reads ``render_mode`` with get_attr when built; make_vec and Tianshou read and set attributes."""
    from asyncvec.integrations.gymnasium import make_vec
    from asyncvec.integrations.sb3 import SB3VecEnv

    venv = SB3VecEnv([partial(CounterEnv, max_len=50)] * 2, step_timeout=step_timeout)
    try:
        venv.reset()
        venv.step_async(np.ones(2, dtype=np.int64))
        venv.step_wait()
        assert venv.get_attr("t") == [1, 1]
        venv.set_attr("max_len", 7)
        assert venv.get_attr("max_len") == [7, 7]
    finally:
        venv.close()
    envs = make_vec("CartPole-v1", num_envs=2, vector_kwargs={"step_timeout": step_timeout})
    try:
        envs.reset(seed=0)
        assert envs.get_attr("spec")[0].id == "CartPole-v1"
        envs.set_attr("length", 3)
    finally:
        envs.close()


def test_tianshou_vector_env_with_step_timeout():
    from asyncvec.integrations.tianshou import TianshouVectorEnv

    envs = TianshouVectorEnv([partial(CounterEnv, max_len=50)] * 2, step_timeout=3.0)
    try:
        envs.reset()
        assert envs.get_env_attr("max_len") == [50, 50]
        envs.set_env_attr("max_len", 9)
        assert envs.get_env_attr("max_len") == [9, 9]
    finally:
        envs.close()


def test_lockstep_reset_autoreset_modes_with_step_timeout():
    """SAME_STEP and DISABLED (with a reset mask) under step_timeout, then a call (the core's
    logic, the same on both transports: worker processes only, to keep the module short)."""
    for mode in (AutoresetMode.SAME_STEP, AutoresetMode.DISABLED):
        envs = make_envs("process", 3.0, autoreset_mode=mode)
        try:
            envs.reset(seed=0)
            envs.step(np.ones(3, dtype=np.int64))
            if mode == AutoresetMode.DISABLED:
                obs, _ = envs.reset(options={"reset_mask": np.array([True, False, True])})
                assert obs[:, 0].tolist() == [0.0, 1.0, 0.0]
            assert envs.get_attr("max_len") == (50, 50, 50)
        finally:
            envs.close()


def test_a_killed_worker_reseeds_its_envs(backend, tmp_path):
    """Env 1 kills its worker (process or actor) at step 3, taking env 0 with it; both come back
    truncated and reset on the next step with ``restart_seed(seed, 1)``, on either transport."""
    from test_vector_faults import run_with_a_fault

    from asyncvec.vector import restart_seed

    trace, restarts = run_with_a_fault(
        tmp_path / "fault-once", "kill", AutoresetMode.NEXT_STEP, 2, steps=5, backend=backend, step_timeout=10.0
    )
    assert restarts == [1, 1, 0, 0]
    truncated_at_3, obs_at_4 = trace[1 + 4 * 2 + 3], trace[1 + 4 * 3]
    assert truncated_at_3.tolist() == [True, True, False, False]
    for i in (0, 1):
        np.testing.assert_array_equal(obs_at_4[i], CounterEnv(max_len=50).reset(seed=restart_seed(10 + i, 1))[0])
