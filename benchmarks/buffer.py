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
    repeats: int = 5
    """timed repetitions per measurement, alternating asyncvec and sb3; medians are reported"""
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


def rate(run: Callable[[], int]) -> float:
    """Transitions per second of one call of ``run`` (which returns its transition count)."""
    start = time.perf_counter()
    transitions = run()
    return transitions / (time.perf_counter() - start)


def paired(ours: Callable[[], int], theirs: Callable[[], int], repeats: int) -> tuple[float, float, float]:
    """Alternate the two runs ``repeats`` times; median rates and median of paired ratios.

    Pairing adjacent runs keeps the ratio meaningful on a machine whose load drifts.
    """
    pairs = [(rate(ours), rate(theirs)) for _ in range(repeats)]
    return (
        statistics.median(a for a, _ in pairs),
        statistics.median(b for _, b in pairs),
        statistics.median(a / b for a, b in pairs),
    )


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


class SB3Side:
    """stable-baselines3's ReplayBuffer, filled once per observation case."""

    def __init__(self, case: Case, args: Args, batches: list[dict]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SB3 warns about buffer sizes vs. free memory
            self.buffer = SB3ReplayBuffer(
                case.capacity, case.observation_space, case.action_space, device="cpu", n_envs=args.num_envs
            )
        self.case, self.args, self.batches = case, args, batches
        self.infos = [{} for _ in range(args.num_envs)]
        self.step = 0
        while not self.buffer.full:
            self.add()
        np.random.seed(args.seed)  # SB3 samples with the global numpy generator

    def add(self) -> int:
        for _ in range(self.case.adds):
            batch = self.batches[self.step % len(self.batches)]
            self.buffer.add(
                batch["obs"], batch["next_obs"], batch["action"], batch["reward"], batch["done"], self.infos
            )
            self.step += 1
        return self.case.adds * self.args.num_envs

    def sample(self) -> int:
        for _ in range(self.case.samples):
            self.buffer.sample(self.args.batch_size)
        return self.case.samples * self.args.batch_size


def bench_variant(case: Case, args: Args, batches: list[dict], sb3: SB3Side, variant: str) -> list[tuple]:
    """Rows (op, asyncvec rate, sb3 rate, paired ratio) for one asyncvec configuration."""
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
        rows = []
        if variant not in ("+torch", "max_staleness"):  # these change sampling only
            rows.append(("add", *paired(add, sb3.add, args.repeats)))
        current = step[0] // 100
        max_staleness = current // 2 if variant == "max_staleness" else None
        rng = np.random.default_rng(args.seed)

        def sample() -> int:
            for _ in range(case.samples):
                batch = buffer.sample(args.batch_size, current, max_staleness=max_staleness, rng=rng)
                if variant == "+torch":  # what SB3's sample() does: copy into torch tensors
                    for array in (batch.obs, batch.action, batch.next_obs, batch.reward, batch.terminated):
                        torch.tensor(array)
            return case.samples * args.batch_size

        rows.append(("sample", *paired(sample, sb3.sample, args.repeats)))
        buffer.close()
    return rows


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
        sb3 = SB3Side(case, args, batches)
        for variant in ("uniform", "+torch", "max_staleness", "prioritized", "on disk", "on disk, commit/100"):
            for op, ours, theirs, ratio in bench_variant(case, args, batches, sb3, variant):
                rows.append((case.name, variant, op, ours, theirs, ratio))
        del sb3
        print(f"done: {case.name}", flush=True)
    print(
        f"\nnum_envs={args.num_envs} per add, batch_size={args.batch_size} per sample; transitions/s, "
        f"median of {args.repeats} runs alternating asyncvec and sb3; ratio = median of paired ratios\n"
    )
    header = f"{'observations':<24}{'asyncvec variant':<22}{'op':<8}{'asyncvec':>12}{'sb3':>12}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    for name, variant, op, ours, theirs, ratio in rows:
        print(f"{name:<24}{variant:<22}{op:<8}{ours:>12,.0f}{theirs:>12,.0f}{ratio:>8.2f}")


if __name__ == "__main__":
    main(tyro.cli(Args))
