"""Replay buffer throughput: asyncvec.ReplayBuffer against stable-baselines3's, side by side.

Measures add and sample throughput (transitions per second) for CartPole-sized
observations (4 float32) and Atari-sized ones (84x84x3 uint8), in one run, and prints a
table with ratios. asyncvec validates every added batch against the spaces and stamps
versions; SB3 does neither, and its sample() also copies the batch into torch tensors,
so a "+torch" row converts asyncvec's numpy batch the same way. "max_staleness" samples
with a staleness filter that excludes half the versions; "on disk" uses memmaps with a
crash-safe commit after every add (or every 100 adds).

Run:
    python benchmarks/buffer.py            # full run
    python benchmarks/buffer.py --quick    # a few seconds
"""

from __future__ import annotations

import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import tyro
from gymnasium import spaces
from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer

from asyncvec.buffers import ReplayBuffer


@dataclass
class Args:
    """Replay buffer benchmark."""

    quick: bool = False
    """fewer iterations, smaller buffers (a smoke run)"""
    num_envs: int = 8
    """transitions per add call (one vector-env step)"""
    batch_size: int = 256
    """transitions per sample call"""
    repeats: int = 3
    """timed repetitions per measurement; the median is reported"""
    seed: int = 0
    """seed of the generated data and of sampling"""


@dataclass
class Case:
    name: str
    observation_space: spaces.Box
    action_space: spaces.Discrete
    capacity: int
    adds: int  # add calls per timed repetition
    samples: int  # sample calls per timed repetition


def median_rate(run: Callable[[], int], repeats: int) -> float:
    """Median transitions per second over ``repeats`` runs of ``run`` (returns transitions)."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        transitions = run()
        rates.append(transitions / (time.perf_counter() - start))
    return statistics.median(rates)


def make_batches(case: Case, num_envs: int, rng: np.random.Generator, count: int = 16) -> list[dict]:
    low, high = case.observation_space.low, case.observation_space.high
    dtype = case.observation_space.dtype
    batches = []
    for _ in range(count):
        if np.issubdtype(dtype, np.integer):
            obs = rng.integers(low.min(), int(high.max()) + 1, (num_envs, *case.observation_space.shape), dtype=dtype)
        else:
            obs = rng.uniform(-1, 1, (num_envs, *case.observation_space.shape)).astype(dtype)
        batches.append(
            {
                "obs": obs,
                "next_obs": obs[::-1].copy(),
                "action": rng.integers(0, case.action_space.n, num_envs),
                "reward": rng.normal(size=num_envs).astype(np.float32),
                "done": rng.random(num_envs) < 0.01,
            }
        )
    return batches


def bench_asyncvec(case: Case, args: Args, batches: list[dict], variant: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as directory:
        buffer = ReplayBuffer(
            case.capacity,
            case.observation_space,
            case.action_space,
            prioritized=variant == "prioritized",
            storage_dir=directory if variant.startswith("on disk") else None,
            commit_every=100 if variant == "on disk, commit/100" else 1,
            seed=args.seed,
        )
        step = [0]
        zeros = np.zeros(args.num_envs, dtype=bool)

        def add() -> int:
            for _ in range(case.adds):
                batch = batches[step[0] % len(batches)]
                buffer.add(
                    batch["obs"],
                    batch["action"],
                    batch["reward"],
                    batch["next_obs"],
                    batch["done"],
                    zeros,
                    policy_version=step[0] // 100,
                )
                step[0] += 1
            return case.adds * args.num_envs

        while len(buffer) < case.capacity:  # fill before timing samples from a full ring
            add()
        add_rate = median_rate(add, args.repeats)
        current = step[0] // 100
        max_staleness = current // 2 if variant == "max_staleness" else None
        rng = np.random.default_rng(args.seed)

        def sample() -> int:
            for _ in range(case.samples):
                batch = buffer.sample(args.batch_size, current, max_staleness=max_staleness, rng=rng)
                if variant == "+torch":
                    tensors = [
                        torch.tensor(x)
                        for x in (batch.obs, batch.action, batch.next_obs, batch.reward, batch.terminated)
                    ]
                    assert len(tensors) == 5
            return case.samples * args.batch_size

        sample_rate = median_rate(sample, args.repeats)
        buffer.close()
    return add_rate, sample_rate


def bench_sb3(case: Case, args: Args, batches: list[dict]) -> tuple[float, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SB3 warns about buffer sizes vs. free memory
        buffer = SB3ReplayBuffer(
            case.capacity, case.observation_space, case.action_space, device="cpu", n_envs=args.num_envs
        )
    infos = [{} for _ in range(args.num_envs)]
    step = [0]

    def add() -> int:
        for _ in range(case.adds):
            batch = batches[step[0] % len(batches)]
            buffer.add(batch["obs"], batch["next_obs"], batch["action"], batch["reward"], batch["done"], infos)
            step[0] += 1
        return case.adds * args.num_envs

    while not buffer.full:
        add()
    add_rate = median_rate(add, args.repeats)

    def sample() -> int:
        for _ in range(case.samples):
            buffer.sample(args.batch_size)
        return case.samples * args.batch_size

    np.random.seed(args.seed)  # SB3 samples with the global numpy generator
    return add_rate, median_rate(sample, args.repeats)


def main(args: Args) -> None:
    torch.set_num_threads(1)
    scale = 10 if args.quick else 1
    cases = [
        Case(
            "CartPole (4 x float32)",
            spaces.Box(-np.inf, np.inf, (4,), np.float32),
            spaces.Discrete(2),
            100_000 // scale,
            2_000 // scale,
            400 // scale,
        ),
        Case(
            "Atari (84x84x3 uint8)",
            spaces.Box(0, 255, (84, 84, 3), np.uint8),
            spaces.Discrete(6),
            10_000 // scale,
            500 // scale,
            40 // scale,
        ),
    ]
    rng = np.random.default_rng(args.seed)
    rows = []
    for case in cases:
        batches = make_batches(case, args.num_envs, rng)
        sb3_add, sb3_sample = bench_sb3(case, args, batches)
        for variant in ("uniform", "+torch", "max_staleness", "prioritized", "on disk", "on disk, commit/100"):
            ours_add, ours_sample = bench_asyncvec(case, args, batches, variant)
            if variant not in ("+torch", "max_staleness"):  # these change sampling only
                rows.append((case.name, variant, "add", ours_add, sb3_add))
            rows.append((case.name, variant, "sample", ours_sample, sb3_sample))
        print(f"done: {case.name}", flush=True)
    print(
        f"\nnum_envs={args.num_envs} per add, batch_size={args.batch_size} per sample, "
        f"median of {args.repeats}; transitions/s\n"
    )
    header = f"{'observations':<24}{'asyncvec variant':<22}{'op':<8}{'asyncvec':>12}{'sb3':>12}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    for name, variant, op, ours, theirs in rows:
        print(f"{name:<24}{variant:<22}{op:<8}{ours:>12,.0f}{theirs:>12,.0f}{ours / theirs:>8.2f}")


if __name__ == "__main__":
    main(tyro.cli(Args))
