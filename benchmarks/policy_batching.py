"""Dynamic batching versus one request per call, side by side, against a simulated GPU server.

A small TorchPolicy is wrapped in ``LatencyModel(a_ms, b_ms)`` (default 50 ms per call plus
1 ms per item, spent sleeping like a remote server) and driven by ``num_envs`` threads that
each submit an observation, wait for the answer and submit again. Each mode runs for
``seconds`` after a warm-up; the table shows answers per second, mean batch size, latency
percentiles, the speed-up over one request per call and the fraction of the bound (full
batches back to back: ``max_batch_size / (a + b·max_batch_size)`` answers/s). It writes
``benchmarks/results/policy_batching.md`` and ``.png``.

Run:
    python benchmarks/policy_batching.py            # full run (about 20 s)
    python benchmarks/policy_batching.py --seconds 2 --warmup-s 0.5
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gymnasium as gym
import numpy as np
import torch
import tyro

from asyncvec.benchmarks.report import machine_line, markdown_table, new_figure, save_report
from asyncvec.inference import LatencyModel, TorchPolicy


@dataclass
class Args:
    num_envs: int = 64
    """concurrent env threads (each: submit, wait, submit again)"""
    a_ms: float = 50.0
    """fixed cost of one backend call (ms)"""
    b_ms: float = 1.0
    """cost per item of a backend call (ms)"""
    max_batch_size: int = 64
    """largest batch of the dynamic modes"""
    max_wait_ms: float = 5.0
    """longest wait for a batch to fill in the dynamic modes"""
    seconds: float = 5.0
    """measured time per mode"""
    warmup_s: float = 1.0
    """unmeasured time per mode before measuring"""
    obs_dim: int = 8
    """observation size of the toy policy"""
    out_dir: str | None = None
    """where policy_batching.md/.png go (default benchmarks/results)"""


def run_mode(args: Args, **batching: Any) -> dict[str, float]:
    """Drive one policy configuration with ``num_envs`` closed-loop env threads."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(args.obs_dim, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    policy = LatencyModel(TorchPolicy(net, gym.spaces.Discrete(4)), a_ms=args.a_ms, b_ms=args.b_ms, **batching)
    stop = threading.Event()

    def env_loop(env_id: int) -> None:
        obs = np.random.default_rng(env_id).normal(size=args.obs_dim).astype(np.float32)
        while not stop.is_set():
            policy.submit(obs, env_id=env_id).result(timeout=120)

    threads = [threading.Thread(target=env_loop, args=(i,), daemon=True) for i in range(args.num_envs)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(args.warmup_s)
        first, started = policy.stats(), time.perf_counter()
        time.sleep(args.seconds)
        last, elapsed = policy.stats(), time.perf_counter() - started
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        policy.close()
    batches = last["batches"] - first["batches"]
    items = last["mean_batch_size"] * last["batches"] - first["mean_batch_size"] * first["batches"]
    return {
        "answers_per_s": (last["answered"] - first["answered"]) / elapsed,
        "mean_batch": items / batches if batches else 0.0,
        "p50_ms": last["latency_p50_ms"],
        "p99_ms": last["latency_p99_ms"],
    }


def main(args: Args) -> dict[str, dict[str, float]]:
    modes = {
        "one request per call (max_batch_size=1)": {"max_batch_size": 1, "max_wait_ms": 0.0},
        f"DynamicBatcher (max_batch_size={args.max_batch_size})": {
            "max_batch_size": args.max_batch_size,
            "max_wait_ms": args.max_wait_ms,
        },
        f"DynamicBatcher adaptive (max_batch_size={args.max_batch_size})": {
            "max_batch_size": args.max_batch_size,
            "max_wait_ms": args.max_wait_ms,
            "adaptive_batching": True,
        },
    }
    setting = (
        f"LatencyModel(a={args.a_ms:g} ms, b={args.b_ms:g} ms) around a TorchPolicy, {args.num_envs} env threads, "
        f"{args.seconds:g} s per mode"
    )
    print(f"{setting}\nMachine: {machine_line()}", flush=True)
    results = {name: run_mode(args, **batching) for name, batching in modes.items()}
    baseline = results[next(iter(modes))]["answers_per_s"]
    # The physical bound: k=1 batch in flight of up to max_batch_size items, each a + b*B long.
    bound = args.max_batch_size / ((args.a_ms + args.b_ms * args.max_batch_size) / 1000.0)
    rows = [
        [
            name,
            row["answers_per_s"],
            row["mean_batch"],
            row["p50_ms"],
            row["p99_ms"],
            row["answers_per_s"] / baseline,
            row["answers_per_s"] / bound,
        ]
        for name, row in results.items()
    ]
    table = markdown_table(["mode", "answers/s", "mean batch", "p50 ms", "p99 ms", "vs 1/call", "vs bound"], rows)
    print(f"\n{table}\n\nbound: {bound:.0f} answers/s (full batches of {args.max_batch_size}, back to back)")
    fig, ax = new_figure(width=7.0)
    names = [name.replace(" (", "\n(") for name in results]
    ax.bar(names, [row["answers_per_s"] for row in results.values()], color="tab:blue")
    ax.axhline(bound, color="black", ls="--", label=f"bound ({bound:.0f}/s)")
    ax.set_ylabel("answers/s")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend()
    save_report(
        "policy_batching",
        table,
        fig,
        out_dir=args.out_dir,
        command="python benchmarks/policy_batching.py",
        notes=f"{setting}; bound: full batches back to back, {bound:.0f} answers/s.",
    )
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
