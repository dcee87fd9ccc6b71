"""AsyncLLMVectorEnv against gymnasium.vector.SyncVectorEnv, and the EnvPool-style API."""

from __future__ import annotations

import multiprocessing
import time
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from toy_envs import CounterEnv, SleepyEnv

from asyncvec import AsyncLLMVectorEnv
from asyncvec.vector.checker import check_vector_env, first_difference
from asyncvec.vector.errors import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
KINDS = ["box", "discrete", "dict", "text"]


def assert_same(a, b, path="") -> None:
    found = first_difference(a, b, path)
    assert found is None, found


def run_both(kind, mode, shared_memory=True, steps=30, num_envs=3, check=False, **kwargs):
    """Steps AsyncLLMVectorEnv(**kwargs) and SyncVectorEnv side by side; ``check`` also runs check_vector_env."""
    fns = [partial(CounterEnv, obs_kind=kind) for _ in range(num_envs)]
    sync = SyncVectorEnv(fns, autoreset_mode=mode)
    ours = AsyncLLMVectorEnv(fns, autoreset_mode=mode, shared_memory=shared_memory, **kwargs)
    try:
        assert ours.observation_space == sync.observation_space
        assert ours.action_space == sync.action_space
        assert ours.metadata["autoreset_mode"] == mode == ours.autoreset_mode
        assert_same(ours.reset(seed=7), sync.reset(seed=7), "reset")
        action_space = sync.action_space
        action_space.seed(3)
        for t in range(steps):
            actions = action_space.sample()
            got, want = ours.step(actions), sync.step(actions)
            assert_same(got, want, f"step {t}")
            done = np.logical_or(want[2], want[3])
            if mode == AutoresetMode.DISABLED and done.any():
                options = {"reset_mask": done}
                assert_same(
                    ours.reset(seed=None, options=dict(options)), sync.reset(options=dict(options)), f"masked reset {t}"
                )
        if check:
            check_vector_env(ours, num_steps=30)
        return True
    finally:
        ours.close()
        sync.close()


# Placements: the default (a worker per env), in process, workers shared by two envs.
PLACEMENTS = {"defaults": {}, "in_process": {"in_process": True}, "shared_workers": {"envs_per_worker": 2}}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("kind", KINDS)
def test_equivalent_to_sync_vector_env(kind, mode, placement, no_leftover_children):
    assert run_both(kind, mode, shared_memory=True, check=kind == "dict", **PLACEMENTS[placement])


@pytest.mark.parametrize("kind", ["box", "dict"])
def test_equivalent_in_process_with_partial_batches(kind):
    assert run_both(kind, AutoresetMode.NEXT_STEP, num_envs=5, batch_size=2, in_process=True, check=True)


@pytest.mark.parametrize("kind", ["box", "dict"])
def test_equivalent_without_shared_memory(kind):
    assert run_both(kind, AutoresetMode.NEXT_STEP, shared_memory=False, steps=15)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pipes"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("kind", ["box", "discrete", "dict"])
def test_equivalent_with_several_envs_per_worker(kind, mode, shared_memory, no_leftover_children):
    """5 envs in workers of 2 (the last hosts 1): same results as SyncVectorEnv, and the contract holds."""
    assert run_both(kind, mode, shared_memory, num_envs=5, envs_per_worker=2, batch_size=3, check=kind == "dict")


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_text_equivalent_with_several_envs_per_worker(mode):
    """Text observations always travel through pipes, also from a worker hosting several envs."""
    assert run_both("text", mode, num_envs=5, envs_per_worker=2, batch_size=3)


def test_equivalent_on_cartpole_with_spawn():
    fns = [lambda: gym.make("CartPole-v1")] * 2
    sync = SyncVectorEnv(fns)
    ours = AsyncLLMVectorEnv(fns, context="spawn")
    try:
        assert_same(ours.reset(seed=1), sync.reset(seed=1))
        for t in range(60):
            actions = np.array([t % 2, (t // 3) % 2])
            assert_same(ours.step(actions), sync.step(actions), f"step {t}")
    finally:
        ours.close()
        sync.close()


def test_text_observations_go_through_pipes():
    envs = AsyncLLMVectorEnv([partial(CounterEnv, obs_kind="text")] * 2, shared_memory=True)
    try:
        assert envs.shared_memory is False
        obs, _ = envs.reset(seed=0)
        assert isinstance(obs, tuple) and all(isinstance(o, str) for o in obs)
    finally:
        envs.close()


def test_call_get_set_attr_and_render():
    envs = AsyncLLMVectorEnv([partial(CounterEnv, render_mode="rgb_array")] * 2)
    try:
        envs.reset(seed=0)
        assert envs.get_attr("max_len") == (6, 6)
        envs.set_attr("max_len", [3, 4])
        assert envs.get_attr("max_len") == (3, 4)
        assert envs.call("_obs")[0].shape == (3,)
        frames = envs.render()
        assert len(frames) == 2 and frames[0].shape == (2, 2, 3)
        with pytest.raises(ValueError, match="length equal"):
            envs.set_attr("max_len", [1, 2, 3])
    finally:
        envs.close()


def test_split_phase_state_errors():
    envs = AsyncLLMVectorEnv([CounterEnv] * 2)
    envs.reset(seed=0)
    with pytest.raises(NoAsyncCallError):
        envs.step_wait()
    envs.step_async(np.array([0, 1]))
    with pytest.raises(AlreadyPendingCallError):
        envs.step_async(np.array([0, 1]))
    with pytest.raises(AlreadyPendingCallError):
        envs.reset_async()
    envs.step_wait(timeout=10)
    envs.close()
    envs.close()  # twice is fine
    with pytest.raises(ClosedEnvironmentError):
        envs.step(np.array([0, 1]))


def test_call_wait_timeout_keeps_the_call_pending():
    envs = AsyncLLMVectorEnv([partial(SleepyEnv, 0.3)] * 2)
    try:
        envs.reset(seed=0)
        envs.call_async("step", 1)
        with pytest.raises(multiprocessing.TimeoutError):
            envs.call_wait(timeout=0.01)
        results = envs.call_wait(timeout=10)
        assert [r[1] >= 1 for r in results] == [True, True]
    finally:
        envs.close()


def test_step_wait_timeout_keeps_answers():
    envs = AsyncLLMVectorEnv([partial(SleepyEnv, 0.3)] * 2)
    try:
        envs.reset(seed=0)
        envs.step_async(np.array([1, 1]))
        with pytest.raises(multiprocessing.TimeoutError):
            envs.step_wait(timeout=0.01)
        obs, rewards, *_ = envs.step_wait(timeout=10)
        assert obs.shape == (2, 3) and (rewards >= 1).all()
    finally:
        envs.close()


# ---------------------------------------------------------------- EnvPool-style partial batches


def test_partial_batches_invariants(no_leftover_children):
    delays = [0.0, 0.0, 0.02, 0.05, 0.0, 0.03]
    fns = [partial(SleepyEnv, d) for d in delays]
    envs = AsyncLLMVectorEnv(fns, batch_size=2)
    try:
        envs.async_reset(seed=0)
        in_flight = set(range(len(fns)))
        returned = {i: 0 for i in in_flight}
        sent = {i: 1 for i in in_flight}
        for _ in range(60):
            obs, rewards, term, trunc, info = envs.recv(timeout=10)
            ids = info["env_id"]
            assert 1 <= len(ids) <= 2, "recv never returns an empty batch nor more than batch_size"
            assert obs.shape == (len(ids), 3) and rewards.shape == (len(ids),)
            assert len(set(ids.tolist())) == len(ids)
            for i in ids:
                assert i in in_flight, f"env {i} returned twice for one send"
                in_flight.remove(i)
                returned[i] += 1
            envs.send(np.ones(len(ids), dtype=np.int64), ids)
            for i in ids:
                in_flight.add(int(i))
                sent[i] += 1
        assert all(returned[i] == sent[i] - 1 for i in returned)
        # Fast envs are not held back by slow ones.
        assert returned[0] > returned[3] and returned[1] > returned[3]
    finally:
        envs.close()


def test_recv_arrival_order_and_rows_match_env():
    envs = AsyncLLMVectorEnv([partial(SleepyEnv, d) for d in (0.2, 0.0, 0.1)], batch_size=1)
    try:
        envs.async_reset(seed=0)
        got = []
        for _ in range(3):
            obs, _, _, _, info = envs.recv(timeout=10)
            got.append(int(info["env_id"][0]))
        assert sorted(got) == [0, 1, 2]
        envs.send(np.array([1, 1, 1]), [0, 1, 2])
        order = [int(envs.recv(timeout=10)[4]["env_id"][0]) for _ in range(3)]
        assert order == [1, 2, 0]
        # the row of env 2 carries env 2's own observation
        envs.send(np.array([2]), [2])
        obs, rew, *_, info = envs.recv(timeout=10)
        assert info["env_id"].tolist() == [2] and obs[0][0] == 2.0  # its second step
    finally:
        envs.close()


def test_recv_infos_are_sized_to_the_batch():
    envs = AsyncLLMVectorEnv([CounterEnv] * 4, batch_size=4)
    try:
        envs.async_reset(seed=0)
        _, _, _, _, info = envs.recv(timeout=10)
        assert info["length"].shape == (4,) and info["_length"].all()
        envs.send(np.zeros(2, dtype=np.int64), [3, 1])
        _, _, _, _, info = envs.recv(timeout=10)  # fewer in flight than batch_size: all of them
        assert sorted(info["env_id"].tolist()) == [1, 3]
        assert info["t"].shape == (2,) and info["_t"].all()
    finally:
        envs.close()


def test_send_and_recv_errors():
    envs = AsyncLLMVectorEnv([CounterEnv] * 3, batch_size=2)
    try:
        with pytest.raises(NoAsyncCallError):
            envs.recv()
        envs.async_reset(seed=0)
        with pytest.raises(AlreadyPendingCallError):
            envs.step(np.zeros(3, dtype=np.int64))
        _, _, _, _, info = envs.recv(timeout=10)
        with pytest.raises(ValueError, match="out of range"):
            envs.send(np.zeros(1, dtype=np.int64), [7])
        with pytest.raises(ValueError, match="repeated"):
            envs.send(np.zeros(2, dtype=np.int64), [0, 0])
        busy = ({0, 1, 2} - set(info["env_id"].tolist())).pop()
        with pytest.raises(ValueError, match=f"env {busy} is still busy"):
            envs.send(np.zeros(1, dtype=np.int64), [busy])
    finally:
        envs.close()


def test_lockstep_after_draining_partial_batches():
    envs = AsyncLLMVectorEnv([CounterEnv] * 2, batch_size=1)
    try:
        envs.async_reset(seed=0)
        envs.recv(timeout=10)
        envs.recv(timeout=10)
        obs, *_ = envs.step(np.array([1, 1]))
        assert obs.shape == (2, 3)
    finally:
        envs.close()


def test_constructor_validation():
    with pytest.raises(ValueError, match="batch_size"):
        AsyncLLMVectorEnv([CounterEnv] * 2, batch_size=3)
    with pytest.raises(ValueError, match="empty"):
        AsyncLLMVectorEnv([])
    with pytest.raises(TypeError, match=r"env_fns\[1\]"):
        AsyncLLMVectorEnv([CounterEnv, "CartPole-v1"])


def test_partial_batches_with_several_envs_per_worker():
    """Sends and recvs stay per env when envs share a worker: a send may name one env of a worker."""
    envs = AsyncLLMVectorEnv([partial(SleepyEnv, d) for d in (0.15, 0.15, 0.0, 0.0)], envs_per_worker=2, batch_size=2)
    try:
        assert len(set(envs.worker_pids)) == 2 and envs.worker_pids[0] == envs.worker_pids[1]
        envs.async_reset(seed=0)
        for _ in range(2):
            envs.recv(timeout=10)
        envs.send(np.ones(4, dtype=np.int64))
        _, _, _, _, info = envs.recv(timeout=10)
        assert info["env_id"].tolist() == [2, 3], "the fast worker's envs come first"
        envs.send(np.array([2]), [3])  # one env of the fast worker; env 2 stays idle
        obs, rewards, _, _, info = envs.recv(timeout=10)
        assert info["env_id"].tolist() == [3, 0], "env 3 is back before the slow worker's two envs"
        assert obs[0][0] == 2.0 and rewards[0] >= 2.0 and obs[1][0] == 1.0
        _, _, _, _, info = envs.recv(timeout=10)
        assert info["env_id"].tolist() == [1]
        assert envs.in_flight == []
        envs.send(np.array([1, 1]), [2, 0])
        _, _, _, _, info = envs.recv(timeout=10)
        assert sorted(info["env_id"].tolist()) == [0, 2]
    finally:
        envs.close()


def test_envs_per_worker_validation():
    with pytest.raises(ValueError, match="envs_per_worker"):
        AsyncLLMVectorEnv([CounterEnv] * 2, envs_per_worker=0)
    with pytest.raises(ValueError, match="backend"):
        AsyncLLMVectorEnv([CounterEnv] * 2, backend="threads")


def test_text_actions_to_any_number_of_envs_are_split_and_checked_without_copies():
    """A ``send`` to a number of envs not seen before batches a ``Text`` action space as a ``Tuple``
    of the single space itself (gymnasium's ``batch_space`` deep-copies it per env: tens of ms for
    one send); the actions are split and checked as before, a bad one named by its env."""
    import asyncvec.envs  # noqa: F401  (registers asyncvec/GuessNumber-v0)

    vec = AsyncLLMVectorEnv([lambda: gym.make("asyncvec/GuessNumber-v0", transcript=False)] * 3, batch_size=1)
    try:
        vec.async_reset(seed=0)
        for _ in range(3):
            vec.recv(timeout=30)
        vec.send(("5",), [1])
        vec.send(("3", "9"), [0, 2])
        assert sorted(int(vec.recv(timeout=30)[4]["env_id"][0]) for _ in range(3)) == [0, 1, 2]
        for count in (1, 2):
            batched = vec._actions.batched_space(count)
            assert len(batched.spaces) == count and all(s is vec.single_action_space for s in batched.spaces)
        with pytest.raises(ValueError, match="env 2"):
            vec.send(("4", "\u00e9" * 3), [0, 2])  # outside the charset
        assert vec.in_flight == []  # nothing was sent
    finally:
        vec.close()


def test_process_transport_wait_reports_the_workers_asked_with_a_ready_reply():
    """``ProcessTransport.wait`` keeps one poll object across calls (registering only what changed):
    a ready reply of a worker not asked about is not reported, a read reply no longer is, a wake
    ends a wait, and a restarted worker's new pipe is watched."""
    from asyncvec.vector.transport import ProcessBackend, WorkerSpec

    spec = WorkerSpec([CounterEnv] * 3, [[0], [1], [2]], AutoresetMode.NEXT_STEP, None)
    transport = ProcessBackend().create(spec)
    try:
        for worker in range(3):
            assert transport.await_ready(worker, 60) == (True, None)
        for worker in (0, 1):
            transport.send(worker, [(0, "reset", {"seed": worker, "options": None})])
        ready: set[int] = set()
        while ready != {0, 1}:
            ready |= set(transport.wait([0, 1, 2], 30))
        assert transport.wait([1], 0) == [1]
        assert transport.wait([0, 2], 0) == [0]
        assert transport.read(0)[0] is True
        assert transport.wait([0, 1], 0) == [1]
        assert transport.read(1)[0] is True
        assert transport.wait([0, 1, 2], 0.01) == []
        transport.wake()
        start = time.monotonic()
        assert transport.wait([0, 1, 2], 30) == [] and time.monotonic() - start < 10
        transport.restart(1)
        assert transport.await_ready(1, 60) == (True, None)
        transport.send(1, [(0, "reset", {"seed": 3, "options": None})])
        assert transport.wait([1, 2], 30) == [1]
        assert transport.read(1)[0] is True
    finally:
        transport.close(5.0, terminate=False)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_box_actions_through_shared_memory_match_gymnasium(placement, no_leftover_children):
    """Worker processes read fixed-shape actions from shared memory; an env still gets its own action."""
    fns = [lambda: gym.make("Pendulum-v1")] * 3
    sync = SyncVectorEnv(fns)
    ours = AsyncLLMVectorEnv(fns, **PLACEMENTS[placement])
    try:
        assert (ours._dispatch.action_rows is not None) == (not ours.placement.in_process)
        assert_same(ours.reset(seed=4), sync.reset(seed=4), "reset")
        space = sync.action_space
        space.seed(5)
        for t in range(30):
            actions = space.sample()
            assert_same(ours.step(actions), sync.step(actions), f"step {t}")
        ours.async_reset(seed=6)
        sync.reset(seed=6)
        _, _, _, _, info = ours.recv()
        ours.send(np.full((2, 1), 1.5, np.float32), [2, 0])  # any subset, in any order
        ours.send(np.full((1, 1), -1.5, np.float32), [1])
        got = {}
        while ours.in_flight:
            obs, _, _, _, info = ours.recv()
            got.update(zip(info["env_id"].tolist(), obs))
        want, *_ = sync.step(np.array([[1.5], [-1.5], [1.5]], np.float32))
        for i in range(3):
            np.testing.assert_array_equal(got[i], want[i])
    finally:
        ours.close()
        sync.close()


class ActionSizeEnv(gym.Env):
    """Box actions of shape (1,); reports the size of the action it was given."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, False, False, {"size": int(np.size(action))}


def test_an_unchecked_action_that_fits_no_row_still_reaches_its_env():
    """validate_actions=False: a wrong-shaped action cannot go through shared memory; it is sent as
    it is, as before actions went through shared memory."""
    envs = AsyncLLMVectorEnv([ActionSizeEnv] * 2, validate_actions=False, envs_per_worker=1)
    try:
        assert envs._action_rows is not None
        envs.reset(seed=0)
        *_, info = envs.step([np.zeros(3, np.float32), np.zeros(1, np.float32)])
        assert info["size"].tolist() == [3, 1]
    finally:
        envs.close()


def test_recv_at_least_returns_what_is_ready_without_waiting_for_a_full_batch():
    """batch_size 3, one fast env and two slow ones: at_least=1 returns the fast env at once;
    a plain recv waits for all three."""
    envs = AsyncLLMVectorEnv([partial(SleepyEnv, d) for d in (0.0, 0.3, 0.3)], batch_size=3, envs_per_worker=1)
    try:
        envs.async_reset(seed=0)
        while envs.in_flight:
            envs.recv()
        envs.send(np.ones(3, dtype=np.int64))
        start = time.monotonic()
        *_, info = envs.recv(at_least=1)
        assert info["env_id"].tolist() == [0] and time.monotonic() - start < 0.25
        *_, info = envs.recv(at_least=2)  # both slow envs, together
        assert sorted(info["env_id"].tolist()) == [1, 2]
        envs.send(np.ones(3, dtype=np.int64))
        time.sleep(0.5)  # all three finished: at_least=1 takes every answer that is ready, up to batch_size
        *_, info = envs.recv(at_least=1)
        assert sorted(info["env_id"].tolist()) == [0, 1, 2]
    finally:
        envs.close()


def test_a_forked_child_that_drops_its_copy_leaves_the_parents_envs_alone(no_leftover_children):
    """A process the user forks (a DataLoader worker, a pool) inherits the vector env; its garbage
    collector must not close, join or message the parent's workers."""
    import gc
    import os
    import sys

    envs = AsyncLLMVectorEnv([partial(CounterEnv, max_len=50)] * 2, envs_per_worker=1)
    envs.reset(seed=0)
    child = os.fork()
    if child == 0:
        raised = []
        sys.unraisablehook = lambda unraisable: raised.append(unraisable.exc_value)
        del envs
        gc.collect()
        os._exit(1 if raised else 0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # nothing raised in the child's __del__
    rewards = envs.step(np.ones(2, dtype=np.int64))[1]
    assert rewards.shape == (2,) and not envs.closed
    envs.close()
