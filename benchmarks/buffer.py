"""Replay buffer throughput: asyncvec.ReplayBuffer against stable-baselines3's and TorchRL's.

Part 1, against SB3's ``ReplayBuffer`` (numpy): add and sample throughput (transitions per
second) for CartPole-sized observations (4 float32) and Atari-sized ones (84x84x3 uint8).
asyncvec stamps versions and checks every batch's types, dtypes and shapes; it checks the
values against the spaces on the first add (``validate="first"``, the default) or on every add
(``validate="always"``). SB3 checks nothing, and its ``sample()`` also copies the batch into
torch tensors, so a "+torch" row converts asyncvec's numpy batch the same way.
"max_staleness" samples with a staleness filter that excludes half the versions; "on disk"
uses memmaps with a crash-safe commit after every add (or every 100 adds).

Part 2, prioritized replay against TorchRL's ``PrioritizedReplayBuffer`` (a C++ sum-tree over
a ``LazyTensorStorage``): add 8 transitions, sample 256 (asyncvec's batch converted to torch
tensors, as TorchRL returns them) and update 256 priorities, at two capacities. A third row
per capacity is asyncvec's O(n) scan (the path a staleness filter takes), to show what the
O(log n) sum-tree buys. torchrl 0.14.1's wheel is built against an older torch ABI; when its
C++ extension does not load, TorchRL's own segment-tree sources (shipped in ``torchrl/csrc``)
are compiled for the installed torch once (``torch.utils.cpp_extension``, a few minutes).

Every measurement alternates asyncvec and the other library ``repeats`` times; the table
shows median rates and the median of the paired ratios (asyncvec / other). Rates count the
thread's CPU time by default (``--clock cpu``: every operation here runs on one thread, and on
a loaded machine the elapsed time also counts the waits for a core); ``--clock wall`` counts
elapsed time.

Run:
    python benchmarks/buffer.py            # about 3 minutes
    python benchmarks/buffer.py --quick    # about a minute (after the one-time build)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import tyro
from gymnasium import spaces
from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer

from asyncvec.benchmarks.report import machine_line, markdown_table, new_figure, save_report
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
    repeats: int = 7
    """timed repetitions per measurement, alternating asyncvec and the other library; medians are reported"""
    seed: int = 0
    """seed of the generated data and of sampling"""
    torchrl: bool = True
    """part 2: prioritized replay against TorchRL"""
    out_dir: str | None = None
    """where buffer.md / buffer.png go (default benchmarks/results)"""
    clock: str = "cpu"
    """cpu: the thread's CPU time (on a loaded machine, wall time also counts the time spent
    waiting for a core); wall: elapsed time"""


@dataclass
class Case:
    name: str
    observation_space: spaces.Box
    action_space: spaces.Discrete
    capacity: int
    adds: int  # add calls per timed repetition
    samples: int  # sample calls per timed repetition


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]


def rate(run: Callable[[], int]) -> float:
    """Transitions per second of one call of ``run`` (which returns its transition count)."""
    start = clock()
    transitions = run()
    return transitions / (clock() - start)


def paired(ours: Callable[[], int], theirs: Callable[[], int], repeats: int) -> tuple[float, float, float]:
    """Alternate the two runs ``repeats`` times; median rates and median of paired ratios.

    Pairing adjacent runs keeps the ratio meaningful on a machine whose load drifts.
    """
    pairs = []
    for index in range(repeats):
        if index % 2:  # alternate which side goes first
            theirs_rate, ours_rate = rate(theirs), rate(ours)
        else:
            ours_rate, theirs_rate = rate(ours), rate(theirs)
        pairs.append((ours_rate, theirs_rate))
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
            validate="always" if variant == "validate=always" else "first",
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
        if variant == "validate=always":  # validation changes adding only
            buffer.close()
            return rows
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


# ---------------------------------------------------------------------------------------------
# Part 2: prioritized replay against TorchRL


def torchrl_prioritized_buffer(capacity: int, alpha: float, beta: float):
    """TorchRL's PrioritizedReplayBuffer over a LazyTensorStorage, with its C++ sum-tree.

    torchrl 0.14.1's compiled extension fails to load with torch 2.13 (an ABI mismatch:
    ``undefined symbol ... torch::autograd::_wrap_outputs``), which leaves its prioritized
    sampler without trees. Then TorchRL's own ``segment_tree.h`` is compiled for the installed
    torch (cached by torch.utils.cpp_extension) and handed to its sampler module.
    """
    from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer
    from torchrl.data.replay_buffers.samplers import prioritized as sampler_module

    if sampler_module.SumSegmentTreeFp32 is None:
        import torchrl
        from torch.utils.cpp_extension import load_inline

        print("building TorchRL's segment tree for this torch (once; a few minutes) ...", flush=True)
        source = "\n".join(
            [
                '#include "segment_tree.h"',
                "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {",
                '  torchrl::DefineSumSegmentTree<float>("Fp32", m);',
                '  torchrl::DefineSumSegmentTree<double>("Fp64", m);',
                '  torchrl::DefineMinSegmentTree<float>("Fp32", m);',
                '  torchrl::DefineMinSegmentTree<double>("Fp64", m);',
                "}",
            ]
        )
        csrc = Path(torchrl.__file__).parent / "csrc"
        trees = load_inline(
            "torchrl_segment_tree", cpp_sources=[source], extra_include_paths=[str(csrc)], extra_cflags=["-O2"]
        )
        for name in ("SumSegmentTreeFp32", "SumSegmentTreeFp64", "MinSegmentTreeFp32", "MinSegmentTreeFp64"):
            setattr(sampler_module, name, getattr(trees, name))
    return PrioritizedReplayBuffer(alpha=alpha, beta=beta, storage=LazyTensorStorage(capacity))


def bench_prioritized(capacity: int, args: Args, repeats: int) -> list[tuple]:
    """Rows (capacity, op, asyncvec rate, torchrl rate, paired ratio) for prioritized replay."""
    from tensordict import TensorDict

    alpha, beta, n, batch_size = 0.6, 0.4, args.num_envs, args.batch_size
    obs_space, action_space = spaces.Box(-np.inf, np.inf, (4,), np.float32), spaces.Discrete(2)
    ours = ReplayBuffer(capacity, obs_space, action_space, prioritized=True, alpha=alpha, beta=beta, seed=args.seed)
    theirs = torchrl_prioritized_buffer(capacity, alpha, beta)
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    obs = rng.normal(size=(n, 4)).astype(np.float32)
    action, reward, done = rng.integers(0, 2, n), rng.normal(size=n).astype(np.float32), np.zeros(n, bool)
    step = TensorDict(
        {
            "obs": torch.from_numpy(obs),
            "action": torch.from_numpy(action),
            "reward": torch.from_numpy(reward),
            "next_obs": torch.from_numpy(obs),
            "done": torch.from_numpy(done),
        },
        batch_size=[n],
    )
    chunk = 10_000  # fill both in large chunks first
    big_obs = rng.normal(size=(chunk, 4)).astype(np.float32)
    big = TensorDict(
        {
            "obs": torch.from_numpy(big_obs),
            "action": torch.zeros(chunk, dtype=torch.int64),
            "reward": torch.zeros(chunk),
            "next_obs": torch.from_numpy(big_obs),
            "done": torch.zeros(chunk, dtype=torch.bool),
        },
        batch_size=[chunk],
    )
    for _ in range(-(-capacity // chunk)):
        ours.add(
            big_obs,
            np.zeros(chunk, np.int64),
            np.zeros(chunk, np.float32),
            big_obs,
            np.zeros(chunk, bool),
            np.zeros(chunk, bool),
            0,
        )
        theirs.extend(big)
    adds, samples = (200, 20) if args.quick else (2000, 200)
    priorities = rng.uniform(0.01, 2.0, batch_size)
    torch_priorities = torch.from_numpy(priorities.astype(np.float32))

    def our_add() -> int:
        for _ in range(adds):
            ours.add(obs, action, reward, obs, done, done, 1)
        return adds * n

    def their_add() -> int:
        for _ in range(adds):
            theirs.extend(step)
        return adds * n

    def our_sample(**filters) -> Callable[[], int]:
        def run() -> int:
            for _ in range(samples):
                batch = ours.sample(batch_size, 1, **filters)
                for array in (batch.obs, batch.action, batch.reward, batch.next_obs, batch.terminated, batch.weights):
                    torch.from_numpy(array)
            return samples * batch_size

        return run

    def their_sample() -> int:
        for _ in range(samples):
            theirs.sample(batch_size, return_info=True)
        return samples * batch_size

    indices = ours.sample(batch_size, 1).indices
    their_indices = theirs.sample(batch_size, return_info=True)[1]["index"]

    def our_update() -> int:
        for _ in range(samples):
            ours.update_priorities(indices, priorities)
        return samples * batch_size

    def their_update() -> int:
        for _ in range(samples):
            theirs.update_priority(their_indices, torch_priorities)
        return samples * batch_size

    rows = [
        (capacity, "add 8", *paired(our_add, their_add, repeats)),
        (capacity, f"sample {batch_size}: sum-tree", *paired(our_sample(), their_sample, repeats)),
        (capacity, f"sample {batch_size}: O(n) scan", *paired(our_sample(max_staleness=10), their_sample, repeats)),
        (capacity, f"update {batch_size} priorities", *paired(our_update, their_update, repeats)),
    ]
    ours.close()
    return rows


def main(args: Args) -> None:
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(1)  # every operation measured runs on this one thread
    scale = 10 if args.quick else 1
    repeats = 3 if args.quick else args.repeats
    args = Args(**{**vars(args), "repeats": repeats})
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
    print(f"Machine: {machine_line()}", flush=True)
    rng = np.random.default_rng(args.seed)
    rows = []
    for case in cases:
        batches = make_batches(case, args.num_envs, rng)
        sb3 = SB3Side(case, args, batches)
        variants = (
            "uniform",
            "validate=always",
            "+torch",
            "max_staleness",
            "prioritized",
            "on disk",
            "on disk, commit/100",
        )
        for variant in variants:
            for op, ours, theirs, ratio in bench_variant(case, args, batches, sb3, variant):
                rows.append([case.name, variant, op, ours, theirs, ratio])
        del sb3
        print(f"done: {case.name} ({machine_line()})", flush=True)
    table = markdown_table(["observations", "asyncvec variant", "op", "asyncvec /s", "sb3 /s", "ratio"], rows)
    print(
        f"\nvs stable-baselines3: num_envs={args.num_envs} per add, batch_size={args.batch_size} per sample; "
        f"transitions per {args.clock} second, median of {args.repeats} alternating runs; ratio = median of paired "
        f"ratios\n\n{table}"
    )
    prioritized_rows = []
    if args.torchrl:
        for capacity in (100_000 // scale, 1_000_000 // scale):
            prioritized_rows += bench_prioritized(capacity, args, args.repeats)
            print(f"done: prioritized, capacity {capacity:,} ({machine_line()})", flush=True)
        prioritized_table = markdown_table(
            ["capacity", "op", "asyncvec /s", "torchrl /s", "ratio"],
            [[f"{c:,}", op, ours, theirs, ratio] for c, op, ours, theirs, ratio in prioritized_rows],
        )
        print(f"\nprioritized replay vs TorchRL (alpha 0.6, beta 0.4; transitions/s)\n\n{prioritized_table}")
    else:
        prioritized_table = ""

    fig, axes = new_figure(ncols=2, width=6.5, height=4.5)
    ax_sb3, ax_trl = np.ravel(axes)
    labels = [f"{r[0].split(' ')[0]} {r[1]} {r[2]}" for r in rows]
    ax_sb3.barh(
        np.arange(len(rows)), [r[5] for r in rows], color=["tab:blue" if r[5] >= 1 else "tab:red" for r in rows]
    )
    ax_sb3.set_yticks(np.arange(len(rows)), labels, fontsize=7)
    ax_sb3.axvline(1.0, color="black", lw=0.8)
    ax_sb3.set_xscale("log")
    ax_sb3.set_xlabel("asyncvec / stable-baselines3 (transitions/s)")
    ax_sb3.invert_yaxis()
    if prioritized_rows:
        labels = [f"{c:,}: {op}" for c, op, *_ in prioritized_rows]
        ratios = [r[4] for r in prioritized_rows]
        ax_trl.barh(np.arange(len(ratios)), ratios, color=["tab:blue" if r >= 1 else "tab:red" for r in ratios])
        ax_trl.set_yticks(np.arange(len(ratios)), labels, fontsize=7)
        ax_trl.axvline(1.0, color="black", lw=0.8)
        ax_trl.set_xscale("log")
        ax_trl.set_xlabel("asyncvec / TorchRL prioritized (transitions/s)")
        ax_trl.invert_yaxis()
    notes = (
        f"Rates: transitions per {args.clock} second ({'CPU time of the benchmark thread' if args.clock == 'cpu' else 'elapsed time'}), "
        f"median of {args.repeats} runs alternating the libraries; ratio: median of the paired ratios, asyncvec / other."
    )
    if prioritized_table:
        notes += (
            "\n\nPrioritized replay vs TorchRL's PrioritizedReplayBuffer (LazyTensorStorage):\n\n" + prioritized_table
        )
    command = "python benchmarks/buffer.py " + " ".join(sys.argv[1:])
    save_report("buffer", table, fig, out_dir=args.out_dir, command=command.strip(), notes=notes)


if __name__ == "__main__":
    main(tyro.cli(Args))
