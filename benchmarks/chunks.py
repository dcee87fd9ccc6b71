"""Action chunks at a 50 Hz control rate, and image observations through shared memory vs pipes.

Part ``chunks``: ``num_envs`` PixelPendulum envs (64x64 image + instruction) in an
``AsyncLLMVectorEnv`` are driven by a `ChunkExecutor` at a 20 ms control period. The policy is a
small TorchPolicy that maps the image and instruction to a chunk of ``H`` actions, behind a
`LatencyModel` that makes each call take 100, 200, 300 or 400 ms (and one setting drawn
uniformly from 100-400 ms per call), with one request in flight per env. For each latency and
``H`` (``H = 1``: one action per call) it reports the fraction of control ticks that played a
policy action (the rest played the fallback), against the bound
``min(1, H / mean(ceil(latency / period)))`` (`asyncvec.control.ticks_met_bound`, computed from
the latencies measured in that run and the ticks' real mean length, which late ticks stretch
under load), and the ``k`` the executor chose from the measured p95 latency. The first ``warmup_ticks`` of each run (waiting for the first chunk) are not counted.

Part ``obs``: the bytes a worker pickles per step (measured on a real ``EnvGroup``) and the
lockstep steps per second of ``AsyncLLMVectorEnv`` with ``shared_memory=True`` (the image in
shared memory, the instruction over the pipe) against ``shared_memory=False`` (everything
pickled): on a camera stub (a new image per step and nothing else: the transport's own cost) at
64, 128 and 224 pixels, and on PixelPendulum (drawing included) at 64 and 128. The two
transports alternate for ``rounds`` rounds; each keeps its best (the load changes, the cost
does not).

It writes ``benchmarks/results/chunks.md`` and ``chunks.png``.

Run:
    python benchmarks/chunks.py                      # both parts (about 5 min)
    python benchmarks/chunks.py --part obs --seconds 2
    python benchmarks/chunks.py --ticks 100 --horizons 1 16 --latencies-ms 200
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gymnasium as gym
import numpy as np
import torch
import tyro
from gymnasium.vector.utils import create_shared_memory

import asyncvec.envs  # noqa: F401  (registers the pixel envs)
from asyncvec import AsyncLLMVectorEnv
from asyncvec.benchmarks.report import machine_line, markdown_table, new_figure, save_report
from asyncvec.control import SOURCES, ChunkExecutor, ticks_met_bound
from asyncvec.inference import LatencyModel, TorchPolicy
from asyncvec.vector.split_obs import shared_subspace
from asyncvec.vector.worker import EnvGroup, dumps


@dataclass
class Args:
    part: str = "all"
    """"chunks", "obs" or "all\""""
    num_envs: int = 4
    """envs (each with its own chunk stream)"""
    period_ms: float = 20.0
    """control period (20 ms = 50 Hz)"""
    latencies_ms: list[float] = field(default_factory=lambda: [100.0, 200.0, 300.0, 400.0])
    """fixed policy latencies to sweep (a uniform 100-400 ms setting is added when uniform is set)"""
    uniform: bool = True
    """also run a policy whose latency is drawn uniformly from [min, max] of latencies_ms per call"""
    horizons: list[int] = field(default_factory=lambda: [1, 8, 16, 32])
    """chunk lengths H (1 = one action per call)"""
    ticks: int = 400
    """measured control ticks per setting"""
    warmup_ticks: int = 30
    """ticks run before measuring (the first chunk's wait)"""
    seconds: float = 3.0
    """measured time per transport run (part obs)"""
    rounds: int = 2
    """alternating rounds per transport (part obs; the best of each is reported)"""
    out_dir: str | None = None
    """where chunks.md/.png go (default benchmarks/results)"""


class ChunkNet(torch.nn.Module):
    """Image + instruction (flattened) -> a Gaussian over a chunk of H actions in [-2, 2]."""

    def __init__(self, inputs: int, horizon: int) -> None:
        super().__init__()
        self.horizon = horizon
        self.mean = torch.nn.Sequential(torch.nn.Linear(inputs, 32), torch.nn.Tanh(), torch.nn.Linear(32, horizon))

    def forward(self, obs: torch.Tensor):
        return 2.0 * torch.tanh(self.mean(obs / 255.0)), torch.full((self.horizon,), -2.0)


class UniformLatency(LatencyModel):
    """A LatencyModel whose every call sleeps a uniform draw from ``[low_ms, high_ms]``."""

    def __init__(self, policy: Any, low_ms: float, high_ms: float, **kwargs: Any) -> None:
        super().__init__(policy, a_ms=low_ms, b_ms=0.0, **kwargs)
        self.low_ms, self.high_ms = low_ms, high_ms
        self._rng = np.random.default_rng(0)

    def _forward_batch(self, obs_list):
        time.sleep(self._rng.uniform(self.low_ms, self.high_ms) / 1000.0)
        return self.policy.forward_batch(obs_list)


def run_chunks(args: Args, vector_env: AsyncLLMVectorEnv, latency: float | tuple[float, float], horizon: int) -> dict:
    space = vector_env.single_observation_space
    torch.manual_seed(0)
    inner = TorchPolicy(
        ChunkNet(gym.spaces.flatdim(space), horizon),
        gym.spaces.Box(-2.0, 2.0, (horizon, 1), np.float32),
        observation_space=space,
        max_batch_size=1,
    )
    common = {"max_batch_size": 1, "max_inflight_batches": args.num_envs}  # one call per env, none queued
    if isinstance(latency, tuple):
        policy = UniformLatency(inner, *latency, **common)
    else:
        policy = LatencyModel(inner, a_ms=latency, b_ms=0.0, **common)
    executor = ChunkExecutor(vector_env, policy, period_s=args.period_ms / 1000.0, horizon=horizon)
    executor.reset(seed=0)
    executor.run(args.warmup_ticks)
    measured_from = len(executor.chunk_latencies_s())
    rollout = executor.run(args.ticks)
    period_s = float(np.diff(rollout.tick_time).mean())  # the ticks' real length (late ticks stretch it)
    stats = executor.stats()
    policy.close()
    met = rollout.count("policy") + rollout.count("ensemble")
    missed = rollout.count("fallback")
    latencies = executor.chunk_latencies_s()[measured_from:] or executor.chunk_latencies_s()
    bound = ticks_met_bound(latencies, period_s, horizon)
    fraction = met / max(1, met + missed)
    return {
        "met": fraction,
        "bound": bound,
        "vs_bound": fraction / bound,
        "late": float(rollout.late.mean()),
        "tick_ms": period_s * 1000.0,
        "p95_ms": float(np.percentile(np.asarray(latencies) * 1000.0, 95)),
        "k": stats["request_at"],
        "policy_choice": float(rollout.policy_choice[rollout.source != SOURCES.index("reset")].mean()),
    }


def part_chunks(args: Args) -> tuple[str, list[dict]]:
    torch.set_num_threads(1)
    settings: list[float | tuple[float, float]] = list(args.latencies_ms)
    if args.uniform and len(args.latencies_ms) > 1:
        settings.append((min(args.latencies_ms), max(args.latencies_ms)))
    rows, results = [], []
    with AsyncLLMVectorEnv([lambda: gym.make("asyncvec/PixelPendulum-v0")] * args.num_envs) as vector_env:
        for latency in settings:
            name = f"U({latency[0]:g}, {latency[1]:g})" if isinstance(latency, tuple) else f"{latency:g}"
            for horizon in args.horizons:
                result = run_chunks(args, vector_env, latency, horizon)
                result.update(latency=name, horizon=horizon)
                results.append(result)
                mode = "one action per call" if horizon == 1 else f"chunks of H={horizon}"
                row = [
                    name,
                    mode,
                    result["met"],
                    result["bound"],
                    result["vs_bound"],
                    result["p95_ms"],
                    int(result["k"]),
                    result["policy_choice"],
                    result["late"],
                    result["tick_ms"],
                ]
                rows.append(row)
                print(markdown_table(HEADERS, [row]).splitlines()[-1], flush=True)
    return markdown_table(HEADERS, rows), results


HEADERS = [
    "latency ms",
    "mode",
    "ticks met",
    "bound",
    "vs bound",
    "p95 ms",
    "k",
    "policy's own action",
    "late ticks",
    "tick ms",
]


class CameraStub(gym.Env):
    """A camera and nothing else: each step returns a new ``size x size`` image and the instruction.

    Isolates the cost of moving observations (no simulation, no drawing beyond one fill).
    """

    def __init__(self, size: int = 64) -> None:
        self.observation_space = gym.make("asyncvec/PixelPendulum-v0", size=size).observation_space
        self.action_space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
        self._image = np.zeros((size, size, 3), dtype=np.uint8)
        self._count = 0

    def _obs(self) -> dict:
        self._count += 1
        self._image[self._count % self._image.shape[0]] = self._count % 256
        return {"image": self._image.copy(), "instruction": "swing the pendulum up and balance it upright"}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs(), {}

    def step(self, action):
        return self._obs(), 0.0, False, False, {}


def _env_fn(kind: str, size: int):
    if kind == "camera stub":
        return lambda: CameraStub(size)
    return lambda: gym.make("asyncvec/PixelPendulum-v0", size=size)


def _pickled_bytes_per_step(kind: str, size: int, shared: bool) -> int:
    make = _env_fn(kind, size)
    space = make().observation_space
    memory = (create_shared_memory(shared_subspace(space), n=1), 1) if shared else None
    group = EnvGroup([make], [0], gym.vector.AutoresetMode.NEXT_STEP, memory)
    group.handle([(0, "reset", {"seed": 0, "options": None})])
    reply = group.handle([(0, "step", np.zeros(1, dtype=np.float32))])
    group.close()
    return len(dumps((True, reply)))


def _steps_per_s(make, num_envs: int, shared: bool, seconds: float) -> tuple[float, float]:
    """(env steps per second, the parent's CPU microseconds per env step) of lockstep steps."""
    with AsyncLLMVectorEnv([make] * num_envs, shared_memory=shared) as vector_env:
        actions = np.zeros((num_envs, 1), dtype=np.float32)
        vector_env.reset(seed=0)
        for _ in range(20):
            vector_env.step(actions)
        steps, started, cpu = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - started < seconds:
            vector_env.step(actions)
            steps += 1
        cpu_us = (time.process_time() - cpu) / (steps * num_envs) * 1e6
        return steps * num_envs / (time.perf_counter() - started), cpu_us


def part_obs(args: Args) -> tuple[str, list[dict]]:
    rows, results = [], []
    for kind, sizes in (("camera stub", (64, 128, 224)), ("PixelPendulum", (64, 128))):
        for size in sizes:
            # alternate the two transports for `rounds` rounds and keep each one's best: the
            # machine's load changes between runs, the transport's cost does not
            runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for _ in range(args.rounds):
                for shared in (True, False):
                    runs[shared].append(_steps_per_s(_env_fn(kind, size), args.num_envs, shared, args.seconds))
            pair = {}
            for shared in (True, False):
                pair[shared] = {
                    "env": kind,
                    "size": size,
                    "shared": shared,
                    "bytes": _pickled_bytes_per_step(kind, size, shared),
                    "env_steps_per_s": max(rate for rate, _ in runs[shared]),
                    "parent_cpu_us": min(cpu for _, cpu in runs[shared]),
                }
                results.append(pair[shared])
            shm, pipe = pair[True], pair[False]
            rows.append(
                [
                    kind,
                    f"{size}x{size}",
                    shm["bytes"],
                    pipe["bytes"],
                    shm["parent_cpu_us"],
                    pipe["parent_cpu_us"],
                    shm["env_steps_per_s"],
                    pipe["env_steps_per_s"],
                    shm["env_steps_per_s"] / pipe["env_steps_per_s"],
                ]
            )
            print(rows[-1], flush=True)
    headers = [
        "env",
        "image",
        "bytes pickled/step: shm",
        "bytes pickled/step: pipe",
        "parent CPU us/step: shm",
        "parent CPU us/step: pipe",
        "env steps/s: shm",
        "env steps/s: pipe",
        "steps/s shm / pipe",
    ]
    return markdown_table(headers, rows), results


def main(args: Args) -> dict[str, Any]:
    print(f"Machine: {machine_line()}", flush=True)
    tables, out = [], {}
    fig, axes = new_figure(ncols=2, width=6.0)
    axes = axes.ravel()
    if args.part in ("chunks", "all"):
        table, results = part_chunks(args)
        tables.append(f"Chunks at a {args.period_ms:g} ms control period, {args.num_envs} envs:\n\n{table}")
        out["chunks"] = results
        ax = axes[0]
        fixed = [r for r in results if not r["latency"].startswith("U")]
        for index, horizon in enumerate(args.horizons):
            points = [r for r in fixed if r["horizon"] == horizon]
            color = f"C{index}"
            label = "1 action per call" if horizon == 1 else f"H={horizon}"
            ax.plot([float(r["latency"]) for r in points], [r["met"] for r in points], "o-", color=color, label=label)
            ax.plot([float(r["latency"]) for r in points], [r["bound"] for r in points], "--", color=color, alpha=0.6)
        ax.set_xlabel("policy latency (ms)")
        ax.set_ylabel("fraction of control ticks met")
        ax.set_title(f"{args.period_ms:g} ms control period (dashed: bound)")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    if args.part in ("obs", "all"):
        table, results = part_obs(args)
        tables.append(
            f"Image + instruction observations, {args.num_envs} PixelPendulum envs, lockstep steps:\n\n{table}"
        )
        out["obs"] = results
        ax = axes[1]
        groups = [(r["env"], r["size"]) for r in results if r["shared"]]
        x = np.arange(len(groups))
        for offset, shared, color, label in (
            (-0.2, True, "tab:blue", "image in shared memory"),
            (0.2, False, "tab:gray", "all pickled (pipe)"),
        ):
            values = [
                next(r["env_steps_per_s"] for r in results if (r["env"], r["size"]) == g and r["shared"] == shared)
                for g in groups
            ]
            ax.bar(x + offset, values, width=0.4, color=color, label=label)
        ax.set_xticks(x, [f"{env}\n{size}px" for env, size in groups], fontsize=7)
        ax.set_ylabel("env steps/s")
        ax.set_title(f"{args.num_envs} envs, lockstep")
        ax.legend(fontsize=8)
    table = "\n\n".join(tables)
    print(f"\n{table}")
    save_report(
        "chunks",
        table,
        fig,
        out_dir=args.out_dir,
        command="python benchmarks/chunks.py",
        notes=(
            "ticks met: fraction of control ticks (after the warm-up) that played an action from a policy chunk; "
            "the others played the fallback (hold the last action). bound: min(1, H / mean(ceil(latency / period))) "
            "over the latencies measured in that run, with the period the ticks really took (tick ms; late ticks "
            "stretch it under load), one request in flight per env. k: the executor's request "
            "threshold, ceil(p95 / period) + 1 capped at H. policy's own action: executed actions that are exactly a "
            "chunk's action (not a fallback). late ticks: ticks whose env step ended after the next tick was due."
        ),
    )
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
