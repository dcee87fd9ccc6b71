"""RolloutStore filled asynchronously, the add signature it shares with ReplayBuffer, and CompletionGroups."""

from __future__ import annotations

import inspect
import threading
import time
from dataclasses import fields

import numpy as np
import pytest
from gymnasium import spaces

from asyncvec.buffers import BufferClosedError, CompletionGroups, ReplayBatch, ReplayBuffer, RolloutStore, Transitions
from asyncvec.buffers.transitions import NUMBERS

OBS = spaces.Box(-np.inf, np.inf, (2,), np.float64)


class AsyncCollector:
    """Feeds a store the way an EnvPool-style collector does: random partial batches.

    Env ``e``'s ``k``-th transition has obs ``[e, k]``, next_obs ``[e, k + 1]``, action ``k % 2``,
    reward ``k``, version ``k // 3``, value ``-k`` and a fallback flag on ``k % 5 == 2``; so every
    stored field says where it came from.
    """

    def __init__(self, store: RolloutStore, seed: int) -> None:
        self.store = store
        self.rng = np.random.default_rng(seed)
        self.steps = np.zeros(store.num_envs, dtype=np.int64)

    def add(self, env_ids: np.ndarray) -> None:
        k = np.zeros(len(env_ids), dtype=np.int64)
        counts = self.steps.copy()
        for row, env in enumerate(env_ids):  # duplicates take consecutive steps
            k[row] = counts[env]
            counts[env] += 1
        self.store.add(
            np.stack([env_ids, k], axis=1).astype(np.float64),
            k % 2,
            k.astype(np.float32),
            np.stack([env_ids, k + 1], axis=1).astype(np.float64),
            k % 4 == 3,
            np.zeros(len(k), bool),
            k // 3,
            behavior_logp=-0.01 * k,
            env_id=env_ids,
            fallback=k % 5 == 2,
            values=-k.astype(np.float32),
        )
        self.steps = counts

    def random_batch(self, limit: int) -> np.ndarray:
        allowed = np.flatnonzero(self.steps < limit)
        if len(allowed) == 0:
            return np.empty(0, dtype=np.int64)
        size = int(self.rng.integers(1, len(allowed) + 1))
        picked = self.rng.choice(allowed, size, replace=False)
        # Sometimes the same env twice in one batch.
        if self.steps[picked[0]] + 1 < limit and self.rng.random() < 0.3:
            picked = np.append(picked, picked[0])
        return picked


@pytest.mark.parametrize("seed", range(5))
def test_partial_batches_in_any_order_build_time_major_segments(seed: int) -> None:
    T, N = 5, 4
    store = RolloutStore(T, N, OBS, spaces.Discrete(2), max_steps_ahead=3)
    collector = AsyncCollector(store, seed)
    for segment_index in range(3):
        limit = (segment_index + 1) * T + store.max_steps_ahead
        while not store.ready():
            collector.add(collector.random_batch(limit))
        # Some envs run ahead into the next segment before the learner calls get().
        for _ in range(2):
            batch = collector.random_batch(limit)
            if len(batch):
                collector.add(batch)
        segment = store.get(timeout=0)
        k = segment_index * T + np.arange(T)[:, None] * np.ones(N, dtype=np.int64)
        np.testing.assert_array_equal(segment.obs[..., 0], np.broadcast_to(np.arange(N), (T, N)))
        np.testing.assert_array_equal(segment.obs[..., 1], k)
        np.testing.assert_array_equal(segment.action, k % 2)
        np.testing.assert_array_equal(segment.reward, k)
        np.testing.assert_array_equal(segment.terminated, k % 4 == 3)
        np.testing.assert_array_equal(segment.values, -k)
        np.testing.assert_allclose(segment.behavior_logp, -0.01 * k, rtol=1e-5)
        np.testing.assert_array_equal(segment.policy_version, k // 3)
        np.testing.assert_array_equal(segment.staleness(10), 10 - k // 3)
        np.testing.assert_array_equal(segment.next_obs[..., 1], k + 1)
        np.testing.assert_array_equal(segment.fallback, k % 5 == 2)
        # Bootstrap: the observation after step T-1 of every env.
        np.testing.assert_array_equal(
            segment.last_obs, np.stack([np.arange(N), np.full(N, (segment_index + 1) * T)], 1)
        )
        assert segment.reward.dtype == np.float32 and segment.policy_version.dtype == np.int64
        assert store.steps_per_env == (collector.steps - (segment_index + 1) * T).tolist()


def test_get_waits_for_a_collector_thread() -> None:
    store = RolloutStore(3, 2, OBS, spaces.Discrete(2))
    collector = AsyncCollector(store, 0)

    def collect() -> None:
        for _ in range(3):
            time.sleep(0.01)
            collector.add(np.array([1, 0]))

    thread = threading.Thread(target=collect)
    thread.start()
    segment = store.get(timeout=30)
    thread.join(timeout=30)
    assert segment.reward.tolist() == [[0, 0], [1, 1], [2, 2]]


def test_a_lock_left_held_by_an_interrupt_is_released_for_the_collector_thread() -> None:
    store = RolloutStore(3, 2, OBS, spaces.Discrete(2))
    store._cond.acquire()  # what a KeyboardInterrupt landing as get() enters its `with` leaves behind
    thread = threading.Thread(target=lambda: AsyncCollector(store, 0).add(np.array([0, 1])))
    thread.start()
    thread.join(timeout=0.2)
    assert thread.is_alive()  # the collector thread waits for the lock
    store.release_after_interrupt()
    thread.join(timeout=10)
    assert not thread.is_alive() and store.steps_per_env == [1, 1]
    store.release_after_interrupt()  # not held: nothing to do


def test_get_times_out_and_close_wakes_it() -> None:
    store = RolloutStore(2, 2, OBS, spaces.Discrete(2))
    AsyncCollector(store, 0).add(np.array([0, 0, 1]))
    with pytest.raises(TimeoutError, match=r"steps per env \[2, 1\], need 2 each"):
        store.get(timeout=0.01)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            store.get(timeout=30)
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.02)
    store.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and "closed" in str(errors[0]) and isinstance(errors[0], BufferClosedError)
    with pytest.raises(BufferClosedError, match="RolloutStore is closed"):
        AsyncCollector(store, 0).add(np.array([1]))


def test_bootstrap_observation_comes_from_next_obs_or_the_next_step() -> None:
    store = RolloutStore(1, 2, spaces.Discrete(10), spaces.Discrete(2), max_steps_ahead=2)
    zeros = np.zeros(2, bool)
    store.add(np.array([1, 2]), np.array([0, 0]), [0.0, 0.0], None, zeros, zeros, 0, env_id=[0, 1])
    with pytest.raises(ValueError, match=r"envs \[0, 1\] have no bootstrap observation"):
        store.get(timeout=0)
    store.add(np.array([7]), np.array([1]), [1.0], np.array([8]), [False], [False], 0, env_id=[1])
    store.add(np.array([3]), np.array([0]), [0.0], np.array([4]), [False], [False], 0, env_id=[0])
    store.add(np.array([5]), np.array([1]), [0.0], np.array([6]), [False], [False], 0, env_id=[0])
    segment = store.get(timeout=0)
    assert segment.last_obs.tolist() == [3, 7] and segment.obs.tolist() == [[1, 2]]
    assert np.isnan(segment.values).all()
    segment = store.get(timeout=0)
    assert segment.obs.tolist() == [[3, 7]] and segment.last_obs.tolist() == [5, 8] and store.steps_per_env == [1, 0]
    store.clear()
    assert store.steps_per_env == [0, 0] and not store.ready()


def test_text_and_dict_observations() -> None:
    space = spaces.Dict({"prompt": spaces.Text(6, charset="abc"), "turn": spaces.Discrete(4)})
    store = RolloutStore(2, 2, space, spaces.Text(3, charset="xy"))
    for turn in range(2):
        store.add(
            {"prompt": ["a" * (turn + 1), "b"], "turn": np.array([turn, turn])},
            ["x", "yy"],
            [1.0, 2.0],
            {"prompt": ["c", "c"], "turn": np.array([turn + 1, turn + 1])},
            [False, False],
            [False, False],
            turn,
            behavior_logp=[-1.0, -2.0],
            env_id=[1, 0],
        )
    segment = store.get(timeout=0)
    assert segment.obs["prompt"].tolist() == [["b", "a"], ["b", "aa"]]
    assert segment.action.tolist() == [["yy", "x"], ["yy", "x"]]
    assert segment.last_obs["turn"].tolist() == [2, 2]


def test_both_buffers_take_one_add_signature_and_the_transitions_record() -> None:
    def parameters(add):
        return [(p.name, p.kind, p.default) for p in list(inspect.signature(add).parameters.values())[1:]]

    assert parameters(ReplayBuffer.add) == parameters(RolloutStore.add)  # (the NaN defaults are one object)
    assert [name for name, _, _ in parameters(RolloutStore.add)] == [field.name for field in fields(Transitions)]
    batch = Transitions(
        obs=np.array([[0.0, 1.0], [2.0, 3.0]]),
        action=np.array([1, 0]),
        reward=np.array([0.5, -0.5]),
        next_obs=np.array([[4.0, 5.0], [6.0, 7.0]]),
        terminated=np.array([False, True]),
        truncated=np.array([True, False]),
        policy_version=np.array([3, 4]),
        behavior_logp=np.array([-0.1, -0.2]),
        env_id=np.array([1, 0]),
        episode_id=np.array([7, 8]),
        fallback=np.array([False, True]),
        values=np.array([0.25, 0.75]),
    )
    replay, store = ReplayBuffer(4, OBS, spaces.Discrete(2)), RolloutStore(1, 2, OBS, spaces.Discrete(2))
    replay.add_transitions(batch)
    store.add_transitions(batch)
    sampled, segment = replay.gather([0, 1], current_version=4), store.get(timeout=0)
    for name in ("obs", "action", "reward", "next_obs", "terminated", "truncated", "policy_version", "env_id"):
        np.testing.assert_allclose(getattr(sampled, name), getattr(batch, name), err_msg=name)
    for name in ("obs", "action", "reward", "next_obs", "terminated", "truncated", "policy_version", "fallback"):
        np.testing.assert_allclose(getattr(segment, name)[0], getattr(batch, name)[::-1], err_msg=name)  # by env
    np.testing.assert_allclose(sampled.behavior_logp, batch.behavior_logp, rtol=1e-6)
    assert sampled.episode_id.tolist() == [7, 8] and sampled.fallback.tolist() == [False, True]
    assert np.isnan(sampled.values).all() and segment.values[0].tolist() == [0.75, 0.25]  # only the store keeps values


def test_bad_input_names_the_field_and_env() -> None:
    store = RolloutStore(2, 3, OBS, spaces.Discrete(2), max_steps_ahead=0)
    zeros = np.zeros(2, bool)

    def add(env_ids=(0, 2), obs=None, action=(0, 1), version=0):
        obs = np.zeros((2, 2)) if obs is None else obs
        store.add(
            obs, np.asarray(action), [0.0, 0.0], None, zeros, zeros, version, behavior_logp=[-0.1, -0.2], env_id=env_ids
        )

    with pytest.raises(ValueError, match=r"env_id: row 1: env 3 is not in \[0, 3\)"):
        add(env_ids=(0, 3))
    with pytest.raises(ValueError, match=r"env_id: expected a 1-D int array"):
        add(env_ids=(0.0, 1.0))
    with pytest.raises(ValueError, match=r"env_id: RolloutStore.add needs the env index of each row"):
        store.add(np.zeros((2, 2)), np.array([0, 1]), [0.0, 0.0], None, zeros, zeros, 0)
    with pytest.raises(ValueError, match=r"obs: expected a batch of shape \(2, 2\) from Box"):
        add(obs=np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"action: row 1 \(env 2\): value 5 is not in Discrete\(2\)"):
        add(action=(0, 5))
    with pytest.raises(ValueError, match=r"policy_version: row 0: expected a value >= 0"):
        add(version=-3)
    with pytest.raises(ValueError, match=r"fallback: expected bool values, shape \(2,\)"):
        store.add(np.zeros((2, 2)), np.array([0, 1]), [0.0, 0.0], None, zeros, zeros, 0, env_id=[0, 2], fallback=[True])
    add()
    add()
    with pytest.raises(ValueError, match=r"add: env 0 already holds 2 steps.*max_steps_ahead=0"):
        add()
    assert store.steps_per_env == [2, 0, 2]
    with pytest.raises(ValueError, match="num_steps"):
        RolloutStore(0, 1, OBS, spaces.Discrete(2))


def test_completion_groups_collect_interleaved_completions() -> None:
    groups = CompletionGroups(group_size=3)
    rng = np.random.default_rng(0)
    arrivals = [(prompt, i) for prompt in range(4) for i in range(3)]
    rng.shuffle(arrivals)
    completed = []
    for prompt, i in arrivals:
        length = 1 + (prompt + i) % 4
        if groups.add(f"p{prompt}", f"c{prompt}.{i}", reward=prompt + i / 10, logps=np.full(length, -0.5), version=i):
            completed.append(f"p{prompt}")
    assert groups.num_complete == 4 and groups.num_pending == 0
    first = groups.pop(num_groups=1, timeout=0)
    assert first.prompt_ids == completed[:1] and first.rewards.shape == (1, 3)
    rest = groups.pop(timeout=0)
    assert rest.prompt_ids == completed[1:]
    for batch in (first, rest):
        for g, prompt_id in enumerate(batch.prompt_ids):
            prompt = int(prompt_id[1:])
            order = [int(c.split(".")[1]) for c in batch.completions[g]]
            np.testing.assert_allclose(batch.rewards[g], [prompt + i / 10 for i in order], rtol=1e-6)
            assert batch.policy_version[g].tolist() == order
            lengths = [1 + (prompt + i) % 4 for i in order]
            assert batch.mask[g].sum(-1).tolist() == lengths
            assert np.all(batch.logps[g][batch.mask[g]] == -0.5) and np.all(batch.logps[g][~batch.mask[g]] == 0)
    assert rest.staleness(5).max() == 5
    with pytest.raises(TimeoutError, match=r"0 complete groups after 0.01s, need 1"):
        groups.pop(timeout=0.01)


def test_completion_groups_across_threads_and_bad_input() -> None:
    groups = CompletionGroups(group_size=2)
    result = []
    waiter = threading.Thread(target=lambda: result.append(groups.pop(num_groups=2, timeout=30)))
    waiter.start()
    for prompt in ("a", "b"):
        for _ in range(2):
            groups.add(prompt, "text", 1.0, [-0.1, -0.2], 0)
    waiter.join(timeout=30)
    assert result[0].prompt_ids == ["a", "b"]
    with pytest.raises(ValueError, match="prompt_id: expected a hashable"):
        groups.add(["unhashable"], "x", 0.0, [-1.0], 0)
    with pytest.raises(ValueError, match="logps: expected a 1-D array"):
        groups.add("a", "x", 0.0, [[-1.0]], 0)
    with pytest.raises(ValueError, match="reward: row 0: expected a finite number"):
        groups.add("a", "x", float("nan"), [-1.0], 0)
    with pytest.raises(ValueError, match="version: row 0: expected a value >= 0"):
        groups.add("a", "x", 0.0, [-1.0], -1)
    with pytest.raises(ValueError, match="group_size"):
        CompletionGroups(0)


def test_the_numbers_of_transitions_are_defined_once() -> None:
    """Each buffer stores, checks and returns the per-transition numbers that `Transitions` declares
    (`NUMBERS`), so a field added there reaches both (the add signature above must follow it)."""
    kept = {number.name for number in NUMBERS} - {"values"}  # a ReplayBuffer keeps no critic values
    replay = ReplayBuffer(4, OBS, spaces.Discrete(2))
    assert kept <= set(replay.column_nbytes())
    assert {number.name for number in NUMBERS} <= {field.name for field in fields(ReplayBatch)}
    assert [number.name for number in NUMBERS if number.required] == [
        "reward",
        "terminated",
        "truncated",
        "policy_version",
    ]
    obs = np.zeros((2, 2))
    with pytest.raises(ValueError, match=r"episode_id: expected int64 values, shape \(2,\), got float64 shape \(3,\)"):
        replay.add(
            obs, np.array([0, 1]), np.ones(2), obs, np.zeros(2, bool), np.zeros(2, bool), 0, episode_id=np.ones(3)
        )
    store = RolloutStore(1, 2, OBS, spaces.Discrete(2))
    with pytest.raises(ValueError, match=r"fallback: expected bool values, shape \(2,\)"):
        store.add(
            obs,
            np.array([0, 1]),
            np.ones(2),
            obs,
            np.zeros(2, bool),
            np.zeros(2, bool),
            0,
            env_id=[0, 1],
            fallback=[True],
        )
