"""Env-steps/s of gymnasium's vector envs and AsyncLLMVectorEnv, side by side in one run.

Every contender steps the same env with the same trivial policy (random actions) for the same
wall-clock budget. Scenarios:

* ``cartpole``: raw CartPole-v1, 8 envs: pure vectorization overhead.
* ``slow-heavy-tail``: CartPole behind a SlowEnv with lognormal (heavy-tailed) 10 ms sleeping
  steps, 16 envs, partial batches of 8: the case asyncvec is for. Its physical bound is
  ``num_envs / mean latency`` steps/s (every env always stepping).

Run: ``python benchmarks/throughput.py`` (``--quick`` for a short run).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import gymnasium as gym
import numpy as np
import tyro
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncvec import AsyncLLMVectorEnv  # noqa: E402
from envs.slow import SlowEnv  # noqa: E402


@dataclass
class Args:
    seconds: float = 5.0
    """wall-clock budget per contender and scenario (split into interleaved rounds)"""
    quick: bool = False
    """short run (1.5 s per contender), for `make demo`"""
    scenarios: tuple[str, ...] = ("cartpole", "slow-heavy-tail")
    """which scenarios to run"""


def make_cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def make_slow_cartpole(latency_ms: float, sigma: float) -> gym.Env:
    return SlowEnv(gym.make("CartPole-v1"), latency_ms=latency_ms, distribution="lognormal", sigma=sigma)


class LockstepLoop:
    """Steps ``envs.step`` with random actions; ``run(seconds)`` returns steps/s."""

    def __init__(self, envs) -> None:
        self.envs = envs
        envs.reset(seed=0)
        envs.action_space.seed(0)

    def run(self, seconds: float) -> float:
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            self.envs.step(self.envs.action_space.sample())
            steps += self.envs.num_envs
        return steps / (time.perf_counter() - start)


class PartialBatchLoop:
    """The send/recv loop: act on whichever ``batch_size`` envs are ready."""

    def __init__(self, envs: AsyncLLMVectorEnv) -> None:
        self.envs = envs
        self.rng = np.random.default_rng(0)
        envs.async_reset(seed=0)

    def run(self, seconds: float) -> float:
        steps, start = 0, time.perf_counter()
        n_actions = self.envs.single_action_space.n
        while time.perf_counter() - start < seconds:
            _, _, _, _, info = self.envs.recv()
            ids = info["env_id"]
            self.envs.send(self.rng.integers(0, n_actions, size=len(ids)), ids)
            steps += len(ids)
        return steps / (time.perf_counter() - start)

    def drain(self) -> None:
        while self.envs.in_flight:
            self.envs.recv()


def run_scenario(name: str, env_fn: Callable[[], gym.Env], num_envs: int, batch_size: int, seconds: float, bound: float | None, rounds: int = 5):
    """Measures every contender in ``rounds`` interleaved rounds (the machine is noisy) and reports medians."""
    fns = [env_fn] * num_envs
    contenders = {
        "gymnasium SyncVectorEnv": lambda: LockstepLoop(SyncVectorEnv(fns)),
        "gymnasium AsyncVectorEnv": lambda: LockstepLoop(AsyncVectorEnv(fns)),
        "AsyncLLMVectorEnv step()": lambda: LockstepLoop(AsyncLLMVectorEnv(fns)),
        f"AsyncLLMVectorEnv send/recv (batch {batch_size})": lambda: PartialBatchLoop(AsyncLLMVectorEnv(fns, batch_size=batch_size)),
    }
    loops = {label: make() for label, make in contenders.items()}
    samples: dict[str, list[float]] = {label: [] for label in loops}
    try:
        for label, loop in loops.items():
            loop.run(0.2)  # warm up
        for _ in range(rounds):
            for label, loop in loops.items():
                samples[label].append(loop.run(seconds / rounds))
    finally:
        for loop in loops.values():
            if isinstance(loop, PartialBatchLoop):
                loop.drain()
            loop.envs.close()
    rows = [(label, float(np.median(values))) for label, values in samples.items()]
    reference = rows[1][1]
    print(f"\n### {name}: {num_envs} envs" + (f", physical bound {bound:,.0f} steps/s" if bound else ""))
    print(f"median of {rounds} interleaved rounds of {seconds / rounds:.1f} s each")
    print("| contender | env-steps/s | vs gymnasium Async |" + (" vs bound |" if bound else ""))
    print("|---|---:|---:|" + ("---:|" if bound else ""))
    for label, rate in rows:
        line = f"| {label} | {rate:,.0f} | {rate / reference:.2f}x |"
        if bound:
            line += f" {rate / bound:.0%} |"
        print(line)
    return rows


def main(args: Args) -> dict[str, list[tuple[str, float]]]:
    seconds = 1.5 if args.quick else args.seconds
    results = {}
    if "cartpole" in args.scenarios:
        results["cartpole"] = run_scenario("raw CartPole-v1", make_cartpole, 8, 4, seconds, None)
    if "slow-heavy-tail" in args.scenarios:
        latency_ms, sigma = 10.0, 1.0
        results["slow-heavy-tail"] = run_scenario(
            f"CartPole + SlowEnv lognormal(mean {latency_ms:.0f} ms, sigma {sigma}), sleeping",
            partial(make_slow_cartpole, latency_ms, sigma),
            16,
            8,
            seconds,
            16 / (latency_ms / 1000),
        )
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
