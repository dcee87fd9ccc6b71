"""ReplayBuffer in RAM: spaces, ring wraparound, staleness and fallback filters, priorities."""

from __future__ import annotations

import re
import string
import threading
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncvec
import asyncvec.buffers
import asyncvec.buffers.groups
import asyncvec.buffers.replay
import asyncvec.buffers.rollout
from asyncvec.buffers import BufferClosedError, NotPrioritizedError, ReplayBuffer, SumTree

SCALAR_OBS = spaces.Box(-np.inf, np.inf, (), np.float64)


def add_serials(buffer: ReplayBuffer, serials: np.ndarray, versions, fallback=False) -> np.ndarray:
    """Add transitions whose obs, reward and episode_id all equal a unique serial number."""
    n = len(serials)
    return buffer.add(
        serials.astype(np.float64),
        serials % 2,
        serials.astype(np.float32),
        serials + 0.5,
        np.zeros(n, bool),
        np.zeros(n, bool),
        policy_version=versions,
        episode_id=serials,
        fallback=fallback,
    )


def contents(buffer: ReplayBuffer, current_version: int = 10**9, **filters) -> np.ndarray:
    """Every eligible stored serial, via one sample of all of them."""
    batch = buffer.sample(len(buffer), current_version, **filters) if len(buffer) else None
    return np.array([]) if batch is None else np.sort(batch.episode_id)


def test_exported_from_package_root() -> None:
    assert asyncvec.ReplayBuffer is ReplayBuffer
    assert asyncvec.RolloutStore is asyncvec.buffers.RolloutStore


def test_every_field_round_trips_with_dict_and_text_spaces() -> None:
    obs_space = spaces.Dict(
        {
            "image": spaces.Box(0, 255, (4, 4, 3), np.uint8),
            "prompt": spaces.Text(12, min_length=0, charset=string.ascii_lowercase + " "),
            "pair": spaces.Tuple((spaces.Discrete(5, start=-2), spaces.MultiBinary(3))),
        }
    )
    action_space = spaces.Dict(
        {"move": spaces.MultiDiscrete([3, 4]), "say": spaces.Text(5, min_length=0, charset="abc")}
    )
    buffer = ReplayBuffer(8, obs_space, action_space, seed=0)
    rng = np.random.default_rng(1)
    n = 3
    obs = {
        "image": rng.integers(0, 256, (n, 4, 4, 3), dtype=np.uint8),
        "prompt": ["hello world", "", "z"],
        "pair": (np.array([-2, 0, 2]), rng.integers(0, 2, (n, 3), dtype=np.int8)),
    }
    next_obs = {
        "image": obs["image"][::-1],
        "prompt": ["a", "bb", "ccc"],
        "pair": (np.array([1, 1, 1]), obs["pair"][1]),
    }
    action = {"move": np.array([[0, 3], [2, 0], [1, 1]]), "say": ["abc", "", "cab"]}
    buffer.add(
        obs,
        action,
        [0.5, -1.0, 2.0],
        next_obs,
        [False, True, False],
        [True, False, False],
        policy_version=[3, 4, 5],
        behavior_logp=[-0.1, -0.2, -0.3],
        env_id=[7, 8, 9],
        episode_id=[70, 80, 90],
        fallback=[False, False, True],
    )
    batch = buffer.sample(3, current_version=6, exclude_fallback=False)
    order = np.argsort(batch.env_id)
    assert batch.env_id[order].tolist() == [7, 8, 9]
    np.testing.assert_array_equal(batch.obs["image"][order], obs["image"])
    assert batch.obs["image"].dtype == np.uint8
    assert batch.obs["prompt"][order].tolist() == obs["prompt"]
    assert batch.next_obs["prompt"][order].tolist() == next_obs["prompt"]
    np.testing.assert_array_equal(batch.obs["pair"][0][order], obs["pair"][0])
    np.testing.assert_array_equal(batch.obs["pair"][1][order], obs["pair"][1])
    np.testing.assert_array_equal(batch.action["move"][order], action["move"])
    assert batch.action["say"][order].tolist() == action["say"]
    np.testing.assert_allclose(batch.reward[order], [0.5, -1.0, 2.0])
    assert batch.terminated[order].tolist() == [False, True, False]
    assert batch.truncated[order].tolist() == [True, False, False]
    np.testing.assert_allclose(batch.behavior_logp[order], [-0.1, -0.2, -0.3], rtol=1e-6)
    assert batch.policy_version[order].tolist() == [3, 4, 5]
    assert batch.staleness[order].tolist() == [3, 2, 1]
    assert batch.episode_id[order].tolist() == [70, 80, 90]
    assert batch.fallback[order].tolist() == [False, False, True]
    np.testing.assert_array_equal(batch.weights, np.ones(3, np.float32))
    assert buffer.version_range() == (3, 5) and len(buffer) == 3


def test_sample_without_replacement_and_reproducible_with_a_seed() -> None:
    buffer = ReplayBuffer(50, SCALAR_OBS, spaces.Discrete(2))
    add_serials(buffer, np.arange(40), versions=0)
    first = buffer.sample(40, 0, rng=3)
    assert sorted(first.episode_id.tolist()) == list(range(40))
    assert buffer.sample(10, 0, rng=3).episode_id.tolist() == buffer.sample(10, 0, rng=3).episode_id.tolist()
    np.testing.assert_array_equal(first.obs, first.reward)  # every row stays consistent


@settings(max_examples=40, deadline=None)
@given(
    capacity=st.integers(1, 12),
    batches=st.lists(st.integers(1, 15), min_size=1, max_size=12),
)
def test_wraparound_keeps_exactly_the_newest_capacity_samples(capacity: int, batches: list[int]) -> None:
    buffer = ReplayBuffer(capacity, SCALAR_OBS, spaces.Discrete(2))
    reference: deque[int] = deque(maxlen=capacity)
    serial = 0
    for n in batches:
        serials = np.arange(serial, serial + n)
        slots = add_serials(buffer, serials, versions=serials // 3)
        assert len(slots) == min(n, capacity) and np.all((slots >= 0) & (slots < capacity))
        reference.extend(serials.tolist())
        serial += n
        assert len(buffer) == len(reference)
        assert contents(buffer).tolist() == list(reference)
        assert buffer.version_range() == (reference[0] // 3, reference[-1] // 3)
    assert buffer.num_added == serial


@settings(max_examples=40, deadline=None)
@given(
    versions=st.lists(st.integers(0, 20), min_size=1, max_size=40),
    current=st.integers(0, 25),
    max_staleness=st.integers(0, 10),
    batch_size=st.integers(1, 40),
    prioritized=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_max_staleness_never_returns_an_older_sample(
    versions: list[int], current: int, max_staleness: int, batch_size: int, prioritized: bool, seed: int
) -> None:
    buffer = ReplayBuffer(64, SCALAR_OBS, spaces.Discrete(2), prioritized=prioritized)
    add_serials(buffer, np.arange(len(versions)), versions=versions)
    eligible = sum(current - v <= max_staleness for v in versions)
    if batch_size > eligible:
        with pytest.raises(ValueError, match="eligible"):
            buffer.sample(batch_size, current, max_staleness=max_staleness, rng=seed)
        return
    batch = buffer.sample(batch_size, current, max_staleness=max_staleness, rng=seed)
    assert np.all(batch.staleness <= max_staleness)
    np.testing.assert_array_equal(batch.staleness, current - np.asarray(versions)[batch.episode_id])
    if not prioritized:  # uniform sampling draws distinct samples
        assert len(set(batch.indices.tolist())) == batch_size


@settings(max_examples=40, deadline=None)
@given(
    fallback=st.lists(st.booleans(), min_size=1, max_size=40),
    capacity=st.integers(1, 40),
    prioritized=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_exclude_fallback_never_returns_a_fallback_sample(
    fallback: list[bool], capacity: int, prioritized: bool, seed: int
) -> None:
    buffer = ReplayBuffer(capacity, SCALAR_OBS, spaces.Discrete(2), prioritized=prioritized)
    add_serials(buffer, np.arange(len(fallback)), versions=0, fallback=fallback)
    kept = fallback[-capacity:]
    allowed = kept.count(False)
    if allowed == 0:
        with pytest.raises(ValueError, match="0 of the"):
            buffer.sample(1, 0, rng=seed)
        return
    batch = buffer.sample(allowed, 0, rng=seed)
    assert not batch.fallback.any()
    assert not np.asarray(fallback)[batch.episode_id].any()
    everything = buffer.sample(len(kept), 0, exclude_fallback=False, rng=seed)
    if not prioritized:  # prioritized sampling draws with replacement
        assert everything.fallback.sum() == sum(kept)
    np.testing.assert_array_equal(everything.fallback, np.asarray(fallback)[everything.episode_id])


def test_sampling_more_than_stored_raises_a_clear_error() -> None:
    buffer = ReplayBuffer(10, SCALAR_OBS, spaces.Discrete(2))
    with pytest.raises(ValueError, match="only 0 of the 0 stored"):
        buffer.sample(1, 0)
    add_serials(buffer, np.arange(3), versions=[1, 2, 3])
    with pytest.raises(ValueError, match="asked for 4 samples but only 3"):
        buffer.sample(4, 3)
    with pytest.raises(ValueError, match=r"max_staleness=0.*versions 1\.\.3"):
        buffer.sample(2, 3, max_staleness=0)
    with pytest.raises(ValueError, match="batch_size"):
        buffer.sample(0, 3)
    with pytest.raises(ValueError, match="max_staleness"):
        buffer.sample(1, 3, max_staleness=-1)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"obs": np.zeros((2, 4), np.float32)}, r"obs: expected a batch of shape \(2, 4, 4, 3\) from Box"),
        ({"obs": np.full((2, 4, 4, 3), 300)}, r"obs: values do not fit dtype uint8 of Box"),
        ({"obs": np.zeros((2, 4, 4, 3), np.float32)}, r"obs: expected dtype uint8"),
        ({"action": np.array([0, 3])}, r"action: row 1 \(env_id 6\): value 3 is not in Discrete\(3\)"),
        ({"next_obs": [1, 2]}, r"next_obs: expected a batch of shape"),
        ({"reward": [1.0, np.nan]}, r"reward: row 1: expected a finite number"),
        ({"reward": 1.0}, r"reward: expected a 1-D batch"),
        ({"terminated": [0, 2]}, r"terminated: values do not fit dtype bool"),
        ({"policy_version": [-1, 0]}, r"policy_version: row 0: expected a value >= 0"),
        ({"policy_version": [0.5, 1.0]}, r"policy_version: expected dtype int64"),
        ({"env_id": [1, 2, 3]}, r"env_id: expected int64 values, shape \(2,\)"),
        ({"fallback": [[True], [False]]}, r"fallback: expected bool values, shape \(2,\)"),
    ],
)
def test_bad_input_names_the_field_and_expected_space(change: dict, match: str) -> None:
    buffer = ReplayBuffer(4, spaces.Box(0, 255, (4, 4, 3), np.uint8), spaces.Discrete(3))
    image = np.zeros((2, 4, 4, 3), np.uint8)
    arguments = {
        "obs": image,
        "action": np.array([0, 2]),
        "reward": [0.0, 1.0],
        "next_obs": image,
        "terminated": [False, True],
        "truncated": [False, False],
        "policy_version": 0,
        "env_id": [5, 6],
    } | change
    with pytest.raises(ValueError, match=match):
        buffer.add(**arguments)
    assert len(buffer) == 0  # nothing half-written


def test_bad_dict_and_text_input() -> None:
    space = spaces.Dict({"text": spaces.Text(3, charset="ab"), "x": spaces.Discrete(2)})
    buffer = ReplayBuffer(4, space, spaces.Discrete(2))
    good = {"text": ["ab", "b"], "x": np.array([0, 1])}

    def add(obs):
        buffer.add(obs, np.array([0, 1]), [0.0, 0.0], good, [False, False], [False, False], 0)

    with pytest.raises(ValueError, match=r"obs: missing key 'x'"):
        add({"text": ["a", "b"]})
    with pytest.raises(ValueError, match=r"obs: expected a dict of batched arrays"):
        add(np.zeros(2))
    with pytest.raises(ValueError, match=r"obs\['text'\]: row 1: value 'abc!' is not in Text"):
        add({"text": ["a", "abc!"], "x": np.array([0, 1])})
    with pytest.raises(ValueError, match=r"obs\['text'\]: expected a list of 2 str"):
        add({"text": "ab", "x": np.array([0, 1])})
    with pytest.raises(TypeError, match=r"obs: Sequence"):
        ReplayBuffer(4, spaces.Sequence(spaces.Discrete(2)), spaces.Discrete(2))
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(0, space, spaces.Discrete(2))


def test_prioritized_sampling_follows_priorities_with_importance_weights() -> None:
    buffer = ReplayBuffer(8, SCALAR_OBS, spaces.Discrete(2), prioritized=True, alpha=1.0, beta=1.0, seed=0)
    slots = add_serials(buffer, np.arange(4), versions=0)
    buffer.update_priorities(slots, [1.0, 1.0, 1.0, 97.0])
    counts = np.zeros(4)
    for _ in range(200):
        batch = buffer.sample(4, 0)
        np.add.at(counts, batch.episode_id, 1)
        # beta = 1: w_i = (N P_i)^-1 / max_j (N P_j)^-1 = P_min / P_i.
        expected = np.where(batch.episode_id == 3, 1.0 / 97.0, 1.0)
        np.testing.assert_allclose(batch.weights, expected, rtol=1e-5)
    assert counts[3] / counts.sum() == pytest.approx(0.97, abs=0.02)
    # New samples get the largest priority seen so far.
    add_serials(buffer, np.array([4]), versions=0)
    frequencies = np.zeros(5)
    for _ in range(100):
        np.add.at(frequencies, buffer.sample(5, 0).episode_id, 1)
    assert frequencies[4] == pytest.approx(frequencies[3], rel=0.25)


def test_update_priorities_rejects_bad_input() -> None:
    buffer = ReplayBuffer(8, SCALAR_OBS, spaces.Discrete(2), prioritized=True)
    add_serials(buffer, np.arange(3), versions=0)
    with pytest.raises(ValueError, match=r"priorities: row 1: expected a value > 0"):
        buffer.update_priorities([0, 1], [1.0, 0.0])
    with pytest.raises(ValueError, match=r"priorities: row 0: expected a finite number"):
        buffer.update_priorities([0], [np.inf])
    with pytest.raises(ValueError, match=r"indices: row 0: slot 5 holds no sample"):
        buffer.update_priorities([5], [1.0])
    with pytest.raises(ValueError, match=r"priorities: expected float64 values, shape \(2,\)"):
        buffer.update_priorities([0, 1], [1.0])
    uniform = ReplayBuffer(8, SCALAR_OBS, spaces.Discrete(2))
    with pytest.raises(NotPrioritizedError, match="prioritized=False"):
        uniform.update_priorities([0], [1.0])
    assert issubclass(NotPrioritizedError, RuntimeError)  # what it raised before it was typed


def test_one_writer_and_one_reader_thread_see_consistent_rows() -> None:
    buffer = ReplayBuffer(64, spaces.Box(-np.inf, np.inf, (8,), np.float64), spaces.Discrete(2), seed=0)
    errors: list[BaseException] = []
    done = threading.Event()

    def write() -> None:
        try:
            for step in range(300):
                serials = np.arange(step * 4, step * 4 + 4)
                buffer.add(
                    np.repeat(serials[:, None], 8, axis=1).astype(np.float64),
                    serials % 2,
                    serials.astype(np.float32),
                    np.zeros((4, 8)),
                    np.zeros(4, bool),
                    np.zeros(4, bool),
                    policy_version=serials // 10,
                    episode_id=serials,
                )
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            errors.append(error)
        finally:
            done.set()

    def read() -> None:
        try:
            while not done.is_set():
                if len(buffer) >= 16:
                    batch = buffer.sample(16, 10**6)
                    # A torn row would mix two transitions.
                    assert np.all(batch.obs == batch.episode_id[:, None])
                    assert np.all(batch.reward == batch.episode_id)
                    assert np.all(batch.policy_version == batch.episode_id // 10)
        except BaseException as error:  # noqa: BLE001  (any error of the thread, re-raised in the test)
            errors.append(error)

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert not errors, errors
    assert contents(buffer).tolist() == list(range(1200 - 64, 1200))


def test_save_and_load_round_trip(tmp_path) -> None:
    space = spaces.Dict({"x": spaces.Box(-np.inf, np.inf, (), np.float64), "t": spaces.Text(6)})
    buffer = ReplayBuffer(5, space, spaces.Discrete(4), prioritized=True, alpha=0.5, seed=0)
    for start in range(0, 8, 2):
        serials = np.arange(start, start + 2)
        obs = {"x": serials.astype(np.float64), "t": [f"s{s}" for s in serials]}
        buffer.add(obs, serials % 4, serials, obs, [False, True], [False, False], start, episode_id=serials)
    buffer.update_priorities(buffer.sample(2, 10, rng=0).indices, [5.0, 6.0])
    buffer.save(tmp_path / "saved")
    loaded = ReplayBuffer.load(tmp_path / "saved")
    assert len(loaded) == 5 and loaded.version_range() == (2, 6) and loaded.num_added == 8
    assert loaded.prioritized and loaded.alpha == 0.5
    original = buffer.sample(5, 10, rng=7)
    again = loaded.sample(5, 10, rng=7)
    for name in ("reward", "policy_version", "episode_id", "indices", "weights"):
        np.testing.assert_array_equal(getattr(original, name), getattr(again, name))
    assert again.obs["t"].tolist() == [f"s{s}" for s in again.episode_id]
    # Saving again over the same directory replaces it.
    add_obs = {"x": np.array([9.0]), "t": ["s9"]}
    loaded.add(add_obs, np.array([1]), [0.0], add_obs, [False], [False], 9, episode_id=9)
    loaded.save(tmp_path / "saved")
    assert ReplayBuffer.load(tmp_path / "saved").version_range() == (4, 9)


def test_closed_buffer_refuses_work() -> None:
    buffer = ReplayBuffer(4, SCALAR_OBS, spaces.Discrete(2))
    add_serials(buffer, np.arange(2), versions=0)
    buffer.close()
    buffer.close()
    with pytest.raises(BufferClosedError, match="ReplayBuffer is closed"):
        buffer.sample(1, 0)
    with pytest.raises(RuntimeError, match="closed"):  # BufferClosedError is still a RuntimeError
        add_serials(buffer, np.arange(2), versions=0)


def test_integer_box_bounds_are_checked_unless_the_dtype_implies_them() -> None:
    narrow = ReplayBuffer(4, spaces.Box(0, 10, (2,), np.uint8), spaces.Discrete(2))
    obs = np.array([[0, 10], [11, 3]], np.uint8)
    with pytest.raises(ValueError, match=r"obs: row 1: value \[11, 3\] is not in Box\(0, 10"):
        narrow.add(obs, np.array([0, 1]), [0.0, 0.0], obs, [False, False], [False, False], 0)
    full = ReplayBuffer(4, spaces.Box(0, 255, (2,), np.uint8), spaces.Discrete(2))
    obs = np.array([[0, 255], [11, 3]], np.uint8)
    full.add(obs, np.array([0, 1]), [0.0, 0.0], obs, [False, False], [False, False], 0)
    np.testing.assert_array_equal(np.sort(full.sample(2, 0).obs, axis=0), np.sort(obs, axis=0))


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.DOTALL)


def test_docs_examples_run(capsys) -> None:
    blocks = python_blocks((Path(__file__).parent.parent / "docs" / "buffers.md").read_text())
    assert len(blocks) >= 5
    for block in blocks:
        exec(compile(block, "docs/buffers.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "1.0 2 [1, 2, 1, 0] 8" in printed and "(4, 3) (3, 2)" in printed


def test_gather_reads_given_slots_and_rejects_empty_ones() -> None:
    buffer = ReplayBuffer(6, SCALAR_OBS, spaces.Discrete(2))
    slots = add_serials(buffer, np.arange(4), versions=[1, 1, 2, 2])
    rows = buffer.gather(slots[::-1], current_version=3)
    assert rows.episode_id.tolist() == [3, 2, 1, 0] and rows.staleness.tolist() == [1, 1, 2, 2]
    np.testing.assert_array_equal(rows.obs, rows.reward)
    add_serials(buffer, np.arange(4, 8), versions=3)  # wraps: slots 0 and 1 now hold serials 6, 7
    assert buffer.gather([0, 1], 3).episode_id.tolist() == [6, 7]
    with pytest.raises(ValueError, match=r"gather: row 1: slot 6 holds no sample"):
        buffer.gather([0, 6], 3)


# -- the sum-tree behind prioritized sampling ----------------------------------------------

priority_updates = st.lists(
    st.tuples(
        st.lists(st.integers(0, 36), min_size=1, max_size=8), st.lists(st.integers(0, 50), min_size=1, max_size=8)
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 37),
    updates=priority_updates,
    draws=st.lists(st.floats(0, 1, exclude_max=True), max_size=20),
)
def test_sum_tree_matches_a_plain_proportional_sampler(capacity: int, updates, draws) -> None:
    """After any updates, the tree's totals, minimum and prefix search equal a cumulative sum's.

    Integer priorities keep every sum exact, so the descent must pick exactly the slot that
    ``searchsorted(cumsum(p), u * total, side="right")`` picks for the same uniform draw ``u``:
    the same proportional distribution, draw for draw.
    """
    tree, plain = SumTree(capacity), np.zeros(capacity)
    for indices, values in updates:
        indices = [i % capacity for i in indices]
        values = (values * len(indices))[: len(indices)]
        tree.update(indices, values)
        for index, value in zip(indices, values):  # a plain loop: the last value wins
            plain[index] = value
        np.testing.assert_array_equal(tree.values(), plain)
        assert tree.total == plain.sum()
        assert tree.min == (plain[plain > 0].min() if (plain > 0).any() else np.inf)
    rebuilt = SumTree(capacity)
    rebuilt.rebuild(plain)
    assert rebuilt.total == tree.total and rebuilt.min == tree.min
    if plain.sum() > 0:
        prefixes = np.array(draws) * plain.sum()
        expected = np.searchsorted(np.cumsum(plain), prefixes, side="right")
        np.testing.assert_array_equal(tree.find(prefixes), expected)
        np.testing.assert_array_equal(rebuilt.find(prefixes), expected)
        assert np.all(plain[tree.sample(50, np.random.default_rng(0))] > 0)  # empty leaves never drawn


def test_sum_tree_sampling_frequencies_follow_the_priorities() -> None:
    priorities = np.array([0.0, 1.0, 2.0, 0.0, 4.0, 8.0, 0.5, 0.0])
    tree = SumTree(len(priorities))
    tree.update(np.arange(len(priorities)), priorities)
    counts = np.bincount(tree.sample(200_000, np.random.default_rng(1)), minlength=len(priorities))
    expected = priorities / priorities.sum()
    # 200k draws: a frequency's standard deviation is below 0.0012.
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.006)
    assert counts[priorities == 0].sum() == 0


def test_sum_tree_rejects_bad_input() -> None:
    tree = SumTree(4)
    with pytest.raises(ValueError, match=r"indices: row 1: leaf 4 is outside 0\.\.3"):
        tree.update([0, 4], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"values: row 0: expected a finite number >= 0, got -1"):
        tree.update([0], [-1.0])
    with pytest.raises(ValueError, match="every leaf is 0"):
        tree.sample(1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="capacity"):
        SumTree(0)


def test_prioritized_sampling_from_the_tree_equals_the_masked_scan() -> None:
    """The O(log n) tree path and the O(n) scan (taken with a staleness filter) draw the same slots."""
    buffer = ReplayBuffer(50, SCALAR_OBS, spaces.Discrete(2), prioritized=True, alpha=1.0, beta=0.5, seed=0)
    slots = add_serials(buffer, np.arange(70), versions=np.arange(70) // 10)  # wraps: 50 kept
    buffer.update_priorities(slots[-50:], np.arange(1, 51, dtype=np.float64))
    from_tree = buffer.sample(40, current_version=6, rng=3)
    scanned = buffer.sample(40, current_version=6, max_staleness=100, rng=3)
    np.testing.assert_array_equal(from_tree.indices, scanned.indices)
    np.testing.assert_allclose(from_tree.weights, scanned.weights, rtol=1e-6)


def test_prioritized_sampling_skips_fallbacks_unless_asked() -> None:
    buffer = ReplayBuffer(16, SCALAR_OBS, spaces.Discrete(2), prioritized=True, seed=0)
    add_serials(buffer, np.arange(8), versions=0, fallback=np.arange(8) % 2 == 1)
    drawn = np.concatenate([buffer.sample(4, 0).episode_id for _ in range(50)])
    assert np.all(drawn % 2 == 0)  # fallbacks (odd serials) never drawn
    drawn = np.concatenate([buffer.sample(8, 0, exclude_fallback=False).episode_id for _ in range(50)])
    assert set(drawn.tolist()) == set(range(8))
    with pytest.raises(ValueError, match="only 4 of the 8 stored are eligible"):
        buffer.sample(5, 0)


def test_reopened_prioritized_buffer_rebuilds_its_tree(tmp_path) -> None:
    with ReplayBuffer(8, SCALAR_OBS, spaces.Discrete(2), prioritized=True, alpha=1.0, storage_dir=tmp_path) as buffer:
        slots = add_serials(buffer, np.arange(6), versions=0)
        buffer.update_priorities(slots, [1.0, 1.0, 1.0, 1.0, 1.0, 995.0])
        before = [buffer.sample(6, 0, rng=seed).indices for seed in range(5)]
    with ReplayBuffer.open(tmp_path, seed=0) as reopened:
        after = [reopened.sample(6, 0, rng=seed) for seed in range(5)]
        np.testing.assert_array_equal(before, [batch.indices for batch in after])
        assert np.mean([batch.episode_id == 5 for batch in after]) > 0.9


# -- the quick path of add ------------------------------------------------------------------


def test_quick_and_checked_adds_store_the_same_rows(monkeypatch) -> None:
    """Arrays of the stored dtypes take the quick path; lists take the converting one."""
    space = spaces.Box(np.array([-1, -np.inf], np.float32), np.array([1, np.inf], np.float32), dtype=np.float32)
    quick, checked = (ReplayBuffer(10, space, spaces.Discrete(3), seed=0) for _ in range(2))
    monkeypatch.setattr(quick, "_checked_rows", lambda *args: pytest.fail("the quick path was not taken"))
    rng = np.random.default_rng(0)
    for step in range(4):  # wraps around the ring of 10
        obs = rng.uniform(-1, 1, (3, 2)).astype(np.float32)
        action, reward = rng.integers(0, 3, 3), rng.normal(size=3)
        done = rng.random(3) < 0.5
        env_id = np.array([0, 1, 2]) if step % 2 else -1
        quick.add(obs, action, reward, obs, done, ~done, step, env_id=env_id)
        checked.add(
            obs.tolist(),
            action.tolist(),
            reward.tolist(),
            obs.tolist(),
            done.tolist(),
            (~done).tolist(),
            [step] * 3,
            env_id=np.broadcast_to(env_id, 3).tolist(),
        )
    a, b = quick.sample(10, 3, rng=1), checked.sample(10, 3, rng=1)
    for name in (
        "obs",
        "action",
        "reward",
        "next_obs",
        "terminated",
        "truncated",
        "policy_version",
        "env_id",
        "episode_id",
        "behavior_logp",
        "fallback",
    ):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@pytest.mark.parametrize("validate", ["first", "always"])
def test_validate_checks_values_on_the_first_add_or_always(validate: str) -> None:
    buffer = ReplayBuffer(8, spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(2), validate=validate)
    obs, bad = np.zeros((2, 2), np.float32), np.full((2, 2), 5.0, np.float32)
    args = (np.array([0, 1]), np.zeros(2, np.float32))
    flags = np.zeros(2, bool)
    with pytest.raises(ValueError, match=r"obs: row 0: value \[5\.0, 5\.0\] is not in Box"):
        buffer.add(bad, *args, obs, flags, flags, 0)  # the first add is always checked in full
    buffer.add(obs, *args, obs, flags, flags, 0)
    if validate == "always":
        with pytest.raises(ValueError, match=r"next_obs: row 0: value \[5\.0, 5\.0\]"):
            buffer.add(obs, *args, bad, flags, flags, 0)
        with pytest.raises(ValueError, match=r"action: row 1: value 2 is not in Discrete\(2\)"):
            buffer.add(obs, np.array([0, 2]), args[1], obs, flags, flags, 0)
        with pytest.raises(ValueError, match=r"reward: row 1: expected a finite number"):
            buffer.add(obs, args[0], np.array([0, np.nan], np.float32), obs, flags, flags, 0)
    else:
        buffer.add(obs, *args, bad, flags, flags, 0)  # values are trusted after the first add
    # Types, dtypes, shapes and scalar metadata are checked on every add, in both modes.
    with pytest.raises(ValueError, match=r"obs: expected a batch of shape \(2, 2\)"):
        buffer.add(np.zeros((2, 3), np.float32), *args, obs, flags, flags, 0)
    with pytest.raises(ValueError, match=r"action: row 1: value 2 is not in Discrete\(2\)"):
        buffer.add(obs, [0, 2], args[1], obs, flags, flags, 0)  # a list is converted and checked
    with pytest.raises(ValueError, match=r"obs: expected dtype float32"):
        buffer.add(np.zeros((2, 2), np.complex64), *args, obs, flags, flags, 0)
    with pytest.raises(ValueError, match=r"policy_version: row 0: expected a value >= 0"):
        buffer.add(obs, *args, obs, flags, flags, -1)
    with pytest.raises(ValueError, match="validate"):
        ReplayBuffer(8, spaces.Discrete(2), spaces.Discrete(2), validate="never")


@settings(max_examples=40, deadline=None)
@given(
    capacity=st.integers(1, 40),
    ranges=st.lists(st.tuples(st.integers(0, 39), st.integers(0, 8), st.integers(0, 9)), max_size=10),
)
def test_sum_tree_deferred_ranges_equal_immediate_updates(capacity: int, ranges) -> None:
    """set_range (ancestors deferred to the next read) ends in the same tree as update."""
    deferred, immediate = SumTree(capacity), SumTree(capacity)
    for start, length, value in ranges:
        start = start % capacity
        stop = min(start + length, capacity)
        deferred.set_range(start, stop, float(value))
        immediate.update(np.arange(start, stop), np.full(stop - start, float(value)))
        if value % 3 == 0:  # read in between sometimes: flushes the pending range
            assert deferred.total == immediate.total
    assert deferred.total == immediate.total and deferred.min == immediate.min
    prefixes = np.linspace(0, immediate.total, 17, endpoint=False)
    np.testing.assert_array_equal(deferred.find(prefixes), immediate.find(prefixes))
