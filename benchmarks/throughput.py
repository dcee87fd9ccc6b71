"""Env-steps/s of gymnasium's vector envs and AsyncLLMVectorEnv, side by side in one run.

Every contender steps the same env with the same trivial policy (random actions) for the same
wall-clock budget, in interleaved rounds (the machine is noisy); the table holds medians.
Scenarios:

* ``cartpole``: raw CartPole-v1, 8 envs: pure vectorization overhead. ``envs_per_worker=4``
  runs the 8 envs in 2 worker processes (one per core), one round trip per worker per step.
* ``slow-heavy-tail``: CartPole behind a SlowEnv with lognormal (heavy-tailed) 10 ms sleeping
  steps, 16 envs, partial batches of 8: the case asyncvec is for. Its physical bound is
  ``num_envs / mean latency`` steps/s (every env always stepping). Here one env per worker
  wins: envs that share a worker wait for each other's sleeps.

Run: ``python benchmarks/throughput.py`` (about 2 minutes; ``--quick`` for a short run).
Writes ``benchmarks/results/throughput.md`` and ``throughput.png``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import gymnasium as gym
import numpy as np
import tyro
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncvec import AsyncLLMVectorEnv  # noqa: E402
from benchmarks.report import machine_line, markdown_table, new_figure, save_report  # noqa: E402
from envs.slow import SlowEnv  # noqa: E402

REFERENCE = "gymnasium AsyncVectorEnv"


@dataclass
class Args:
    seconds: float = 8.0
    """wall-clock budget per contender and scenario (split into interleaved rounds)"""
    rounds: int = 8
    """interleaved rounds per contender (the table holds the median)"""
    quick: bool = False
    """short run (1.5 s per contender, 3 rounds), for `make demo` and the smoke test"""
    scenarios: tuple[str, ...] = ("cartpole", "slow-heavy-tail")
    """which scenarios to run"""
    envs_per_worker: int = 4
    """envs per worker process for the sub-vector contenders"""
    out_dir: str | None = None
    """where to write throughput.md/.png (default benchmarks/results)"""


def make_cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def make_slow_cartpole(latency_ms: float, sigma: float) -> gym.Env:
    return SlowEnv(gym.make("CartPole-v1"), latency_ms=latency_ms, distribution="lognormal", sigma=sigma)


def tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process and all its live descendants (Linux ``/proc``).

    Wall-clock rates on a shared, loaded machine depend on how many processes a contender
    runs (the scheduler shares cores per process); CPU seconds per env-step do not.
    """
    pid = os.getpid() if pid is None else pid
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
        children: set[int] = set()
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children.update(int(c) for c in f.read().split())
    except OSError:  # the process ended
        return total
    return total + sum(tree_cpu_seconds(child) for child in children)


class CpuMeter:
    """Accumulates env-steps and the CPU seconds of this process tree spent on them."""

    def __init__(self) -> None:
        self.steps = 0
        self.cpu = 0.0

    def measure(self, run: Callable[[], int]) -> int:
        start = tree_cpu_seconds()
        steps = run()
        self.cpu += tree_cpu_seconds() - start
        self.steps += steps
        return steps

    @property
    def cpu_us_per_step(self) -> float:
        return self.cpu / max(self.steps, 1) * 1e6


class LockstepLoop:
    """Steps ``envs.step`` with random actions; ``run(seconds)`` returns steps/s."""

    def __init__(self, envs) -> None:
        self.envs = envs
        self.meter = CpuMeter()
        envs.reset(seed=0)
        envs.action_space.seed(0)

    def run(self, seconds: float) -> float:
        start = time.perf_counter()

        def loop() -> int:
            steps = 0
            while time.perf_counter() - start < seconds:
                self.envs.step(self.envs.action_space.sample())
                steps += self.envs.num_envs
            return steps

        return self.meter.measure(loop) / (time.perf_counter() - start)

    def close(self) -> None:
        self.envs.close()


class PartialBatchLoop:
    """The send/recv loop: act on whichever ``batch_size`` envs are ready (Discrete actions)."""

    def __init__(self, envs: AsyncLLMVectorEnv) -> None:
        self.envs = envs
        self.rng = np.random.default_rng(0)
        self.meter = CpuMeter()
        envs.async_reset(seed=0)

    def step_once(self) -> dict:
        """One ``recv`` and the ``send`` that answers it; returns the batch's info."""
        _, _, _, _, info = self.envs.recv(timeout=120)
        ids = info["env_id"]
        self.envs.send(self.rng.integers(0, self.envs.single_action_space.n, size=len(ids)), ids)
        return info

    def run(self, seconds: float) -> float:
        start = time.perf_counter()

        def loop() -> int:
            steps = 0
            while time.perf_counter() - start < seconds:
                steps += len(self.step_once()["env_id"])
            return steps

        return self.meter.measure(loop) / (time.perf_counter() - start)

    def close(self) -> None:
        while self.envs.in_flight:
            self.envs.recv(timeout=120)
        self.envs.close()


def contenders(fns: list[Callable[[], gym.Env]], batch_size: int, envs_per_worker: int) -> dict[str, Callable]:
    k = envs_per_worker
    return {
        "gymnasium SyncVectorEnv": lambda: LockstepLoop(SyncVectorEnv(fns)),
        REFERENCE: lambda: LockstepLoop(AsyncVectorEnv(fns)),
        "AsyncLLMVectorEnv step()": lambda: LockstepLoop(AsyncLLMVectorEnv(fns)),
        f"AsyncLLMVectorEnv step(), envs_per_worker={k}": lambda: LockstepLoop(AsyncLLMVectorEnv(fns, envs_per_worker=k)),
        f"AsyncLLMVectorEnv send/recv (batch {batch_size})": lambda: PartialBatchLoop(
            AsyncLLMVectorEnv(fns, batch_size=batch_size)
        ),
        f"AsyncLLMVectorEnv send/recv (batch {batch_size}), envs_per_worker={k}": lambda: PartialBatchLoop(
            AsyncLLMVectorEnv(fns, batch_size=batch_size, envs_per_worker=k)
        ),
    }


def run_scenario(
    name: str,
    env_fn: Callable[[], gym.Env],
    num_envs: int,
    batch_size: int,
    args: Args,
    bound: float | None,
) -> list[tuple[str, float, float]]:
    """Measures every contender in interleaved rounds: ``(label, median steps/s, CPU us per env-step)``."""
    seconds = 1.5 if args.quick else args.seconds
    rounds = 3 if args.quick else args.rounds
    loops = {label: make() for label, make in contenders([env_fn] * num_envs, batch_size, args.envs_per_worker).items()}
    samples: dict[str, list[float]] = {label: [] for label in loops}
    try:
        for loop in loops.values():
            loop.run(0.2)  # warm up
            loop.meter = CpuMeter()
        for _ in range(rounds):
            for label, loop in loops.items():
                samples[label].append(loop.run(seconds / rounds))
    finally:
        for loop in loops.values():
            loop.close()
    rows = [(label, float(np.median(values)), loops[label].meter.cpu_us_per_step) for label, values in samples.items()]
    print(f"\n### {name}: {num_envs} envs" + (f", physical bound {bound:,.0f} steps/s" if bound else ""))
    print(f"median of {rounds} interleaved rounds of {seconds / rounds:.2f} s each; {machine_line()}")
    return rows


def main(args: Args) -> dict[str, list[tuple[str, float, float]]]:
    short_names = {"cartpole": "raw CartPole-v1", "slow-heavy-tail": "lognormal 10 ms sleeps"}
    scenarios = {
        "cartpole": ("raw CartPole-v1", make_cartpole, 8, 4, None),
        "slow-heavy-tail": (
            "CartPole + SlowEnv lognormal(mean 10 ms, sigma 1), sleeping",
            partial(make_slow_cartpole, 10.0, 1.0),
            16,
            8,
            16 / 0.010,
        ),
    }
    results: dict[str, list[tuple[str, float, float]]] = {}
    headers = ["scenario", "contender", "env-steps/s", "vs gymnasium Async", "vs bound", "CPU us / env-step", "CPU vs gymnasium Async"]
    table_rows = []
    for key in args.scenarios:
        name, env_fn, num_envs, batch_size, bound = scenarios[key]
        rows = run_scenario(name, env_fn, num_envs, batch_size, args, bound)
        results[key] = rows
        _, reference, reference_cpu = next(row for row in rows if row[0] == REFERENCE)
        scenario_rows = [
            [
                f"{short_names[key]} x{num_envs}",
                label,
                rate,
                f"{rate / reference:.2f}x",
                f"{rate / bound:.0%}" if bound else "-",
                cpu,
                f"{cpu / reference_cpu:.2f}x",
            ]
            for label, rate, cpu in rows
        ]
        print(markdown_table(headers, scenario_rows))
        table_rows += scenario_rows
    table = markdown_table(headers, table_rows)
    figure, axes = new_figure(ncols=len(results), width=6.5, height=4.5)
    for ax, (key, rows) in zip(np.ravel(axes), results.items()):
        reference = next(rate for label, rate, _ in rows if label == REFERENCE)
        labels = [label.replace("AsyncLLMVectorEnv ", "ours ").replace("gymnasium ", "gym ") for label, _, _ in rows]
        ax.barh(labels[::-1], [rate / reference for _, rate, _ in rows][::-1], color="tab:blue")
        ax.axvline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel("env-steps/s relative to gymnasium AsyncVectorEnv")
        ax.set_title(f"{short_names[key]} x{scenarios[key][2]}", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    command = " ".join(["python benchmarks/throughput.py", *sys.argv[1:]])
    save_report("throughput", table, figure, out_dir=args.out_dir, command=command)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
