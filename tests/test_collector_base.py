"""BackgroundCollector, the loop every collector stands on: one start, one stop, one error type."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from asyncvec import CollectorError
from asyncvec.collection import BackgroundCollector
from asyncvec.lm.groups import GroupCollector


class Looper(BackgroundCollector):
    """Counts passes; raises ``error`` on pass ``fail_at``; ignores stop while ``stubborn`` is set."""

    def __init__(self, fail_at: int | None = None, error: BaseException | None = None) -> None:
        super().__init__()
        self.passes, self.fail_at, self.error = 0, fail_at, error
        self.stubborn = threading.Event()
        self.failures = self.endings = 0

    def _loop(self) -> None:
        while not self._stopping.wait(0.001) or self.stubborn.is_set():
            self.passes += 1
            if self.passes == self.fail_at:
                raise self.error

    def _on_failure(self) -> None:
        self.failures += 1

    def _loop_ended(self) -> None:
        self.endings += 1


def test_a_loop_error_is_a_collector_error_with_the_original_chained():
    collector = Looper(fail_at=3, error=KeyError("boom"))
    collector._start_thread()
    collector._thread.join(10)
    assert not collector.running
    with pytest.raises(CollectorError, match="the collector stopped: KeyError: 'boom'") as raised:
        collector.check()
    assert isinstance(raised.value.__cause__, KeyError) and isinstance(raised.value, RuntimeError)
    assert (collector.failures, collector.endings) == (1, 1)
    collector.stop()  # after a failure: nothing left to join, no error


def test_a_second_start_is_refused_and_stop_ends_the_thread():
    with Looper() as collector:
        collector._start_thread()
        assert collector.running
        with pytest.raises(CollectorError, match="Looper already started"):
            collector._start_thread()
    assert not collector.running and collector.endings == 1
    collector.check()  # a clean stop is no error


def test_a_thread_that_does_not_stop_is_a_collector_error():
    collector = Looper()
    collector.stubborn.set()
    collector._start_thread()
    try:
        with pytest.raises(CollectorError, match=r"the Looper thread did not stop within 0.05 s"):
            collector.stop(timeout=0.05)
    finally:
        collector.stubborn.clear()
        collector.stop()
    assert not collector.running


def test_errors_after_stop_are_not_recorded_and_the_first_error_wins():
    collector = Looper()
    collector._fail(ValueError("first"))
    collector._fail(ValueError("second"))
    with pytest.raises(CollectorError, match="first") as raised:
        collector.check()
    assert str(raised.value.__cause__) == "first" and collector.failures == 1
    stopped = Looper()
    stopped.stop()
    stopped._fail(ValueError("abandoned work"))
    stopped.check()


def test_stop_frees_the_condition_an_interrupt_left_held():
    collector = Looper()
    collector._start_thread()
    collector._cond.acquire()  # what a Ctrl-C landing in `with collector._cond:` leaves behind
    collector._cond.acquire()
    collector.stop(timeout=10)
    taken = []
    other = threading.Thread(target=lambda: taken.append(collector._cond.acquire(timeout=5)))
    other.start()
    other.join()
    assert taken == [True]  # another thread can take it: released as many times as it was held


class _FailingPolicy:
    def submit_group(self, prompt, k):
        futures = [Future() for _ in range(k)]
        for future in futures:
            future.set_exception(OSError("engine down"))
        return futures

    def stats(self):
        return {}


class _NoRewards:
    def stats(self):
        return {}


def test_group_collector_errors_are_collector_errors():
    with GroupCollector(_FailingPolicy(), _NoRewards(), ["1+1="] * 4, group_size=2) as collector:
        with pytest.raises(CollectorError, match="generation failed: OSError: engine down"):
            collector.collect(1, timeout=10)
        with pytest.raises(CollectorError, match="already started"):
            collector.start(4, ahead=1).start(4, ahead=1)
