"""`make test`'s lane of fresh interpreters: with ``--fresh-interpreter-lane`` the modules of
``FRESH_INTERPRETER_MODULES`` (tests/conftest.py says why they need it) are not collected in the
xdist workers; this test runs them one after another, each in its own ``python -m pytest``, while
the other worker runs the rest of the suite. Before, they ran one after another before the xdist
run, with the second core mostly idle.

Each module's whole output goes to ``.test-logs/<module>.log``; a failure shows its tail. Without
the option the modules are collected as usual and this test is skipped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import FRESH_INTERPRETER_MODULES, ROOT, lane_log

MODULE_TIMEOUT_S = 1800  # each module's tests carry their own (tighter) pytest-timeout marks
TAIL_CHARS = 6000

pytestmark = pytest.mark.timeout(MODULE_TIMEOUT_S * len(FRESH_INTERPRETER_MODULES))


class Terminated(Exception):
    """SIGTERM reached the process running the lane."""


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM raises ``Terminated`` in the main thread while this is open, so that the ``finally``
    killing a module's process group runs (by default SIGTERM ends the process at once, and the
    module's pytest, in its own session, would go on running)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_module(module: str, timeout_s: float = MODULE_TIMEOUT_S) -> tuple[int, str]:
    """``python -m pytest module`` from the repository root: (exit code, output). The module's
    process group is killed on timeout, Ctrl-C or SIGTERM, so nothing it started is left behind."""
    with sigterm_raises():
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", module, "-p", "no:cacheprovider", "--durations=10"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            output += f"\n[killed after {timeout_s} s]"
        finally:
            if proc.poll() is None:  # interrupted (Ctrl-C, SIGTERM, the lane's own timeout): leave nothing behind
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode, output


def test_the_modules_that_need_a_fresh_interpreter_pass(request):
    if not request.config.getoption("fresh_interpreter_lane"):
        pytest.skip("without --fresh-interpreter-lane these modules are collected as usual")
    failures = []
    for module in FRESH_INTERPRETER_MODULES:
        code, output = run_module(module)
        log = lane_log(module)
        log.parent.mkdir(exist_ok=True)
        log.write_text(output)  # conftest's terminal summary prints its last line
        if code != 0:
            failures.append(f"{module} exited {code} (whole output: {log}):\n{output[-TAIL_CHARS:]}")
    assert not failures, "\n\n".join(failures)


SLEEPING_MODULE = """
import os, time
from pathlib import Path

def test_sleeps():
    Path({pid_file!r}).write_text(str(os.getpid()))
    time.sleep(600)
"""


def sleeping_module(tmp_path) -> tuple[str, os.PathLike]:
    """A test module whose one test writes its pid to a file and sleeps for 10 minutes."""
    pid_file = tmp_path / "pid"
    module = tmp_path / "test_sleeping.py"
    module.write_text(SLEEPING_MODULE.format(pid_file=str(pid_file)))
    return str(module), pid_file


def wait_for(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_module_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    module, pid_file = sleeping_module(tmp_path)
    code, output = run_module(module, timeout_s=15)
    assert code == -signal.SIGKILL and "[killed after 15 s]" in output, (code, output)
    if pid_file.exists():  # the test had started (pytest's start-up can take most of 15 s on a loaded machine)
        wait_for(lambda: not process_exists(int(pid_file.read_text())), timeout_s=10)


def test_sigterm_to_the_lane_kills_the_running_module(tmp_path):
    module, pid_file = sleeping_module(tmp_path)
    lane = subprocess.Popen(
        [sys.executable, "-c", f"import test_fresh_interpreter_lane as lane; lane.run_module({module!r})"],
        cwd=ROOT / "tests", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text() != "" or lane.poll() is not None)
        assert lane.poll() is None, lane.communicate()[0]
        sleeper = int(pid_file.read_text())
        lane.send_signal(signal.SIGTERM)
        output, _ = lane.communicate(timeout=60)
        assert "Terminated" in output, output  # raised by the handler, after the finally killed the module
        wait_for(lambda: not process_exists(sleeper), timeout_s=10)
    finally:
        if lane.poll() is None:
            lane.kill()
            lane.wait()
