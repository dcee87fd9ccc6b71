"""`make test`'s lane of fresh interpreters: with ``--fresh-interpreter-lane`` the modules of
``FRESH_INTERPRETER_MODULES`` (tests/conftest.py says why they need it) are not collected in the
xdist workers; this test runs them one after another, each in its own ``python -m pytest``, while
the other worker runs the rest of the suite. Before, they ran one after another before the xdist
run, with the second core mostly idle.

Each module's whole output goes to ``.test-logs/<module>.log``; a failure shows its tail. Without
the option the modules are collected as usual and this test is skipped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import FRESH_INTERPRETER_MODULES, ROOT, lane_log

MODULE_TIMEOUT_S = 1800  # each module's tests carry their own (tighter) pytest-timeout marks
TAIL_CHARS = 6000

pytestmark = pytest.mark.timeout(MODULE_TIMEOUT_S * len(FRESH_INTERPRETER_MODULES))


def run_module(module: str) -> tuple[int, str]:
    """``python -m pytest module`` from the repository root: (exit code, output)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", module, "-p", "no:cacheprovider", "--durations=10"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=MODULE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n[killed after {MODULE_TIMEOUT_S} s]"
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C, the lane's own timeout): leave nothing behind
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
