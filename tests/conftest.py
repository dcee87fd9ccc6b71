import glob
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# multiprocessing's long-lived helpers, shared by the whole test session: not leaks.
_HELPERS = ("resource_tracker", "forkserver")


def live_children() -> set[int]:
    """Pids of this process's live (non-zombie) children, multiprocessing helpers excluded."""
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(path) as f:
            pids.update(int(p) for p in f.read().split())
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if state != "Z" and not any(h in cmdline for h in _HELPERS):
            alive.add(pid)
    return alive


@pytest.fixture
def no_leftover_children():
    """Fails the test if it leaves a child process alive (waits up to 5 s for exits)."""
    before = live_children()
    yield
    deadline = time.monotonic() + 5
    while live_children() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = live_children() - before
    assert not left, f"child processes left alive: {left}"


@pytest.fixture
def one_torch_thread():
    """Torch on one thread for the test (restored after): on a loaded 2-core machine more threads spin."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
