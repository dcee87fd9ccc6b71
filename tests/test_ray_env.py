"""Env workers as Ray actors on a local multi-node cluster: same results, same faults, node loss.

One cluster (a head and 2 more raylets) serves the whole module; tests that remove a node add
their own first.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
import ray
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from test_vector_env import run_both
from toy_envs import CounterEnv, FaultyEnv, SleepyEnv

from asyncvec import AsyncLLMVectorEnv, check_vector_env
from asyncvec.distributed.cluster import local_cluster
from asyncvec.distributed.ray_env import RayBackend
from asyncvec.vector.errors import ClosedEnvironmentError, WorkerError

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def cluster():
    # Actors import toy_envs from this folder, which only the driver has on its path.
    with local_cluster(num_nodes=3, runtime_env={"env_vars": {"PYTHONPATH": TESTS_DIR}}) as cluster:
        yield cluster


def pids_gone(pids, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") for pid in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize(
    "mode, kind, envs_per_worker",
    [(AutoresetMode.NEXT_STEP, "dict", 2), (AutoresetMode.SAME_STEP, "text", 3), (AutoresetMode.DISABLED, "box", 3)],
    ids=lambda v: getattr(v, "value", str(v)),
)
def test_equivalent_to_sync_vector_env_on_ray(cluster, mode, kind, envs_per_worker):
    """The process-worker equivalence test, on actors (1 or 2 per env to keep the test short)."""
    assert run_both(kind, mode, num_envs=3, envs_per_worker=envs_per_worker, batch_size=2, check=True, backend="ray")


def test_restarts_in_place_on_ray(cluster, tmp_path):
    """Env 1 kills its actor, env 2 hangs (its actor is killed after step_timeout): Ray re-runs their constructors.

    Each comes back truncated at its last observation; env 0 matches SyncVectorEnv step for step.
    """
    clean = partial(CounterEnv, max_len=50)
    fns = [clean] + [
        partial(FaultyEnv, fault, at, str(tmp_path / f"{fault}-once"), max_len=50)
        for fault, at in (("kill", 2), ("hang", 4))
    ]
    # step_timeout: long enough for Ray to report the killed actor on a loaded machine (with 2 s, `make test` once
    # saw the kill reported as a StepTimeout); the hang costs it once
    envs = AsyncLLMVectorEnv(fns, backend="ray", max_restarts=1, step_timeout=8.0, envs_per_worker=1)
    reference = SyncVectorEnv([clean] * 3)
    try:
        pids = envs.worker_pids
        obs, _ = envs.reset(seed=0)
        reference.reset(seed=0)
        healthy = [0, 1, 2]
        faults = {2: (1, "WorkerDied"), 4: (2, "StepTimeout")}
        for t in range(1, 7):
            actions = np.ones(3, dtype=np.int64)
            last = obs.copy()
            obs, rewards, term, trunc, info = envs.step(actions)
            want = reference.step(actions)[0]
            if t in faults:
                index, reason = faults[t]
                healthy.remove(index)
                assert np.flatnonzero(info["_env_restarted"]).tolist() == [index]
                assert reason in info["restart_reason"][index]
                assert trunc[index] and not term[index] and rewards[index] == 0.0
                np.testing.assert_array_equal(obs[index], last[index])
            np.testing.assert_array_equal(obs[healthy], want[healthy])
        assert envs.restarts == [0, 1, 1]
        new_pids = envs.worker_pids
        assert new_pids[0] == pids[0] and new_pids[1] != pids[1] and new_pids[2] != pids[2]
    finally:
        envs.close()
        reference.close()
    assert pids_gone(envs.worker_pids), "close() killed the actors"


def test_shared_actor_faults_on_ray(cluster, tmp_path):
    """Envs 0 and 1 share an actor. Env 0 raises: rebuilt alone inside the actor. Then the actor is
    SIGKILLed: both envs restart in place; env 2, on its own actor, is untouched."""
    fns = [partial(FaultyEnv, "raise", 2, str(tmp_path / "raise-once"), max_len=50)] + [
        partial(CounterEnv, max_len=50)
    ] * 2
    envs = AsyncLLMVectorEnv(fns, envs_per_worker=2, backend="ray", max_restarts=2)
    try:
        envs.reset(seed=0)
        obs, *_ = envs.step(np.ones(3, dtype=np.int64))
        after, _, _, trunc, info = envs.step(np.ones(3, dtype=np.int64))
        assert trunc.tolist() == [True, False, False] and "ZeroDivisionError" in info["restart_reason"][0]
        np.testing.assert_array_equal(after[0], obs[0])
        pid = envs.worker_pids[0]
        assert envs.worker_pids[1] == pid != envs.worker_pids[2]
        obs, *_ = envs.step(np.ones(3, dtype=np.int64))  # env 0 resets (NEXT_STEP), the others step
        os.kill(pid, signal.SIGKILL)
        after, _, _, trunc, info = envs.step(np.ones(3, dtype=np.int64))
        assert trunc.tolist() == [True, True, False] and info["_env_restarted"].tolist() == [True, True, False]
        np.testing.assert_array_equal(after[:2], obs[:2])
        assert after[2][0] in (obs[2][0] + 1, 0.0)  # stepped (or its episode ended and reset)
        assert envs.restarts == [2, 1, 0] and envs.worker_pids[0] != pid
        # Env 0 has used its 2 restarts: the next loss is an error naming it, and the env closes.
        pids = envs.worker_pids
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"env 0 failed in step\(\): WorkerDied: Ray actor died") as err:
            envs.step(np.ones(3, dtype=np.int64))
        assert "after 2 restart(s); max_restarts=2" in str(err.value) and "also hosted envs [1]" in str(err.value)
        assert envs.closed
        with pytest.raises(ClosedEnvironmentError):
            envs.step(np.ones(3, dtype=np.int64))
    finally:
        envs.close()
    assert pids_gone(pids), "no actor outlives close()"


def test_partial_batches_resources_and_errors_on_ray(cluster):
    """Workers pinned to nodes by custom resources; partial batches; bad actions and recv timeouts."""
    delays = [0.0, 0.0, 0.1, 0.1]
    backend = RayBackend(num_cpus=0.25, actor_options=lambda w: cluster.pin(1 + w))
    envs = AsyncLLMVectorEnv([partial(SleepyEnv, d) for d in delays], envs_per_worker=2, batch_size=2, backend=backend)
    try:
        assert [cluster.index_of(node) for node in envs.worker_nodes] == [1, 1, 2, 2]
        with pytest.raises(ValueError, match=r"action 7 for env 1 is not in the action space Discrete\(3\)"):
            envs.send(np.array([0, 7]), [0, 1])  # nothing was sent
        envs.async_reset(seed=0)
        steps = np.zeros(4, dtype=int)
        start = time.monotonic()
        while time.monotonic() - start < 1.5:
            _, _, _, _, info = envs.recv(timeout=30)
            ids = info["env_id"]
            assert 1 <= len(ids) <= 2
            steps[ids] += 1
            envs.send(np.ones(len(ids), dtype=np.int64), ids)
        assert steps[0] > 2 * steps[2] and steps[1] > 2 * steps[3], f"fast envs wait for no slow one: {steps}"
        while envs.in_flight:
            envs.recv(timeout=30)
        envs.send(np.ones(2, dtype=np.int64), [2, 3])  # the slow ones: 0.1 s each
        with pytest.raises(multiprocessing.TimeoutError):
            envs.recv(timeout=0.0)
        _, _, _, _, info = envs.recv(timeout=30)  # the answers were kept
        assert sorted(info["env_id"].tolist()) == [2, 3]
        check_vector_env(envs, num_steps=10)
    finally:
        envs.close()


def test_reserved_actor_options():
    with pytest.raises(ValueError, match="max_restarts"):
        RayBackend(actor_options={"max_restarts": 5}).options(0)
    options = RayBackend(
        num_cpus=0.5, resources={"sim": 1}, actor_options=lambda w: {"resources": {f"node_{w}": 1}}
    ).options(2)
    assert options["resources"] == {"sim": 1, "node_2": 1} and options["num_cpus"] == 0.5
    assert options["max_task_retries"] == 0, "a step is never retried"


def test_default_workers_hold_no_cpu_even_when_pinned(cluster):
    """Two workers pinned to one 1-CPU node by a custom resource start (Ray alone would hold a
    CPU for each pinned actor's life, and the second would wait for ever)."""
    backend = RayBackend(resources={"node_1": 1})
    start = time.monotonic()
    envs = AsyncLLMVectorEnv([CounterEnv] * 2, backend=backend, start_timeout=120, envs_per_worker=1)
    try:
        assert [cluster.index_of(node) for node in envs.worker_nodes] == [1, 1]
        print(f"two pinned workers started in {time.monotonic() - start:.1f} s")
        envs.reset(seed=0)
        envs.step(np.ones(2, dtype=np.int64))
    finally:
        envs.close()
    assert backend.options(0)["num_cpus"] == 0


def test_an_unplaceable_worker_fails_fast_naming_the_resource(cluster):
    """Each worker holds 1 CPU on a node that has 1: the second can never start beside the
    first, which is an error at once (not a StartTimeout), naming the CPU."""
    start = time.monotonic()
    with pytest.raises(
        WorkerError, match=r"Unschedulable: .*it needs \{'CPU': 1.0, 'node_2': 1.0\}.*\{'CPU': 0.0\} left beside worker"
    ) as err:
        AsyncLLMVectorEnv([CounterEnv] * 2, backend=RayBackend(num_cpus=1, resources={"node_2": 1}), start_timeout=120)
    elapsed = time.monotonic() - start
    print(f"failed in {elapsed:.1f} s: {err.value}")
    assert elapsed < 90, "the error came once the first worker ran, not at start_timeout (120 s)"


def order_enforced_counter():
    return gym.wrappers.OrderEnforcing(CounterEnv(max_len=50))


def test_an_actor_rebuilt_between_messages_is_a_restart_not_a_silent_reset(cluster):
    """Ray rebuilds an actor that died while idle; the next step is refused by the new
    incarnation and reported as the worker's loss: the episode ends truncated (no step on a
    never-reset env, no ResetNeeded), and worker_pids names the new process."""
    backend = RayBackend(num_cpus=0.25, actor_options=lambda w: {"name": f"rebuilt-between-messages-{w}"})
    envs = AsyncLLMVectorEnv(
        [order_enforced_counter] * 2,
        backend=backend,
        autoreset_mode=AutoresetMode.SAME_STEP,
        max_restarts=2,
        envs_per_worker=1,
    )
    try:
        envs.reset(seed=0)
        for _ in range(2):
            envs.step(np.ones(2, dtype=np.int64))
        pid = envs.worker_pids[0]
        os.kill(pid, signal.SIGKILL)
        # Wait until Ray has rebuilt the actor (its envs were never reset), through its name.
        actor = ray.get_actor("rebuilt-between-messages-0")
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "Ray rebuilt the actor within 120 s"
            try:
                if ray.get(actor.ready.remote(), timeout=10)[1]["pid"] != pid:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.2)
        obs, _, _, trunc, info = envs.step(np.ones(2, dtype=np.int64))
        assert trunc.tolist() == [True, False] and info["_env_restarted"].tolist() == [True, False]
        assert "WorkerDied: Ray actor died" in info["restart_reason"][0], info["restart_reason"][0]
        assert envs.restarts == [1, 0] and obs[0][0] == 0.0  # SAME_STEP: the new env's reset observation
        new_pid = envs.worker_pids[0]
        assert new_pid != pid and os.path.exists(f"/proc/{new_pid}")
        for _ in range(3):
            _, _, _, _, info = envs.step(np.ones(2, dtype=np.int64))
            assert "_env_restarted" not in info or not info["_env_restarted"].any(), info.get("restart_reason")
    finally:
        envs.close()


def test_a_node_crash_moves_envs_to_new_actors_or_says_why(cluster):
    """A node's raylet is killed (a crash): its actor processes are orphans that may still answer
    until Ray's health checks notice (~15 s). Only rebuilt actors are accepted: the movable envs
    restart once, with a reason naming the node loss, on another node with new processes, and
    go on; an env pinned to the node gets a clear error."""
    node = cluster.add_node()
    node_id = cluster.node_id(node)
    movable = AsyncLLMVectorEnv(
        [order_enforced_counter] * 2,
        backend=RayBackend(
            num_cpus=0.25, actor_options={"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=True)}
        ),
        autoreset_mode=AutoresetMode.SAME_STEP,
        max_restarts=3,
        envs_per_worker=1,
    )
    pinned = AsyncLLMVectorEnv(
        [CounterEnv],
        backend=RayBackend(num_cpus=0.25, resources={f"node_{node}": 1}),
        max_restarts=1,
        envs_per_worker=1,
    )
    try:
        assert set(movable.worker_nodes) == {node_id} == set(pinned.worker_nodes)
        pids = movable.worker_pids
        movable.reset(seed=0)
        pinned.reset(seed=0)
        for _ in range(2):
            obs, *_ = movable.step(np.ones(2, dtype=np.int64))
        cluster.remove_node(node, graceful=False)
        reasons = {}
        start = time.monotonic()
        while len(reasons) < 2:
            assert time.monotonic() - start < 120, f"the envs moved within 120 s: {reasons}"
            last = obs
            obs, _, _, trunc, info = movable.step(np.ones(2, dtype=np.int64))
            for index in np.flatnonzero(info.get("_env_restarted", np.zeros(2, bool))):
                assert trunc[index] and index not in reasons, info["restart_reason"]
                reasons[int(index)] = info["restart_reason"][index]
                np.testing.assert_array_equal(info["final_obs"][index], last[index])  # the episode ends where it was
                assert obs[index][0] == 0.0  # SAME_STEP: the new env's first observation
        print(f"recovery after a node crash: {time.monotonic() - start:.1f} s: {reasons}")
        assert all(f"NodeLost: the Ray actor's node {node_id}" in reason for reason in reasons.values()), reasons
        assert movable.restarts == [1, 1]
        assert node_id not in movable.worker_nodes and set(movable.worker_nodes) <= set(cluster.node_ids)
        assert not set(movable.worker_pids) & set(pids) and all(
            os.path.exists(f"/proc/{p}") for p in movable.worker_pids
        )
        for _ in range(3):
            _, _, _, _, info = movable.step(np.ones(2, dtype=np.int64))
            assert not info.get("_env_restarted", np.zeros(2, bool)).any(), info.get("restart_reason")
        assert movable.restarts == [1, 1]
        with pytest.raises(
            WorkerError, match=rf"env 0 failed in .*Unschedulable: no alive node .* 'node_{node}': 1"
        ) as err:
            while True:  # the pinned actor's orphan may answer a last step
                pinned.step(np.ones(1, dtype=np.int64))
        assert f"while restarting its worker after: NodeLost: the Ray actor's node {node_id}" in str(err.value)
        assert pinned.closed
    finally:
        movable.close()
        pinned.close()


def test_local_ray_started_by_the_env_is_shut_down_by_close():
    """Without a cluster to join, the env starts a local Ray; close() leaves none of its processes."""
    script = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {TESTS_DIR!r})
        import numpy as np
        from asyncvec import AsyncLLMVectorEnv
        from toy_envs import CounterEnv

        def descendants(pid):
            kids = set()
            for path in os.listdir(f"/proc/{{pid}}/task"):
                with open(f"/proc/{{pid}}/task/{{path}}/children") as f:
                    kids.update(int(p) for p in f.read().split())
            for kid in list(kids):
                try:
                    kids |= descendants(kid)
                except OSError:
                    pass
            return kids

        envs = AsyncLLMVectorEnv([CounterEnv] * 2, backend="ray")
        envs.reset(seed=0)
        envs.step(np.ones(2, dtype=np.int64))
        started = descendants(os.getpid())
        assert set(envs.worker_pids) <= started, (envs.worker_pids, started)
        envs.close()
        # Ray's processes exit on their own once their raylet is gone; a worker that was still
        # starting (importing ray) on a loaded machine may take a while to notice.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{{p}}") for p in started):
            time.sleep(0.2)
        left = []
        for p in started:
            try:
                with open(f"/proc/{{p}}/cmdline", "rb") as f:
                    left.append((p, f.read().replace(bytes(1), b" ").decode(errors="replace")[:120]))
            except OSError:
                pass
        print("STARTED", len(started), "LEFT", left, flush=True)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = TESTS_DIR
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400, env=env)
        # Ray gives its raylet a fixed 30 s to register; a heavily loaded machine can miss that.
        # That is Ray's start-up failing, not what this test checks: start again (a new driver).
        if "The current node timed out during startup" not in out.stderr:
            break
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("STARTED")][-1]
    assert line.endswith("LEFT []"), line
    assert int(line.split()[1]) >= 3, "a local Ray has a GCS, a raylet and the actors"


def test_ray_placement_is_one_env_per_actor_unless_probed_and_never_in_process(cluster):
    """Without envs_per_worker: an actor per env, nothing probed. With placement="probe" (the opt-in) the
    env is measured in a local child process: CPU-bound envs on no more busy actors than the cluster's
    CPUs, never in the driver's process."""
    with AsyncLLMVectorEnv([CounterEnv] * 4, backend="ray") as envs:
        assert envs.placement.num_workers == 4 and envs.placement.profile is None, envs.placement
        envs.reset(seed=0)
        for _ in range(40):
            envs.step(np.ones(4, dtype=np.int64))
        assert envs.placement.num_workers == 4 and not envs.placement.in_process, envs.placement
    with AsyncLLMVectorEnv([CounterEnv] * 4, backend="ray", placement="probe") as envs:
        placement = envs.placement
        assert not placement.in_process and placement.profile is not None, placement
        assert placement.num_workers == len(set(envs.worker_pids)) <= 4
        # regrouped onto no more actors than CPUs, or kept one env per actor because the measured steps
        # and round trips predict regrouping less than REGROUP_MARGIN faster (a loaded run measured that)
        cpus = max(1, int(ray.cluster_resources()["CPU"]))
        assert placement.num_workers <= cpus or placement.reason.startswith("stays: "), placement
        envs.reset(seed=0)
        envs.step(np.ones(4, dtype=np.int64))


class SlowToShip:
    """An env function whose pickling (when Ray ships it to an actor) takes ``seconds``: the actor's
    creation blocks in the driver, as it does when Ray's GCS stops answering."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self):
        return CounterEnv()

    def __reduce__(self):
        time.sleep(self.seconds)
        return (SlowToShip, (0.0,))


def test_a_ray_start_that_does_not_answer_raises_naming_the_stage_and_leaves_no_actor(cluster):
    def alive_actors():  # Ray titles an actor's process "ray::_EnvWorker..." (the state API needs the dashboard)
        pids = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as file:
                    if b"_EnvWorker" in file.read():
                        pids.add(pid)
            except OSError:
                pass
        return pids

    before = alive_actors()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"backend='ray': creating its actors.*start_timeout=1\.0"):
        AsyncLLMVectorEnv([SlowToShip(4.0)] * 2, backend="ray", start_timeout=1.0)
    assert time.monotonic() - started < 3.5
    time.sleep(5.0)  # the shipping ends; the actor it makes is killed at once
    deadline = time.monotonic() + 15
    while alive_actors() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive_actors() - before
