"""Distributed collection and policy replicas on a local multi-node Ray cluster (one head and
three more raylets, started once for the module): version-tagged transitions from collectors on
several nodes, back-pressure, the max-lag gate, a node that dies, PPO and SAC with
``--backend ray``, and `RoutedPolicy` over `RayPolicy` replicas."""

from __future__ import annotations

import functools
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
import ray  # noqa: E402  (in the test extra: these tests never skip)
import torch

from asyncvec import CollectorError, ReplayBuffer, VersionManager
from asyncvec.distributed import DistributedCollector, RayCollectors, RayPolicy, RoutedPolicy
from asyncvec.distributed.cluster import local_cluster
from asyncvec.inference import PolicyClosedError, TorchPolicy

pytestmark = pytest.mark.timeout(900)

# How long a wait for progress may take before it is a failure: a bound on a hang, not a speed
# check. CI runs this module beside in-process vLLM engines on 2 cores, where 200 CartPole steps
# through three Ray actors once took more than 60 s.
PATIENCE = 240

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(num_nodes=4, num_cpus=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def fleet(cluster):
    """Three collector actors, one on each non-head node, two CartPole envs each; every test
    drives them with its own DistributedCollector."""
    pins = [{"num_cpus": 0, **cluster.pin(index)} for index in cluster.node_indices[1:4]]
    collectors = RayCollectors([CARTPOLE] * 6, num_collectors=3, actor_options=pins)
    yield collectors
    collectors.close()


def version_net(version: int) -> torch.nn.Linear:
    """A CartPole policy whose deterministic action is ``version % 2``: an answer's action shows
    which weights computed it."""
    net = torch.nn.Linear(4, 2)
    net.load_state_dict(version_weights(version))
    return net


def version_weights(version: int) -> dict[str, torch.Tensor]:
    bias = torch.zeros(2)
    bias[version % 2] = 10.0
    return {"weight": torch.zeros(2, 4), "bias": bias}


def policy_fn(version: int = 0):
    return functools.partial(
        TorchPolicy, version_net(version), gym.spaces.Discrete(2), deterministic=True, max_wait_ms=1, version=version
    )


class ListSink:
    """A callable sink that keeps every committed batch; ``hold`` blocks the learner side."""

    def __init__(self) -> None:
        self.batches = []
        self.lock = threading.Lock()

    def __call__(self, batch) -> None:
        with self.lock:
            self.batches.append(batch)

    def column(self, name: str) -> np.ndarray:
        with self.lock:
            return np.concatenate([getattr(b, name) for b in self.batches] + [np.zeros(0, dtype=np.int64)])

    def __len__(self) -> int:
        with self.lock:
            return sum(len(b.env_id) for b in self.batches)


def wait_until(predicate, timeout: float, what: str, collector=None) -> None:
    """Polls ``predicate``; a failed ``collector`` raises its own error at once (a pull loop that
    died would otherwise show up only as a timeout)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if collector is not None:
            collector.check()
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}" + (
            f" (collector metrics: {collector.metrics()})" if collector is not None else ""
        )
        time.sleep(0.05)


def still_for(sink: ListSink, seconds: float) -> bool:
    """Whether nothing reached ``sink`` for ``seconds``."""
    before = len(sink)
    time.sleep(seconds)
    return len(sink) == before


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_collectors_on_three_nodes_stream_honestly_versioned_transitions(cluster, fleet):
    buffer = ReplayBuffer(20_000, fleet.single_observation_space, fleet.single_action_space)
    versions = VersionManager(max_lag=1)
    assert fleet.slices == [(0, 2), (2, 4), (4, 6)]
    nodes = [info["node_id"] for info in fleet.infos]
    assert nodes == [cluster.node_id(i) for i in cluster.node_indices[1:4]]  # one collector per node
    collector = DistributedCollector(fleet, policy_fn(), buffer, version_manager=versions, seed=0)
    versions.register(collector)

    def envs_seen() -> set[int]:
        return set(buffer.gather(np.arange(len(buffer)), versions.current_version).env_id.tolist())

    with collector:
        # every collector's envs first: under load one node can start late, and with max_lag=1 its samples of
        # versions it had not loaded yet are dropped (one fresh-clone run saw only envs 0, 1, 4 and 5)
        wait_until(
            lambda: len(buffer) >= 300 and envs_seen() == set(range(6)), PATIENCE, "transitions of every env", collector
        )
        for version in (1, 2, 3):
            versions.publish(version_weights(version))
            wait_until(
                lambda v=version: buffer.version_range()[1] >= v,
                PATIENCE,
                f"transitions of version {version}",
                collector,
            )
        collector.check()
    metrics = collector.metrics()
    rows = buffer.gather(np.arange(len(buffer)), versions.current_version)
    assert sorted(set(rows.env_id.tolist())) == list(range(6))
    assert set(rows.policy_version.tolist()) == {0, 1, 2, 3}
    assert np.array_equal(rows.action, rows.policy_version % 2)  # every tag names the weights that acted
    assert metrics["env_steps"] == len(buffer) and metrics["episodes"] > 0
    assert all(metrics[f"collector{i}/env_steps"] > 0 for i in range(3))
    # episode ids are unique across collectors: an id never spans two envs
    pairs = set(zip(rows.episode_id.tolist(), rows.env_id.tolist(), strict=True))
    assert len({episode for episode, _ in pairs}) == len(pairs)


def test_a_learner_that_stops_pulling_stops_the_envs(fleet):
    released = threading.Event()
    bound = 16

    def pace(committed: int) -> None:  # the learner falls behind after 200 transitions
        if committed >= 200:
            released.wait(60)

    sink = ListSink()
    collector = DistributedCollector(fleet, policy_fn(), sink, pace=pace, max_buffered_steps=bound)
    try:
        with collector:
            wait_until(lambda: len(sink) >= 200, PATIENCE, "200 transitions", collector)
            time.sleep(1.5)  # the actors fill their bounded outboxes, then their envs wait
            first = collector.metrics()
            time.sleep(1.0)
            second = collector.metrics()
            acted = sum(row["env_steps"] for row in collectors_metrics(fleet))
            released.set()
            wait_until(lambda: len(sink) > first["env_steps"] + 100, PATIENCE, "collection resumes", collector)
    finally:
        released.set()
    assert first["env_steps"] == second["env_steps"]  # nothing committed while the learner is stuck
    # what the envs did beyond the committed steps is bounded: per actor, a full outbox plus one
    # pull in transit, each at most `bound` plus one write of its 2 envs
    assert acted - first["env_steps"] <= fleet.num_collectors * 2 * (bound + 2)


def collectors_metrics(collectors):
    return ray.get([actor.metrics.remote() for actor in collectors.actors], timeout=30)


def test_a_late_stop_pull_or_sync_of_an_earlier_run_leaves_the_next_run_alone(fleet):
    """Ray runs a threaded actor's calls in any order: an earlier collector's stop, pull or
    weight update that arrives after the next collector started must not stop, drain or
    re-version it (CI once saw the next two tests on this fleet collect nothing for 60 s)."""
    earlier = DistributedCollector(fleet, policy_fn(), ListSink())
    with earlier:
        pass
    sink = ListSink()
    with DistributedCollector(fleet, policy_fn(), sink) as collector:
        wait_until(lambda: len(sink) >= 50, PATIENCE, "first transitions", collector)
        actors = fleet.actors
        ray.get([actor.stop.remote(earlier._run) for actor in actors], timeout=30)
        ray.get([actor.sync.remote(ray.put(version_weights(7)), 7, 7, earlier._run) for actor in actors], timeout=30)
        stolen = ray.get([actor.take.remote(0.2, earlier._run) for actor in actors], timeout=30)
        count = len(sink)
        wait_until(lambda: len(sink) >= count + 200, PATIENCE, "collection goes on", collector)
        collector.check()
    assert all(reply["chunk"] == [] and reply["run"] == collector._run for reply in stolen)
    assert set(sink.column("policy_version").tolist()) == {0}  # version 7 of the earlier run never loaded
    assert np.array_equal(sink.column("action"), np.zeros(len(sink), dtype=np.int64))


def test_two_collectors_driving_one_fleet_at_once_is_an_error(fleet):
    with DistributedCollector(fleet, policy_fn(), ListSink()) as first:
        second = DistributedCollector(fleet, policy_fn(), ListSink())
        with second:
            wait_until(lambda: not first.running, PATIENCE, "the first collector stops")
        with pytest.raises(CollectorError, match="started by another DistributedCollector"):
            first.check()


def test_the_max_lag_gate_holds_on_remote_collectors(fleet):
    sink = ListSink()
    versions = VersionManager(max_lag=0)
    with DistributedCollector(fleet, policy_fn(), sink, version_manager=versions) as collector:
        wait_until(lambda: len(sink) >= 100, PATIENCE, "first transitions", collector)
        versions.publish(None)  # version 1 reaches the collectors, its weights do not
        # what was already submitted drains (seconds under load); a gate that does not hold never settles
        wait_until(lambda: still_for(sink, 1.0), PATIENCE, "the collectors stop acting", collector)
        stalled = len(sink)
        time.sleep(2.0)
        assert len(sink) == stalled, "collectors kept acting with a policy outside max_lag"
        assert collector.metrics()["gate_waits"] > 0
        collector.load_weights(version_weights(1), 1)  # the weights arrive: the gate opens
        wait_until(
            lambda: (sink.column("policy_version") == 1).sum() >= 50, PATIENCE, "version-1 transitions", collector
        )
    tags = sink.column("policy_version")
    assert set(tags.tolist()) == {0, 1}
    assert np.array_equal(sink.column("action"), tags % 2)


def test_a_dead_node_loses_no_committed_sample_and_its_collector_restarts_elsewhere(cluster):
    zone = [cluster.add_node(num_cpus=1, resources={"zone": 1}) for _ in range(2)]
    collectors = RayCollectors(
        [CARTPOLE] * 2, num_collectors=1, actor_options={"num_cpus": 0, "resources": {"zone": 1}}
    )
    buffer = ReplayBuffer(50_000, collectors.single_observation_space, collectors.single_action_space)
    collector = DistributedCollector(collectors, policy_fn(), buffer, seed=0, restart_timeout_s=PATIENCE)
    try:
        first = collectors.infos[0]
        host = cluster.index_of(first["node_id"])
        with collector:
            wait_until(lambda: len(buffer) >= 200, PATIENCE, "first transitions", collector)
            before = buffer.gather(np.arange(len(buffer)), 0)
            cluster.remove_node(host)  # the node and every process on it die
            wait_until(lambda: collector.metrics()["restarts"] == 1, PATIENCE, "the collector restarted")
            count = len(buffer)
            wait_until(lambda: len(buffer) >= count + 200, PATIENCE, "collection resumes on the other node", collector)
            collector.check()
            after = collectors.describe()[0]
            assert after["node_id"] != first["node_id"] and cluster.index_of(after["node_id"]) in zone
            assert all(process_gone(pid) for pid in [first["pid"], *first["env_pids"]])
            kept = buffer.gather(np.arange(len(before.reward)), 0)  # the committed samples are intact
            assert np.array_equal(kept.obs, before.obs) and np.array_equal(kept.episode_id, before.episode_id)
            rows = buffer.gather(np.arange(len(buffer)), 0)
            assert set((rows.episode_id >> 40).tolist()) == {0, 1}  # the rebuilt collector's episodes get new ids

            cluster.remove_node(cluster.index_of(after["node_id"]))  # no node with "zone" left
            wait_until(lambda: not collector.running, PATIENCE, "the collector gives up")
            with pytest.raises(CollectorError, match=r"no alive node can host it: it needs \{'zone': 1.0\}"):
                collector.check()
    finally:
        collectors.close()
        for index in zone:
            if index in cluster.node_indices:
                cluster.remove_node(index)


def test_collectors_that_no_node_can_host_fail_at_once_naming_the_resource(cluster):
    """A CollectorError at once, as the env backend's Unschedulable, not a GetTimeoutError
    naming nothing after start_timeout_s. (Collectors that crowd each other out of their nodes
    are caught by the same check once the first ones run, as Ray env workers are in
    tests/test_ray_env.py; that costs a collector's start-up, so it is not repeated here.)"""
    start = time.monotonic()
    with pytest.raises(
        CollectorError,
        match=r"collector 0 \(envs \(0, 2\)\) cannot start: Unschedulable: no alive node of the Ray cluster can "
        r"host it: it needs \{'nowhere': 1.0\}",
    ):
        RayCollectors(
            [CARTPOLE] * 2,
            num_collectors=1,
            actor_options={"num_cpus": 0, "resources": {"nowhere": 1}},
            start_timeout_s=60,
        )
    assert time.monotonic() - start < 30, "the error came before start_timeout_s"


def test_ppo_with_the_ray_backend_learns_from_honestly_versioned_segments(cluster):
    from asyncvec.agents.ppo import PPO, Args

    args = Args(
        env="CartPole-v1",
        backend="ray",
        ray_collectors=3,
        num_envs=6,
        num_steps=16,
        total_timesteps=6 * 16 * 4,
        update_epochs=2,
        max_staleness=4,
        policy_lag=1,
        progress=False,
        seed=3,
    )
    ppo = PPO(args)
    infos = ppo.envs.describe()
    assert len({info["node_id"] for info in infos}) >= 2  # SPREAD puts them on different nodes
    result = ppo.train()
    # train() closed the collectors: their processes and env workers are gone, the cluster stays
    # each collector's CartPoles run one per worker process (the default placement)
    pids = [pid for info in infos for pid in [info["pid"], *info["env_pids"]]]
    assert len({info["pid"] for info in infos}) == 3 and len(pids) == 3 + 6
    wait_until(lambda: all(process_gone(pid) for pid in pids), 20, "collector and env processes exit")
    assert ray.is_initialized()  # it joined a running cluster: shutting Ray down is not its job
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(ppo.envs.actors[0].describe.remote(), timeout=20)
    assert result.updates == 4 and result.global_step == 6 * 16 * 4
    print([(row["staleness/mean"], row["staleness/max"]) for row in result.history])
    # staleness = the forced lag of 1 + how far collection runs ahead (as with local workers)
    assert result.dropped_samples == 0 and all(row["staleness/max"] <= 4 for row in result.history)
    assert result.history[-1]["staleness/mean"] >= 1
    assert all(row["charts/version"] == i + 1 for i, row in enumerate(result.history))
    assert np.isfinite(result.history[-1]["charts/policy_latency_p50_ms"])


def test_sac_with_the_ray_backend_trains_from_remote_replay(cluster):
    from asyncvec.agents.sac import SAC, Args

    args = Args(
        env="Pendulum-v1",
        backend="ray",
        ray_collectors=1,
        num_envs=2,
        total_timesteps=500,
        learning_starts=100,
        batch_size=32,
        hidden=32,
        publish_every=10,
        progress=False,
        seed=0,
    )
    sac = SAC(args)
    result = sac.train()
    assert result.global_step >= 500 and result.gradient_steps >= 300  # paced to one gradient step per env step
    rows = sac.buffer.gather(np.arange(len(sac.buffer)), sac.versions.current_version)
    # the remote collector acted with published weights (about 30 versions were published; under load the
    # actor's copy lags: 15 was seen where 20 was asked)
    assert sorted(set(rows.env_id.tolist())) == [0, 1] and rows.policy_version.max() >= 5
    assert len(result.episodic_returns) >= 2  # Pendulum episodes are 200 steps


def test_router_over_ray_policy_replicas_ejects_a_killed_one_and_probes_it_back(cluster):
    replicas = [
        RayPolicy(policy_fn(), name=f"replica{i}", actor_options=cluster.pin(index), timeout_s=PATIENCE)
        for i, index in enumerate(cluster.node_indices[1:3])
    ]
    router = RoutedPolicy(replicas, probe_interval_s=0.3, probe_timeout_s=30)
    obs = np.zeros((6, 4), np.float32)
    try:
        # Ray builds an actor after RayPolicy returns: both replicas are up before a request is timed. Ray's workers
        # run at niceness 15; beside 4 busy loops on 2 cores building the policy took over 60 s, the first act
        # timed out, and router.close() killing the unbuilt actor read as replica0 "killed by ray.kill"
        assert [r.describe()["policy_version"] for r in replicas] == [0, 0]
        assert [a.policy_version for a in router.act(obs, timeout=60)] == [0] * 6
        router.load_weights(version_weights(1), 1)
        assert [r.describe()["policy_version"] for r in replicas] == [1, 1]
        ray.kill(replicas[1].actor, no_restart=False)  # the process dies; Ray rebuilds it with version 0
        answers = []
        deadline = time.monotonic() + PATIENCE  # the rebuild is as slow as the first build
        while router.endpoints()[1].readmissions == 0:  # requests keep coming while it is out
            assert time.monotonic() < deadline, f"replica1 not readmitted in {PATIENCE} s: {router.endpoints()[1]}"
            answers += router.act(np.zeros((12, 4), np.float32), timeout=60)
        assert len(answers) >= 12 and all(a.action == a.policy_version % 2 for a in answers)  # all honest
        assert router.endpoints()[1].ejections == 1
        assert replicas[1].describe()["policy_version"] == 1  # caught up before serving
        router.load_weights(version_weights(2), 2)
        answers = router.act(np.zeros((12, 4), np.float32), timeout=60)
        assert {(a.policy_version, a.action) for a in answers} == {(2, 0)}
        rows = router.endpoints()
        assert rows[1].ejections >= 1 and all(row.healthy for row in rows)
        assert all(row.answered > 0 for row in rows)
    finally:
        router.close()
    assert all(r.closed for r in replicas)


def test_failures_that_closing_the_router_causes_eject_no_replica(cluster):
    """A request still waiting for its replica's actor to be built when the router closes: close kills the
    actor, the request fails with PolicyClosedError, and the replica is not reported ejected ("killed by
    ray.kill" in a warning once made a timed-out test look as if the replica had died by itself)."""
    replica = RayPolicy(functools.partial(time.sleep, 600), name="building", timeout_s=2)  # never built in time
    router = RoutedPolicy([replica])
    future = router.submit(np.zeros(4, np.float32), env_id=0)
    router.close()
    assert isinstance(future.exception(timeout=PATIENCE), PolicyClosedError)
    (row,) = router.endpoints()
    assert (row.ejections, row.healthy, row.last_error) == (0, True, "")
    assert (row.requests, row.errors, row.outstanding) == (1, 1, 0)
    assert replica.closed
