import glob
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# One OpenMP thread in everything the tests start (vLLM servers and engines, lane and docs
# subprocesses), unless set: on 2 cores shared by two test workers more threads only spin. A vLLM
# server (tiny model, 8 prompts x 6 tokens per request) answered 352 requests in 30 s on 13.1 s
# of CPU with it, 246 requests on 24.3 s without; tests/test_lm_agents_vllm.py alone took 249 s
# wall, 314 s CPU with it, 266 s and 376 s without.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# multiprocessing's long-lived helpers, shared by the whole test session: not leaks.
_HELPERS = ("resource_tracker", "forkserver")


def live_children() -> set[int]:
    """Pids of this process's live (non-zombie) children, multiprocessing helpers excluded."""
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                pids.update(int(p) for p in f.read().split())
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
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


# Modules that must start in a fresh interpreter, one at a time: an in-process vLLM engine started next to another
# engine, or in a worker that had run other modules, crawled on 2 cores until tests timed out. The HF FrozenLake
# learning test too: inside an xdist worker it failed 2 of 2 full runs (held-out success back at the warm start's
# level after the training reward reached 0.9); alone it passed every time. With --fresh-interpreter-lane (`make
# test`) they are not collected here: tests/test_fresh_interpreter_lane.py runs them, each in its own `python -m
# pytest`, while the other xdist workers run the rest of the suite.
FRESH_INTERPRETER_MODULES = (
    "tests/test_lm_agents_vllm.py",
    "tests/test_multiturn_learning.py",
    "tests/test_vllm_policy.py",
    "tests/test_vla_vllm.py",
    "tests/test_inflight_updates_vllm.py",
    "tests/test_vllm_continuous.py",
    "tests/test_benchmarks_inflight.py",  # --quick starts in-process vLLM engines (the benchmark's default backend)
    # A local Ray started in a worker that had already started and stopped Ray for other modules hung in its first
    # actor creation (GCS InternalKVAccessor::Put never answered; seen in two `make test` runs on 2026-12-03); alone
    # the module passes in 20 s.
    "tests/test_vector_timeouts.py",
)
ROOT = Path(__file__).resolve().parents[1]


def lane_log(module: str) -> Path:
    """Where the lane writes ``module``'s whole output."""
    return ROOT / ".test-logs" / f"{Path(module).stem}.log"


def pytest_addoption(parser):
    parser.addoption(
        "--fresh-interpreter-lane",
        action="store_true",
        help="run FRESH_INTERPRETER_MODULES (tests/conftest.py) one after another in fresh interpreters, "
        "as one unit of the xdist run (tests/test_fresh_interpreter_lane.py), instead of collecting them",
    )


def pytest_sessionstart(session):
    session.config._started_at = time.time()


def pytest_terminal_summary(terminalreporter, config):
    """After a run with the lane: each module's result line, from its log (written by the worker)."""
    if not config.getoption("fresh_interpreter_lane"):
        return
    logs = [lane_log(module) for module in FRESH_INTERPRETER_MODULES]
    fresh = [log for log in logs if log.exists() and log.stat().st_mtime >= config._started_at]
    if fresh:
        terminalreporter.section("fresh-interpreter lane (whole outputs in .test-logs/)")
        for log in fresh:
            lines = log.read_text().strip().splitlines() or ["(no output)"]
            terminalreporter.write_line(f"{log.stem}: {lines[-1].strip('= ')}")


def pytest_ignore_collect(collection_path, config):
    if config.getoption("fresh_interpreter_lane"):
        return os.path.relpath(str(collection_path), ROOT) in FRESH_INTERPRETER_MODULES or None
    return None


# Seconds each test module (each docs page) took in `make test` on 2 loaded cores. `make test` runs
# the suite on several xdist workers (--dist loadfile --no-loadscope-reorder): one work unit per
# module, so a module's engine or cluster starts once, except tests/test_docs.py, one unit per page;
# the heaviest units go first so that no long module starts last. Unlisted units take seconds.
HEAVY_UNITS = {
    # `make test`: FRESH_INTERPRETER_MODULES, one after another (they also go first without the lane).
    "tests/test_fresh_interpreter_lane.py": 2000,
    "tests/test_vllm_policy.py": 1000,
    "tests/test_lm_agents_vllm.py": 550,
    "tests/test_learning.py": 330,
    "tests/test_lm_agents.py": 320,
    "tests/test_guess_number_learning.py": 330,
    "tests/test_multiturn_learning.py": 150,
    "tests/test_multiturn.py": 100,
    "tests/test_docs.py::test_doc_blocks_run[docs/lm_agents.md]": 220,
    "tests/test_docs.py::test_doc_blocks_run[README.md]": 215,
    "tests/test_ray_env.py": 220,
    "tests/test_vector_timeouts.py": 150,  # every split-phase call on processes and on a local Ray
    "tests/test_ppo_chunks.py": 60,  # PPO on chunks from a warm start
    "tests/test_docs.py::test_doc_blocks_run[docs/robots.md]": 40,
    "tests/test_docs.py::test_doc_blocks_run[docs/inference.md]": 140,
    "tests/test_vllm_server.py": 135,
    "tests/test_docs.py::test_doc_blocks_run[docs/integrations.md]": 135,
    "tests/test_distributed_collect.py": 130,
    "tests/test_supervisor.py": 150,  # asyncvec serve killed, stopped and restarted; a vLLM server killed (two starts)
    "tests/test_inflight_updates.py": 30,
    "tests/test_integrations_gymnasium.py": 110,
    "tests/test_agents_cli.py": 130,  # the agents' CLIs in subprocesses, on a user's package
    "tests/test_extras.py": 115,  # fresh interpreters without an extra; asyncvec serve and Ctrl-C
    "tests/test_distributed_router.py": 75,
    "tests/test_integrations_tianshou.py": 65,
    "tests/test_vector_faults.py": 45,
    "tests/test_agents.py": 40,
}


def work_unit(nodeid: str) -> str:
    """What one xdist worker runs as a whole: a test module, or one page of tests/test_docs.py."""
    module = nodeid.split("::")[0]
    return nodeid if module == "tests/test_docs.py" else module


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -HEAVY_UNITS.get(work_unit(item.nodeid), 0))  # stable: order kept within a unit


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with tests/test_docs.py split by page (xdist's loadgroup ignores marks here)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ModuleScheduling(config, log)
