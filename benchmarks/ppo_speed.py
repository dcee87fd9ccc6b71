"""PPO on CartPole with a slow policy and a slow env: async vs sync, side by side in one run.

Both modes use the same env workers, the same policy server (a LatencyModel of
``--policy-latency-ms`` per batch) and the same PPO settings. Reported: wall-clock time to a
20-episode mean return of ``--target-return`` (or the return reached within
``--total-timesteps``), env-steps/s, and the async/sync speedup.

Run: ``python benchmarks/ppo_speed.py`` (the ``make demo`` job).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents import ppo  # noqa: E402


@dataclass
class Args:
    env: str = "CartPole-v1"
    """gymnasium env id"""
    policy_latency_ms: float = 20.0
    """latency of each policy call"""
    env_latency_ms: float = 2.0
    """latency of each env step"""
    env_latency_dist: str = "fixed"
    """fixed, uniform or lognormal (heavy-tailed) env latency"""
    total_timesteps: int = 100_000
    """env-step budget per mode"""
    target_return: float = 475.0
    """stop a mode once its 20-episode mean return reaches this"""
    seed: int = 1
    """seed shared by both modes"""
    max_staleness: int = 4
    """async: samples older than this many versions are masked out"""
    progress: bool = True
    """progress bars"""


def run(args: Args) -> dict[str, ppo.TrainResult]:
    results = {}
    for mode in ("async", "sync"):
        print(f"--- PPO {mode}: {args.env}, policy {args.policy_latency_ms:g} ms, env {args.env_latency_ms:g} ms ({args.env_latency_dist})", flush=True)
        results[mode] = ppo.train(ppo.Args(
            env=args.env, mode=mode, policy_latency_ms=args.policy_latency_ms, env_latency_ms=args.env_latency_ms, env_latency_dist=args.env_latency_dist,
            total_timesteps=args.total_timesteps, target_return=args.target_return, seed=args.seed,
            max_staleness=args.max_staleness, progress=args.progress,
        ))
    print(f"\n| mode | env steps | wall-clock (s) | env-steps/s | final return (20 ep.) | time to {args.target_return:g} (s) | mean staleness |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        reached = f"{r.reached_target_s:.1f}" if r.reached_target_s is not None else "not reached"
        print(f"| {mode} | {r.global_step:,} | {r.wall_time_s:.1f} | {r.env_steps_per_s:.0f} | {r.final_return:.1f} | {reached} | {r.staleness_mean:.2f} |")
    a, s = results["async"], results["sync"]
    print(f"\nasync vs sync: {a.env_steps_per_s / s.env_steps_per_s:.2f}x env-steps/s", end="")
    if a.reached_target_s is not None and s.reached_target_s is not None:
        print(f", {s.reached_target_s / a.reached_target_s:.2f}x faster to a return of {args.target_return:g}")
    else:
        print(" (the target was not reached by both modes; compare the final returns)")
    return results


if __name__ == "__main__":
    run(tyro.cli(Args))
