"""VersionManager: versions, backends, the max-lag gate, statistics, processes."""

from __future__ import annotations

import multiprocessing
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncvec
import asyncvec.versioning
from asyncvec.versioning import VersionManager, adapt_max_staleness


class RecordingBackend:
    def __init__(self, manager: VersionManager | None = None) -> None:
        self.manager = manager
        self.loaded: list[tuple[object, int]] = []
        self.version_visible_while_loading: list[int] = []

    def load_weights(self, weights: object, version: int) -> None:
        if self.manager is not None:
            self.version_visible_while_loading.append(self.manager.current_version)
        self.loaded.append((weights, version))


def test_exported_from_package_root() -> None:
    assert asyncvec.VersionManager is VersionManager


def test_publish_bumps_version_and_loads_backends_before_version_is_visible() -> None:
    vm = VersionManager(initial_version=3)
    first, second = RecordingBackend(vm), RecordingBackend(vm)
    vm.register(first)
    vm.register(second)
    assert vm.publish("w4") == 4
    assert vm.publish("w5") == 5
    assert vm.current_version == 5
    for backend in (first, second):
        assert backend.loaded == [("w4", 4), ("w5", 5)]
        # The new version becomes visible only after every backend loaded it.
        assert backend.version_visible_while_loading == [3, 4]
    vm.unregister(first)
    vm.publish("w6")
    assert len(first.loaded) == 2 and second.loaded[-1] == ("w6", 6)
    vm.close()


def test_concurrent_publishers_get_distinct_increasing_versions() -> None:
    vm = VersionManager()
    backend = RecordingBackend()
    vm.register(backend)
    results: list[int] = []
    lock = threading.Lock()

    def publish_many() -> None:
        for _ in range(50):
            version = vm.publish(None)
            with lock:
                results.append(version)

    threads = [threading.Thread(target=publish_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert sorted(results) == list(range(1, 201))
    assert [version for _, version in backend.loaded] == list(range(1, 201))
    assert vm.current_version == 200


def test_drop_mode_rejects_too_stale_versions_and_counts_them() -> None:
    vm = VersionManager(max_lag=2, on_lag="drop")
    for _ in range(5):
        vm.publish(None)
    assert vm.lag(1) == 4
    assert vm.admit(3) and vm.admit(5)
    assert not vm.admit(2, count=8)
    assert not vm.admit(np.int64(0))
    assert vm.staleness_stats().dropped == 9


def test_no_max_lag_admits_everything() -> None:
    vm = VersionManager(on_lag="drop")
    for _ in range(10):
        vm.publish(None)
    assert vm.admit(0) and vm.within_lag(0)
    assert vm.staleness_stats().dropped == 0


def test_wait_mode_waits_for_a_callable_version_source_to_catch_up() -> None:
    vm = VersionManager(max_lag=1, on_lag="wait", poll_interval=0.001)
    backend_version = [0]
    for _ in range(4):
        vm.publish(None)
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(vm.admit(lambda: backend_version[0], timeout=20)))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive() and not result
    backend_version[0] = 3
    waiter.join(timeout=20)
    assert result == [True]
    assert vm.staleness_stats().dropped == 0


def test_wait_mode_times_out_and_counts_a_drop() -> None:
    vm = VersionManager(max_lag=0, on_lag="wait")
    vm.publish(None)
    start = time.monotonic()
    assert not vm.admit(0, timeout=0.05)
    assert time.monotonic() - start < 5
    assert vm.staleness_stats().dropped == 1
    assert vm.wait_for_lag(1, timeout=0.01)


def test_close_wakes_every_waiter() -> None:
    vm = VersionManager(max_lag=0)
    vm.publish(None)
    results: list[bool] = []
    waiters = [
        threading.Thread(target=lambda: results.append(vm.wait_for_lag(0))),
        threading.Thread(target=lambda: results.append(vm.wait_for_version(10))),
    ]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.05)
    vm.close()
    for waiter in waiters:
        waiter.join(timeout=10)
        assert not waiter.is_alive()
    assert results == [False, False]
    assert vm.closed
    with pytest.raises(RuntimeError, match="closed"):
        vm.publish(None)


def test_wait_for_version_is_woken_by_publish() -> None:
    vm = VersionManager()
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(vm.wait_for_version(2, timeout=20)))
    waiter.start()
    vm.publish(None)
    time.sleep(0.02)
    assert waiter.is_alive()
    vm.publish(None)
    waiter.join(timeout=20)
    assert results == [True]
    assert not vm.wait_for_version(3, timeout=0.01)


def test_staleness_statistics() -> None:
    vm = VersionManager(histogram_bins=4)
    vm.record_staleness(0)
    vm.record_staleness([1, 1, 2, 3, 9])
    vm.record_staleness(np.array([0, 5]))
    stats = vm.staleness_stats()
    assert stats.count == 8
    assert stats.mean == pytest.approx((0 + 1 + 1 + 2 + 3 + 9 + 0 + 5) / 8)
    assert stats.max == 9
    assert stats.histogram == [2, 2, 1, 3]  # last bin: staleness >= 3
    vm.reset_stats()
    empty = vm.staleness_stats()
    assert (empty.count, empty.mean, empty.max, empty.histogram) == (0, 0.0, 0, [0, 0, 0, 0])


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"max_lag": -1}, ValueError, "max_lag"),
        ({"max_lag": 1.5}, TypeError, "max_lag"),
        ({"on_lag": "skip"}, ValueError, "on_lag"),
        ({"initial_version": -2}, ValueError, "initial_version"),
        ({"histogram_bins": 1}, ValueError, "histogram_bins"),
        ({"poll_interval": 0}, ValueError, "poll_interval"),
    ],
)
def test_bad_constructor_arguments_name_the_field(kwargs: dict, error: type, field: str) -> None:
    with pytest.raises(error, match=field):
        VersionManager(**kwargs)


def test_bad_call_arguments_name_the_field() -> None:
    vm = VersionManager(max_lag=1)
    with pytest.raises(ValueError, match="staleness"):
        vm.record_staleness([1, -1])
    with pytest.raises(TypeError, match="staleness"):
        vm.record_staleness(["a"])
    with pytest.raises(TypeError, match="version_in_use"):
        vm.admit("3")
    with pytest.raises(TypeError, match="version_in_use"):
        vm.wait_for_lag(lambda: None, timeout=0.01)
    with pytest.raises(TypeError, match="backend"):
        vm.register(object())
    assert vm.staleness_stats().count == 0


def _child(vm: VersionManager, results) -> None:  # runs in a spawned process
    results[0] = int(vm.wait_for_version(1, timeout=30))
    vm.record_staleness([4, 4])
    results[1] = int(vm.admit(0))  # max_lag=2, current=1 -> admitted
    results[2] = vm.publish("from child")


@pytest.mark.usefixtures("no_leftover_children")
def test_shared_with_a_spawned_child_process() -> None:
    ctx = multiprocessing.get_context("spawn")
    vm = VersionManager(max_lag=2, on_lag="drop", mp_context=ctx)
    backend = RecordingBackend()
    vm.register(backend)
    results = ctx.Array("q", 3)
    child = ctx.Process(target=_child, args=(vm, results))
    child.start()
    try:
        vm.publish("from parent")
        assert vm.wait_for_version(2, timeout=60), "child never published"
        child.join(timeout=60)
        assert child.exitcode == 0
        assert list(results) == [1, 1, 2]
        stats = vm.staleness_stats()
        assert stats.count == 2 and stats.max == 4 and stats.histogram[4] == 2
        # Backends are per process: the child's publish did not reach the parent's backend.
        assert backend.loaded == [("from parent", 1)]
        vm.publish("again")
        assert not vm.admit(0) and vm.staleness_stats().dropped == 1
    finally:
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
        vm.close()


def test_a_failing_backend_still_consumes_the_version_number() -> None:
    class Flaky:
        def __init__(self) -> None:
            self.versions: list[int] = []

        def load_weights(self, weights: object, version: int) -> None:
            if weights == "bad":
                raise ValueError("weights do not fit the model")
            self.versions.append(version)

    vm = VersionManager()
    first, flaky = RecordingBackend(), Flaky()
    vm.register(first)
    vm.register(flaky)
    vm.publish("good")
    with pytest.raises(ValueError, match="do not fit"):
        vm.publish("bad")
    assert vm.current_version == 2  # `first` already holds version 2: never reuse the number
    assert vm.publish("good again") == 3
    assert [version for _, version in first.loaded] == [1, 2, 3] and flaky.versions == [1, 3]


@settings(max_examples=200, deadline=None)
@given(
    current=st.integers(0, 64),
    ess=st.floats(0, 1),
    clipped=st.floats(0, 1),
    floor=st.integers(0, 8),
    span=st.integers(0, 32),
)
def test_adapt_max_staleness_stays_in_bounds_and_moves_the_right_way(current, ess, clipped, floor, span) -> None:
    ceiling = floor + span
    healthy = ess >= 0.5 and clipped <= 0.2
    new = adapt_max_staleness(current, ess=ess, clipped_fraction=clipped, floor=floor, ceiling=ceiling)
    assert floor <= new <= ceiling
    if healthy:
        assert new == min(max(current + 1, floor), ceiling)
    else:
        assert new == min(max(current // 2, floor), ceiling)


def test_adapt_max_staleness_rule_and_bad_input() -> None:
    rule = dict(floor=1, ceiling=8)
    assert adapt_max_staleness(8, ess=0.49, clipped_fraction=0.0, **rule) == 4  # few samples carry the weight
    assert adapt_max_staleness(8, ess=0.9, clipped_fraction=0.21, **rule) == 4  # many weights hit the cap
    assert adapt_max_staleness(1, ess=0.1, clipped_fraction=0.9, **rule) == 1  # never below the floor
    assert adapt_max_staleness(3, ess=0.5, clipped_fraction=0.2, **rule) == 4  # healthy: one more version
    assert adapt_max_staleness(6, ess=0.9, clipped_fraction=0.0, min_ess=0.95, **rule) == 3  # thresholds are options
    with pytest.raises(ValueError, match=r"ess: expected a number in \[0, 1\], got 1.5"):
        adapt_max_staleness(4, ess=1.5, clipped_fraction=0.0, **rule)
    with pytest.raises(ValueError, match="ceiling: expected an int >= 5"):
        adapt_max_staleness(4, ess=0.9, clipped_fraction=0.0, floor=5, ceiling=2)


def test_record_staleness_takes_numpy_integers_and_rejects_bad_values() -> None:
    vm = VersionManager(histogram_bins=4)
    vm.record_staleness(np.array([0, 1, 1, 7]))
    stats = vm.staleness_stats()
    assert stats.histogram == [1, 2, 0, 1] and stats.max == 7 and stats.mean == 9 / 4
    with pytest.raises(ValueError, match=r"staleness: expected an int >= 0, got -1"):
        vm.record_staleness([2, -1])
    with pytest.raises(TypeError, match="staleness: expected an int, got bool"):
        vm.record_staleness([True])
    with pytest.raises(TypeError, match="staleness: expected an int, got float"):
        vm.record_staleness([1.5])
    assert vm.staleness_stats().count == 4, "a rejected batch records nothing"
    vm.close()
