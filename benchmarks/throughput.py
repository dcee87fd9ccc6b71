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
    seconds: float = 4.0
    """wall-clock budget per contender and scenario"""
    quick: bool = False
    """short run (1.5 s per contender), for `make demo`"""
    scenarios: tuple[str, ...] = ("cartpole", "slow-heavy-tail")
    """which scenarios to run"""


def make_cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def make_slow_cartpole(latency_ms: float, sigma: float) -> gym.Env:
    return SlowEnv(gym.make("CartPole-v1"), latency_ms=latency_ms, distribution="lognormal", sigma=sigma)


def lockstep_rate(envs, seconds: float) -> float:
    """Steps/s of ``envs.step`` with random actions."""
    envs.reset(seed=0)
    envs.action_space.seed(0)
    for _ in range(5):
        envs.step(envs.action_space.sample())
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        envs.step(envs.action_space.sample())
        steps += envs.num_envs
    return steps / (time.perf_counter() - start)


def partial_batch_rate(envs: AsyncLLMVectorEnv, seconds: float) -> float:
    """Steps/s of the send/recv loop: act on whichever ``batch_size`` envs are ready."""
    rng = np.random.default_rng(0)
    n_actions = envs.single_action_space.n
    envs.async_reset(seed=0)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        _, _, _, _, info = envs.recv()
        ids = info["env_id"]
        envs.send(rng.integers(0, n_actions, size=len(ids)), ids)
        steps += len(ids)
    elapsed = time.perf_counter() - start
    while envs.in_flight:  # drain before close
        envs.recv()
    return steps / elapsed


def run_scenario(name: str, env_fn: Callable[[], gym.Env], num_envs: int, batch_size: int, seconds: float, bound: float | None):
    fns = [env_fn] * num_envs
    contenders: list[tuple[str, Callable[[], object], Callable]] = [
        ("gymnasium SyncVectorEnv", lambda: SyncVectorEnv(fns), lockstep_rate),
        ("gymnasium AsyncVectorEnv", lambda: AsyncVectorEnv(fns), lockstep_rate),
        ("AsyncLLMVectorEnv step()", lambda: AsyncLLMVectorEnv(fns), lockstep_rate),
        (
            f"AsyncLLMVectorEnv send/recv (batch {batch_size})",
            lambda: AsyncLLMVectorEnv(fns, batch_size=batch_size),
            partial_batch_rate,
        ),
    ]
    rows = []
    for label, make, measure in contenders:
        envs = make()
        try:
            rows.append((label, measure(envs, seconds)))
        finally:
            envs.close()
    reference = rows[1][1]
    print(f"\n### {name}: {num_envs} envs" + (f", physical bound {bound:,.0f} steps/s" if bound else ""))
    print(f"| contender | env-steps/s | vs gymnasium Async |" + (" vs bound |" if bound else ""))
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
