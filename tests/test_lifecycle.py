"""asyncvec.lifecycle: a command line's Ctrl-C never leaves a lock held, and a slow stop says where it waits."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
from terminal import sigint_as_in_a_terminal

from asyncvec.lifecycle import interrupts_outside_locks

# The main thread takes a condition's lock again and again (as a learner polls a buffer); each Ctrl-C is caught,
# and the child reports how often the lock was still held after it, i.e. left held for good. It says "armed" inside
# the try, so the next Ctrl-C is sent only once it would be caught (a slow child on a loaded machine was once still
# printing the last "caught", outside the try, when the next one came).
HAMMER = """
import sys, threading, time
from asyncvec.lifecycle import interrupts_outside_locks

condition = threading.Condition()
guarded = sys.argv[1] == "guarded"
interrupts = leaked = 0
with (interrupts_outside_locks() if guarded else open("/dev/null")):
    while interrupts < int(sys.argv[2]):
        try:
            print("armed", flush=True)
            while True:
                with condition:
                    pass
        except KeyboardInterrupt:
            interrupts += 1
            if condition._is_owned():
                leaked += 1
                while condition._is_owned():
                    condition.release()
print(f"interrupts {interrupts} leaked {leaked}", flush=True)
"""


def hammer(mode: str, interrupts: int) -> tuple[int, int]:
    """(interrupts caught, locks left held) of the HAMMER child sent ``interrupts`` Ctrl-Cs."""
    child = subprocess.Popen(
        [sys.executable, "-c", HAMMER, mode, str(interrupts)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    try:
        line = child.stdout.readline().strip()
        for _ in range(interrupts):
            assert line == "armed", line
            time.sleep(0.003)
            child.send_signal(signal.SIGINT)
            line = child.stdout.readline().strip()  # "armed" again, after the last one the counts
        last = line.split()
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return int(last[1]), int(last[3])


def test_a_ctrl_c_never_leaves_a_condition_held():
    caught, leaked = hammer("guarded", 100)
    assert caught == 100 and leaked == 0


def test_without_it_python_leaves_the_lock_held_sometimes():
    """The defect the handler removes, shown with Python's own handler (so the test above can fail)."""
    caught, leaked = hammer("default", 100)
    assert caught == 100 and leaked > 0


@pytest.fixture
def python_default_sigint():
    """Python's own SIGINT handler, as in a program started from a terminal (a test worker may ignore SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_inside_a_lock_window_comes_again_just_after(python_default_sigint):
    with interrupts_outside_locks():
        handler = signal.getsignal(signal.SIGINT)
        condition = threading.Condition()
        window = SimpleNamespace(f_code=threading.Condition.__enter__.__code__, f_locals={"self": condition})
        with pytest.raises(KeyboardInterrupt):
            handler(signal.SIGINT, window)  # still waiting for the lock: nothing held, raised at once
        with condition:
            handler(signal.SIGINT, window)  # the lock taken, the block not entered yet: deferred
            with pytest.raises(KeyboardInterrupt):
                time.sleep(10)  # the redelivered Ctrl-C ends the wait
        with pytest.raises(KeyboardInterrupt):
            handler(signal.SIGINT, sys._getframe())  # anywhere else: at once
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_stop_that_hangs_prints_where_each_thread_is():
    code = textwrap.dedent(
        """
        import os, signal, time
        from asyncvec.lifecycle import interrupts_outside_locks
        with interrupts_outside_locks(report_after_s=0.2):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(10)
            except KeyboardInterrupt:
                time.sleep(1.0)  # a slow cleanup
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, preexec_fn=sigint_as_in_a_terminal
    )
    assert done.returncode == 0, done.stderr
    assert "still stopping 0.2 s after Ctrl-C; where each thread is:" in done.stderr, done.stderr
    assert "most recent call first" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_handler_of_the_callers_own_is_kept():
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGINT, mine)
    try:
        with interrupts_outside_locks():
            assert signal.getsignal(signal.SIGINT) is mine
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_still_ends_a_wait_for_a_lock_that_another_thread_keeps():
    code = textwrap.dedent(
        """
        import os, signal, threading
        from asyncvec.lifecycle import interrupts_outside_locks
        condition, taken = threading.Condition(), threading.Event()
        def keep():
            with condition:
                taken.set()
                threading.Event().wait()
        threading.Thread(target=keep, daemon=True).start()
        taken.wait()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        with interrupts_outside_locks():
            try:
                with condition:
                    pass
            except KeyboardInterrupt:
                print("interrupted")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, preexec_fn=sigint_as_in_a_terminal
    )
    assert done.returncode == 0 and done.stdout.strip() == "interrupted", (done.stdout, done.stderr)
