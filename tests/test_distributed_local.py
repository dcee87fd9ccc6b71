"""`RayCollectors` with no cluster to join: it starts a local Ray, and `close()` leaves none of
the processes it started (Ray's own, the collector actors, their env workers). Runs in a fresh
interpreter so that no other Ray is initialized there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = textwrap.dedent(
    """
    import functools, json, os, time
    import gymnasium as gym, ray, torch
    from asyncvec.distributed import DistributedCollector, RayCollectors
    from asyncvec.inference import TorchPolicy

    def descendants(pid):
        found, todo = set(), [pid]
        while todo:
            parent = todo.pop()
            for path in os.listdir(f"/proc/{parent}/task"):
                try:
                    with open(f"/proc/{parent}/task/{path}/children") as f:
                        kids = [int(p) for p in f.read().split()]
                except OSError:
                    continue
                todo += [k for k in kids if k not in found]
                found.update(kids)
        return found

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    collectors = RayCollectors([functools.partial(gym.make, "CartPole-v1")] * 2, num_collectors=1,
                               actor_options={"num_cpus": 0})
    started = ray.is_initialized()
    batches = []
    policy_fn = functools.partial(TorchPolicy, torch.nn.Linear(4, 2), gym.spaces.Discrete(2))
    with DistributedCollector(collectors, policy_fn, batches.append):
        while sum(len(b.env_id) for b in batches) < 50:
            time.sleep(0.05)
    info = collectors.describe()[0]
    ours = descendants(os.getpid())
    collectors.close()
    deadline = time.monotonic() + 30
    while [p for p in ours if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    print(json.dumps({
        "started": started, "shut_down": not ray.is_initialized(), "processes": len(ours),
        "collector_was_ours": info["pid"] in ours and set(info["env_pids"]) <= ours,
        "left": sorted(p for p in ours if alive(p)),
    }))
    """
)


def test_a_local_ray_started_by_the_collectors_is_gone_after_close(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["started"] and report["shut_down"]
    assert report["collector_was_ours"] and report["processes"] >= 5  # Ray's daemons, the actor, 2 env workers
    assert report["left"] == [], f"processes left alive after close(): {report['left']}"
