"""DynamicBatcher: dispatch rules, priorities, concurrency, adaptive cost fit, shutdown."""

import queue
import threading
import time

import pytest
from test_inference_policy import no_leftover_threads  # noqa: F401  (fixture)

from asyncvec.inference import DynamicBatcher, PolicyClosedError, adaptive_threshold, fit_batch_cost

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leftover_threads")]


def test_full_batch_is_dispatched_without_waiting():
    batches = queue.Queue()
    batcher = DynamicBatcher(batches.put, max_batch_size=4, max_wait_ms=30_000)
    try:
        started = time.monotonic()
        for i in range(4):
            batcher.put(i)
        assert batches.get(timeout=10) == [0, 1, 2, 3]
        assert time.monotonic() - started < 10  # far below max_wait_ms
    finally:
        assert batcher.close() == []


def test_partial_batch_leaves_after_max_wait():
    batches = queue.Queue()
    batcher = DynamicBatcher(batches.put, max_batch_size=8, max_wait_ms=80)
    try:
        started = time.monotonic()
        batcher.put("a")
        batcher.put("b")
        assert batches.get(timeout=10) == ["a", "b"]
        assert time.monotonic() - started >= 0.075
    finally:
        batcher.close()


def test_waiting_behind_a_busy_worker_does_not_count_as_batching_wait():
    release = threading.Event()
    batches = queue.Queue()

    def handler(batch):
        batches.put(batch)
        if batch == ["a"]:
            release.wait(10)

    batcher = DynamicBatcher(handler, max_batch_size=4, max_wait_ms=300, max_inflight_batches=1)
    try:
        batcher.put("a")
        assert batches.get(timeout=10) == ["a"]  # the only worker is now busy
        batcher.put("b")
        batcher.put("c")
        time.sleep(0.4)  # b and c have waited longer than max_wait_ms, behind a busy worker
        release.set()
        batcher.put("d")  # arrives just after the worker frees up: joins b and c
        assert batches.get(timeout=10) == ["b", "c", "d"]
    finally:
        release.set()
        batcher.close()


def test_hold_keeps_a_small_batch_for_more_requests():
    """With a hold, a lone request waits for a second (instead of leaving alone at once), and the
    batch leaves as soon as ``hold_below`` requests wait, not at the end of the hold."""
    batches = queue.Queue()
    batcher = DynamicBatcher(batches.put, max_batch_size=8, max_wait_ms=0, hold_ms=30_000, hold_below=3)
    try:
        started = time.monotonic()
        batcher.put("a")
        batcher.put("b")
        time.sleep(0.2)
        assert batches.empty()  # two are fewer than hold_below: held
        batcher.put("c")
        assert batches.get(timeout=10) == ["a", "b", "c"]
        assert time.monotonic() - started < 20  # far below hold_ms
    finally:
        batcher.close()


def test_hold_ends_after_hold_ms():
    batches = queue.Queue()
    batcher = DynamicBatcher(batches.put, max_batch_size=8, max_wait_ms=0, hold_ms=150)
    try:
        started = time.monotonic()
        batcher.put("a")
        assert batches.get(timeout=10) == ["a"]  # alone after the hold: it never waits for ever
        assert time.monotonic() - started >= 0.145
    finally:
        batcher.close()


def test_priority_then_arrival_order():
    release = threading.Event()
    batches = queue.Queue()

    def handler(batch):
        batches.put(batch)
        release.wait(10)

    batcher = DynamicBatcher(handler, max_batch_size=3, max_wait_ms=1, max_inflight_batches=1)
    try:
        batcher.put("blocker")
        assert batches.get(timeout=10) == ["blocker"]  # the only worker is now busy
        for item, priority in [("low-1", 0), ("high-1", 5), ("low-2", 0), ("high-2", 5), ("mid", 1)]:
            batcher.put(item, priority=priority)
        release.set()
        assert batches.get(timeout=10) == ["high-1", "high-2", "mid"]
        assert batches.get(timeout=10) == ["low-1", "low-2"]
    finally:
        release.set()
        batcher.close()


def test_inflight_batches_run_concurrently():
    active, peak, lock = [0], [0], threading.Lock()
    done = queue.Queue()

    def handler(batch):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.2)
        with lock:
            active[0] -= 1
        done.put(batch)

    batcher = DynamicBatcher(handler, max_batch_size=1, max_wait_ms=0, max_inflight_batches=3)
    try:
        for i in range(6):
            batcher.put(i)
        assert sorted(done.get(timeout=10)[0] for _ in range(6)) == list(range(6))
        assert peak[0] == 3
    finally:
        batcher.close()


def test_drop_if_skips_items_when_forming_a_batch():
    batches = queue.Queue()
    batcher = DynamicBatcher(batches.put, max_batch_size=4, max_wait_ms=1, drop_if=lambda item: item < 0)
    try:
        for item in [1, -1, 2, -2]:
            batcher.put(item)
        got = []
        while len(got) < 2:
            got += batches.get(timeout=10)
        assert got == [1, 2]
        assert batcher.stats()["dropped_before_dispatch"] == 2
    finally:
        batcher.close()


def test_a_raising_handler_does_not_kill_the_worker():
    batches = queue.Queue()

    def handler(batch):
        if batch == ["bad"]:
            raise RuntimeError("handler bug")
        batches.put(batch)

    batcher = DynamicBatcher(handler, max_batch_size=1, max_wait_ms=0)
    try:
        batcher.put("bad")
        batcher.put("good")
        assert batches.get(timeout=10) == ["good"]
        assert batcher.stats()["handler_errors"] == 1
    finally:
        batcher.close()


def test_close_returns_pending_items_and_refuses_new_ones():
    release = threading.Event()
    batcher = DynamicBatcher(lambda batch: release.wait(10), max_batch_size=1, max_wait_ms=0)
    batcher.put("running")
    time.sleep(0.1)
    batcher.put("pending-1")
    batcher.put("pending-2")
    release.set()
    leftover = batcher.close()
    assert set(leftover) <= {"pending-1", "pending-2"}
    with pytest.raises(PolicyClosedError):
        batcher.put("late")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_wait_ms": -1}, "max_wait_ms"),
        ({"max_inflight_batches": 0}, "max_inflight_batches"),
        ({"fit_window": 1}, "fit_window"),
        ({"hold_ms": -1}, "hold_ms"),
        ({"hold_below": 0}, "hold_below"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DynamicBatcher(lambda batch: None, **kwargs)


def test_fit_batch_cost_recovers_a_and_b():
    sizes = [1, 2, 4, 8, 16, 32]
    a, b = fit_batch_cost(sizes, [0.05 + 0.001 * size for size in sizes])
    assert a == pytest.approx(0.05, abs=1e-9) and b == pytest.approx(0.001, abs=1e-9)
    assert fit_batch_cost([4, 4], [0.1, 0.2]) == pytest.approx((0.15, 0.0))
    assert fit_batch_cost([], []) == (0.0, 0.0)


def test_adaptive_threshold_rule():
    # B >= 1.25 λ a / (k - 1.25 λ b): λ=200/s, a=50 ms, b=1 ms, k=1 -> 16.7 -> 17
    assert adaptive_threshold(200.0, 0.05, 0.001, 1, 64) == 17
    assert adaptive_threshold(200.0, 0.05, 0.001, 2, 64) == 8  # 12.5 / 1.75 = 7.1: two in flight need half
    assert adaptive_threshold(0.0, 0.05, 0.001, 1, 64) == 1  # no traffic: do not wait
    assert adaptive_threshold(2000.0, 0.05, 0.001, 1, 64) == 64  # cannot keep up: biggest batch
    assert adaptive_threshold(5.0, 0.0, 0.001, 1, 64) == 1  # no fixed cost: batching gains nothing


def test_adaptive_mode_measures_backend_costs():
    a_s, b_s = 0.030, 0.002
    done = queue.Queue()

    def handler(batch):
        time.sleep(a_s + b_s * len(batch))
        done.put(len(batch))

    batcher = DynamicBatcher(handler, max_batch_size=32, max_wait_ms=1, adaptive=True)
    try:
        assert batcher.fitted_cost() is None
        for size in [1, 16, 2, 12, 4, 8, 1, 16, 3, 10]:
            for i in range(size):
                batcher.put(i)
            served = 0
            while served < size:
                served += done.get(timeout=10)
        a_fit, b_fit = batcher.fitted_cost()
        # sleep overshoot on a loaded machine adds a roughly constant delay: generous bounds
        assert 0.020 <= a_fit <= 0.080, a_fit
        assert 0.0008 <= b_fit <= 0.0045, b_fit
        stats = batcher.stats()
        assert stats["fit_a_ms"] == pytest.approx(a_fit * 1000)
        assert 1 <= stats["batch_threshold"] <= 32
    finally:
        batcher.close()
