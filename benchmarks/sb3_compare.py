"""Wall-clock to a target return: asyncvec's PPO at its defaults against Stable-Baselines3's PPO, side by side.

SB3 runs rl-zoo's tuned CartPole-v1 settings (8 envs, n_steps 32, batch 256, 20 epochs, gamma 0.98,
GAE lambda 0.8, linear learning rate 1e-3 and clip 0.2: the same numbers as ``asyncvec-ppo``'s
defaults) with its default vector env for the kind: ``DummyVecEnv`` for the cheap env, ``SubprocVecEnv``
for an env whose step waits. ``asyncvec-ppo`` runs at its defaults (``--mode async``). Both stop once the
mean return of the last 20 episodes reaches the target; the table holds the seconds to get there
(seeds interleaved: the machine is noisy) and the ratio SB3 / asyncvec (above 1: asyncvec is faster).

Needs ``stable-baselines3`` beside asyncvec (``pip install stable-baselines3``; not a dependency).

Run: ``python benchmarks/sb3_compare.py`` (about 5 minutes; ``--seeds 1`` for a short run).
Writes ``benchmarks/results/sb3_compare.md``.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncvec.agents.ppo import Args as PPOArgs  # noqa: E402  (the repository root goes on sys.path first)
from asyncvec.agents.ppo import train  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.benchmarks.report import machine_line, markdown_table, save_report  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.envs.slow import SlowEnv  # noqa: E402  (after the repository is put on sys.path)


@dataclass
class Args:
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds, each run by both libraries"""
    target: float = 475.0
    """mean return of the last 20 episodes to reach"""
    waits_ms: tuple[float, ...] = (0.0, 2.0)
    """env kinds: CartPole-v1 as it is (0) and behind a SlowEnv whose step sleeps this long"""
    budget: int = 200_000
    """env steps at most per run"""
    out_dir: str | None = None
    """where sb3_compare.md goes (default benchmarks/results)"""


def make_env(wait_ms: float):
    def make() -> gym.Env:
        env = gym.make("CartPole-v1")
        return SlowEnv(env, latency_ms=wait_ms) if wait_ms > 0 else env

    return make


def run_sb3(wait_ms: float, seed: int, target: float, budget: int) -> float | None:
    """Seconds until SB3's PPO (rl-zoo CartPole settings) reaches ``target``; ``None`` if not within ``budget``."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    def linear(start: float):
        return lambda progress: progress * start

    class StopAtTarget(BaseCallback):
        reached: float | None = None

        def _on_step(self) -> bool:
            episodes = list(self.model.ep_info_buffer)[-20:]
            if len(episodes) >= 20 and statistics.fmean(e["r"] for e in episodes) >= target:
                self.reached = time.perf_counter() - started
                return False
            return True

    started = time.perf_counter()
    vec_cls = SubprocVecEnv if wait_ms > 0 else DummyVecEnv
    env = make_vec_env(make_env(wait_ms), n_envs=8, seed=seed, vec_env_cls=vec_cls)
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=32,
        batch_size=256,
        gae_lambda=0.8,
        gamma=0.98,
        n_epochs=20,
        ent_coef=0.0,
        learning_rate=linear(1e-3),
        clip_range=linear(0.2),
        seed=seed,
        device="cpu",
    )
    callback = StopAtTarget()
    model.learn(total_timesteps=budget, callback=callback)
    env.close()
    return callback.reached


def run_asyncvec(wait_ms: float, seed: int, target: float, budget: int) -> float | None:
    result = train(
        PPOArgs(
            env="CartPole-v1",
            track=False,  # timed: no TensorBoard files
            env_latency_ms=wait_ms,
            seed=seed,
            target_return=target,
            total_timesteps=budget,
            progress=False,
        )
    )
    return result.reached_target_s


def main(args: Args) -> list[list[str]]:
    rows = []
    for wait_ms in args.waits_ms:
        times: dict[str, list[float | None]] = {"asyncvec": [], "sb3": []}
        for seed in args.seeds:
            times["asyncvec"].append(run_asyncvec(wait_ms, seed, args.target, args.budget))
            times["sb3"].append(run_sb3(wait_ms, seed, args.target, args.budget))
            print(
                f"wait {wait_ms} ms, seed {seed}: asyncvec {times['asyncvec'][-1]}, sb3 {times['sb3'][-1]}", flush=True
            )
        reached = [(a, s) for a, s in zip(times["asyncvec"], times["sb3"]) if a is not None and s is not None]
        ratios = [s / a for a, s in reached]
        kind = "CartPole-v1" if wait_ms == 0 else f"CartPole-v1, step waits {wait_ms:g} ms"

        def cell(values: list[float | None]) -> str:
            return ", ".join("-" if v is None else f"{v:.1f}" for v in values)

        rows.append(
            [
                kind,
                cell(times["asyncvec"]),
                cell(times["sb3"]),
                f"{statistics.median(ratios):.2f}x" if ratios else "-",
                ", ".join(f"{r:.2f}" for r in ratios),
            ]
        )
    headers = ["env", "asyncvec-ppo s to target (per seed)", "SB3 PPO s to target", "median SB3/asyncvec", "per seed"]
    table = markdown_table(headers, rows)
    print(f"{machine_line()}\n{table}")
    save_report(
        "sb3_compare",
        table,
        out_dir=args.out_dir,
        command="python benchmarks/sb3_compare.py",
        notes=f"Seconds to a mean return of {args.target:g} over the last 20 episodes (asyncvec-ppo at its defaults, "
        f"SB3 PPO with rl-zoo's CartPole settings), seeds {list(args.seeds)}; '-': not reached within "
        f"{args.budget:,} env steps.",
    )
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
