"""Collector: transitions are consistent, version-tagged, back-pressured and gated; errors surface."""

from __future__ import annotations

import multiprocessing
import threading
import time
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode
from toy_envs import CounterEnv, SleepyEnv

from asyncvec import AsyncLLMVectorEnv, Collector, CollectorError, ReplayBuffer, RolloutStore, VersionManager
from asyncvec.inference import LatencyModel, TorchPolicy


def cartpole_envs(n=4, mode=AutoresetMode.SAME_STEP, batch_size=1):
    return AsyncLLMVectorEnv([lambda: gym.make("CartPole-v1")] * n, batch_size=batch_size, autoreset_mode=mode)


def linear_policy(space, **kwargs):
    torch.manual_seed(0)
    return TorchPolicy(torch.nn.Linear(4, 2), space, max_wait_ms=1, **kwargs)


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP], ids=lambda m: m.value)
def test_transitions_chain_and_carry_behavior_logp(mode, no_leftover_children):
    envs = cartpole_envs(mode=mode)
    policy = linear_policy(envs.single_action_space)
    store = RolloutStore(64, 4, envs.single_observation_space, envs.single_action_space)
    try:
        with Collector(envs, policy, store, seed=0) as collector:
            segment = store.get(timeout=60)
        obs, actions = torch.as_tensor(segment.obs), torch.as_tensor(segment.action)
        with torch.no_grad():
            logp = torch.log_softmax(policy.module(obs), -1).gather(-1, actions[..., None]).squeeze(-1)
        np.testing.assert_allclose(segment.behavior_logp, logp.numpy(), atol=1e-5)
        assert (segment.policy_version == 0).all() and (segment.reward == 1.0).all()
        done = segment.terminated | segment.truncated
        assert done.any(), "episodes end within 64 random-ish steps"
        # CartPole episodes start near zero: every step after a done is a fresh reset observation,
        # so the reset step of NEXT_STEP mode was not recorded as a transition.
        starts = segment.obs[1:][done[:-1]]
        assert np.abs(starts).max() <= 0.05
        m = collector.metrics()
        assert m["env_steps"] >= 256 and m["episodes"] >= 1 and m["episodic_return"] > 0
        assert m["policy/requests"] >= 256
    finally:
        policy.close()
        envs.close()


def test_next_obs_matches_following_obs():
    seen = []
    envs = cartpole_envs(n=2)
    policy = linear_policy(envs.single_action_space)
    try:
        with Collector(envs, policy, seen.append, seed=1):
            deadline = time.monotonic() + 30
            while sum(len(t.env_id) for t in seen) < 200 and time.monotonic() < deadline:
                time.sleep(0.01)
        per_env = {0: [], 1: []}
        for t in list(seen):
            for k, e in enumerate(t.env_id):
                per_env[int(e)].append((t.obs[k], t.next_obs[k], t.terminated[k] or t.truncated[k]))
        checked = 0
        for rows in per_env.values():
            for (obs, next_obs, done), (following, _, _) in zip(rows, rows[1:]):
                if not done:
                    np.testing.assert_array_equal(next_obs, following)
                    checked += 1
        assert checked > 100
    finally:
        policy.close()
        envs.close()


def test_versions_follow_load_weights():
    envs = cartpole_envs()
    policy = linear_policy(envs.single_action_space)
    buffer = ReplayBuffer(10_000, envs.single_observation_space, envs.single_action_space)
    versions = VersionManager()
    versions.register(policy)
    try:
        with Collector(envs, policy, buffer, version_manager=versions, seed=0) as collector:
            for _ in range(3):
                while len(buffer) < 50 * (versions.current_version + 1):
                    time.sleep(0.01)
                    collector.check()
                versions.publish({k: v + 0.1 for k, v in policy.module.state_dict().items()})
            while buffer.version_range() is None or buffer.version_range()[1] < 3:
                time.sleep(0.01)
                collector.check()
        batch = buffer.sample(len(buffer), current_version=3)
        assert set(batch.policy_version.tolist()) == {0, 1, 2, 3}
        assert (batch.staleness == 3 - batch.policy_version).all()
        assert (batch.env_id >= 0).all() and (batch.episode_id >= 0).all() and not batch.fallback.any()
    finally:
        policy.close()
        envs.close()
        versions.close()


def test_back_pressure_parks_envs_until_the_learner_takes_the_segment():
    envs = cartpole_envs()
    policy = linear_policy(envs.single_action_space)
    store = RolloutStore(16, 4, envs.single_observation_space, envs.single_action_space, max_steps_ahead=0)
    try:
        with Collector(envs, policy, store, seed=0) as collector:
            deadline = time.monotonic() + 30
            while not store.ready() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # the collector would overrun the store here without back-pressure
            collector.check()
            assert store.steps_per_env == [16] * 4
            first = store.get(timeout=0)
            second = store.get(timeout=30)
        assert first.reward.shape == second.reward.shape == (16, 4)
    finally:
        policy.close()
        envs.close()


def test_max_lag_gate_holds_the_collector():
    envs = cartpole_envs(n=2)
    policy = linear_policy(envs.single_action_space)
    buffer = ReplayBuffer(10_000, envs.single_observation_space, envs.single_action_space)
    versions = VersionManager(max_lag=1)  # the policy is not registered: it falls behind
    try:
        with Collector(envs, policy, buffer, version_manager=versions, seed=0) as collector:
            while len(buffer) < 20:
                time.sleep(0.01)
            versions.publish({})
            versions.publish({})  # lag 2 > max_lag 1
            time.sleep(0.3)
            held = len(buffer)
            time.sleep(0.5)
            assert len(buffer) - held <= 2, "the gate lets no new observation through"
            assert collector.metrics()["gate_waits"] >= 1
            policy.load_weights(policy.module.state_dict(), 2)  # the policy catches up
            deadline = time.monotonic() + 30
            while len(buffer) < held + 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(buffer) >= held + 20
    finally:
        policy.close()
        envs.close()
        versions.close()


def test_deadline_fallbacks_are_flagged_in_the_buffer():
    envs = cartpole_envs(n=2)
    slow = LatencyModel(linear_policy(envs.single_action_space), a_ms=200, b_ms=0, deadline_ms=20, fallback="zero")
    buffer = ReplayBuffer(1000, envs.single_observation_space, envs.single_action_space)
    try:
        with Collector(envs, slow, buffer, seed=0) as collector:
            while len(buffer) < 20:
                time.sleep(0.01)
                collector.check()
        batch = buffer.sample(len(buffer), current_version=0, exclude_fallback=False)
        assert batch.fallback.all() and (batch.action == 0).all()
        assert collector.metrics()["fallback_rate"] == 1.0
        with pytest.raises(ValueError, match="eligible"):
            buffer.sample(1, current_version=0)  # fallbacks are excluded by default
    finally:
        slow.close()
        envs.close()


def test_deadline_fallbacks_are_flagged_in_rollout_segments():
    envs = cartpole_envs(n=2)
    slow = LatencyModel(linear_policy(envs.single_action_space), a_ms=200, b_ms=0, deadline_ms=20, fallback="zero")
    store = RolloutStore(4, 2, envs.single_observation_space, envs.single_action_space)
    try:
        with Collector(envs, slow, store, seed=0):
            segment = store.get(timeout=60)
        assert segment.fallback.shape == (4, 2) and segment.fallback.all() and (segment.action == 0).all()
        assert (segment.behavior_logp == 0.0).all(), "a fallback is deterministic: mu(a) = 1"
    finally:
        slow.close()
        envs.close()


def test_policy_error_surfaces_and_wakes_the_learner():
    envs = AsyncLLMVectorEnv([partial(CounterEnv, obs_kind="box")] * 2, batch_size=1)
    policy = TorchPolicy(torch.nn.Linear(4, 3), envs.single_action_space, max_wait_ms=1)  # obs has 3 dims
    store = RolloutStore(8, 2, envs.single_observation_space, envs.single_action_space)
    try:
        collector = Collector(envs, policy, store, seed=0).start()
        with pytest.raises(RuntimeError, match="closed"):
            store.get(timeout=30)
        with pytest.raises(CollectorError, match="the collector stopped"):
            collector.check()
        collector.stop()
    finally:
        policy.close()
        envs.close()


def test_constructor_errors():
    envs = AsyncLLMVectorEnv([CounterEnv] * 2, autoreset_mode=AutoresetMode.DISABLED)
    policy = TorchPolicy(torch.nn.Linear(3, 3), envs.single_action_space)
    try:
        with pytest.raises(ValueError, match="DISABLED"):
            Collector(envs, policy, lambda t: None)
        with pytest.raises(TypeError, match="AsyncLLMVectorEnv"):
            Collector(gym.vector.SyncVectorEnv([CounterEnv]), policy, lambda t: None)
    finally:
        envs.close()
    envs = AsyncLLMVectorEnv([CounterEnv] * 2)
    try:
        with pytest.raises(TypeError, match="sink must be"):
            Collector(envs, policy, 3)
        with pytest.raises(ValueError, match="num_envs=5"):
            Collector(envs, policy, RolloutStore(4, 5, envs.single_observation_space, envs.single_action_space))
    finally:
        policy.close()
        envs.close()


# ---------------------------------------------------------------- the max-lag rule


class RecordingSends:
    """Wraps ``envs.send``: for each env, the learner's version at each send of an action."""

    def __init__(self, envs, versions, after_send=None):
        self.envs, self.versions, self.after_send = envs, versions, after_send
        self.original = envs.send
        self.at_send = {i: [] for i in range(envs.num_envs)}
        envs.send = self

    def __call__(self, actions, env_ids):
        current = self.versions.current_version
        self.original(actions, env_ids)
        for env_id in np.asarray(env_ids).tolist():
            self.at_send[env_id].append(current)
        if self.after_send is not None:
            self.after_send(sum(len(v) for v in self.at_send.values()))


class PublishesOnSubmit:
    """A policy whose ``n``-th request, once submitted, makes the learner publish twice: an
    answer computed with the old version is then on its way while the gate is closed."""

    def __init__(self, policy, versions, n):
        self.policy, self.versions, self.n, self.submits = policy, versions, n, 0
        self.published = threading.Event()

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def submit(self, obs, **kwargs):
        future = self.policy.submit(obs, **kwargs)
        self.submits += 1
        if self.submits == self.n:
            self.versions.publish(None)
            self.versions.publish(None)  # lag 2 > max_lag 1
            self.published.set()
        return future


def rows_by_env(seen, num_envs):
    versions = {i: [] for i in range(num_envs)}
    for t in list(seen):
        for env_id, version in zip(t.env_id.tolist(), t.policy_version.tolist()):
            versions[env_id].append(version)
    return versions


def assert_every_action_within_lag(sends, seen, num_envs, max_lag):
    """The k-th action sent to an env is the one its k-th written transition carries (SAME_STEP)."""
    checked = 0
    for env_id, versions in rows_by_env(seen, num_envs).items():
        for k, (current, version) in enumerate(zip(sends.at_send[env_id], versions)):
            assert current - version <= max_lag, (
                f"env {env_id}'s action {k} (version {version}) was sent when version {current} was published"
            )
            checked += 1
    return checked


def test_an_action_computed_before_the_gate_closed_is_not_executed_after(one_torch_thread):
    """max_lag=1: the learner publishes twice while a version-0 answer is being computed. That
    answer must not run (not while the gate is closed, nor once it reopens): it is dropped and
    the observation asked again with version 2."""
    envs = cartpole_envs(n=1)
    versions = VersionManager(max_lag=1)  # the policy is not registered: it stays at version 0
    inner = LatencyModel(linear_policy(envs.single_action_space), a_ms=300, b_ms=0)
    policy = PublishesOnSubmit(inner, versions, n=3)
    sends = RecordingSends(envs, versions)
    seen = []
    try:
        with Collector(envs, policy, seen.append, version_manager=versions, seed=0) as collector:
            assert policy.published.wait(30)
            time.sleep(1.0)  # the version-0 answer arrives meanwhile (300 ms)
            collector.check()
            held = sum(len(t.env_id) for t in seen)
            inner.load_weights(inner.policy.module.state_dict(), 2)  # the policy catches up: the gate reopens
            deadline = time.monotonic() + 30
            while rows_by_env(seen, 1)[0].count(2) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
                collector.check()
            m = collector.metrics()
        written = rows_by_env(seen, 1)[0]
        assert held == 2 and written[:2] == [0, 0], "two version-0 steps before the publish"
        assert set(written[2:]) == {2}, f"after the publish only version-2 actions ran: {written}"
        assert assert_every_action_within_lag(sends, seen, 1, max_lag=1) >= 5
        assert m["stale_actions_dropped"] == 1 and versions.staleness_stats().dropped == 1
        assert m["gate_waits"] >= 1
    finally:
        inner.close()
        envs.close()
        versions.close()


def test_steps_already_made_reach_the_sink_while_the_gate_is_closed(one_torch_thread):
    """The gate closes while an env steps (0.5 s) an action sent within the lag: that transition is
    written at once, not when the gate reopens; the next action waits for the gate."""
    envs = AsyncLLMVectorEnv([partial(SleepyEnv, 0.5, max_len=50)], autoreset_mode=AutoresetMode.SAME_STEP)
    versions = VersionManager(max_lag=1)
    policy = TorchPolicy(torch.nn.Linear(3, 3), envs.single_action_space, max_wait_ms=1)

    def close_the_gate(sent):
        if sent == 2:
            versions.publish(None)
            versions.publish(None)

    sends = RecordingSends(envs, versions, after_send=close_the_gate)
    seen = []
    try:
        with Collector(envs, policy, seen.append, version_manager=versions, seed=0) as collector:
            deadline = time.monotonic() + 20
            while len(seen) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
                collector.check()
            assert len(seen) == 2, "the second step, sent before the gate closed, was withheld"
            time.sleep(1.2)  # two more steps' time: the gate holds the next action
            assert len(seen) == 2 and sum(len(v) for v in sends.at_send.values()) == 2
            assert collector.metrics()["gate_waits"] >= 1
            policy.load_weights(policy.module.state_dict(), 2)
            deadline = time.monotonic() + 20
            while len(seen) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
                collector.check()
        assert rows_by_env(seen, 1)[0][:4] == [0, 0, 2, 2]
        assert_every_action_within_lag(sends, seen, 1, max_lag=1)
    finally:
        policy.close()
        envs.close()
        versions.close()


def test_a_stopped_collector_leaves_its_envs_idle_even_when_woken_while_draining(no_leftover_children):
    """A policy answer arriving as the collector stops wakes the env (wake()): the drain of the steps still in
    flight ended there, and the next collector on the same env (a Ray collector actor's next run) failed its
    async_reset with AlreadyPendingCallError."""
    with AsyncLLMVectorEnv([partial(SleepyEnv, 0.2)] * 2, batch_size=1) as envs:
        policy = TorchPolicy(torch.nn.Linear(3, 3), envs.single_action_space)
        collector = Collector(envs, policy, RolloutStore(4, 2, envs.single_observation_space, envs.single_action_space))
        envs.async_reset(seed=0)
        while envs.in_flight:
            envs.recv()
        envs.send(np.ones(2, dtype=np.int64))  # both in flight for 0.2 s
        stop = threading.Event()

        def late_answers():
            while not stop.wait(0.01):
                envs.wake()

        waker = threading.Thread(target=late_answers)
        waker.start()
        try:
            collector._loop_ended()
        finally:
            stop.set()
            waker.join()
        policy.close()
        assert envs.in_flight == []
        envs.async_reset(seed=1)  # the next collector's first call
        while envs.in_flight:
            try:
                envs.recv()
            except multiprocessing.TimeoutError:  # the waker's last wake(): a Collector's loop goes on, as here
                continue
