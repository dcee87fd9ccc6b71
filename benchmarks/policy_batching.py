"""Dynamic batching versus one request per call, side by side, against a simulated GPU server.

A small TorchPolicy is wrapped in ``LatencyModel(a_ms, b_ms)`` (default 50 ms per call plus
1 ms per item, spent sleeping like a remote server) and driven by ``num_envs`` threads that
each submit an observation, wait for the answer and submit again. Each mode runs for
``seconds`` after a warm-up; the table shows answers per second, mean batch size, latency
percentiles and the speed-up over one request per call.

Run:
    python benchmarks/policy_batching.py            # full run (about 20 s)
    python benchmarks/policy_batching.py --seconds 2 --warmup-s 0.5
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import tyro

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


def main(args: Args) -> None:
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
    print(
        f"LatencyModel(a={args.a_ms:g} ms, b={args.b_ms:g} ms) around a TorchPolicy, {args.num_envs} env threads, "
        f"{args.seconds:g} s per mode"
    )
    results = {name: run_mode(args, **batching) for name, batching in modes.items()}
    baseline = results[next(iter(modes))]["answers_per_s"]
    width = max(len(name) for name in results)
    print(f"{'mode':<{width}}  {'answers/s':>10}  {'mean batch':>10}  {'p50 ms':>8}  {'p99 ms':>8}  {'vs 1/call':>9}")
    for name, row in results.items():
        print(
            f"{name:<{width}}  {row['answers_per_s']:>10.1f}  {row['mean_batch']:>10.1f}  "
            f"{row['p50_ms']:>8.0f}  {row['p99_ms']:>8.0f}  {row['answers_per_s'] / baseline:>8.1f}x"
        )


if __name__ == "__main__":
    main(tyro.cli(Args))
