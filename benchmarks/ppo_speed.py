"""``make demo``: PPO async vs sync where async pays most, with the bound next to the ratio.

Runs one regime of ``benchmarks/pipeline.py`` (default: c, stragglers: a 5 ms policy and a
heavy-tailed 10 ms env over 16 envs) for one seed in both modes: it measures the stage times
(policy call, env step distribution), trains PPO on CartPole-v1 sync and async to a return of
475, and prints env-steps/s, wall-clock to the target, the async/sync ratio and the bound the
measured stage times allow (docs/benchmarks.md derives it). About 3 minutes on 2 cores.

Run:
    asyncvec demo                                  # installed: regime c, seed 1 (the same as below)
    python benchmarks/ppo_speed.py                 # regime c, seed 1
    python benchmarks/ppo_speed.py --regime b      # learner-bound
    python benchmarks/ppo_speed.py --regime a      # policy-bound: little to gain
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tyro

from asyncvec.benchmarks import pipeline
from asyncvec.benchmarks.report import machine_line, markdown_table, save_figure, save_report


@dataclass
class Args:
    regime: Literal["a", "b", "c"] = "c"
    """which regime of benchmarks/pipeline.py (a: policy-bound, b: learner-bound, c: stragglers)"""
    seed: int = 1
    """seed shared by both modes"""
    total_timesteps: int | None = None
    """env-step budget per mode (default: the regime's)"""
    target_return: float | None = None
    """stop a mode once its 20-episode mean return reaches this (default: the regime's, 475)"""
    progress: bool = True
    """progress bars"""
    out_dir: str | None = None
    """where ppo_speed.md/.png go (default: ./asyncvec-results in the folder run from; benchmarks/results in a clone)"""


def main(args: Args) -> pipeline.Summary:
    regime = pipeline.REGIMES[args.regime]
    print(
        f"PPO on CartPole-v1, regime {regime.key} ({regime.title}: {regime.summary}), "
        f"sync and async, seed {args.seed}\nMachine: {machine_line()}",
        flush=True,
    )
    options = pipeline.Args(
        regimes=[regime.key],
        seeds=[args.seed],
        total_timesteps=args.total_timesteps,
        target_return=args.target_return,
        progress=args.progress,
        out_dir=args.out_dir,
    )
    (summary,) = pipeline.run_regimes([regime.key], options)
    rows = []
    for mode in ("sync", "async"):
        (run,) = [r for r in summary.runs if r.mode == mode]
        reached = run.result.reached_target_s
        rows.append(
            [
                mode,
                run.result.global_step,
                run.steady_steps_per_s,
                run.result.final_return,
                f"{reached:.0f}" if reached is not None else "not reached",
                run.result.staleness_mean,
            ]
        )
    table = markdown_table(
        [
            "mode",
            "env steps",
            "env-steps/s",
            "final return (20 ep.)",
            f"s to {summary.regime.target_return:g}",
            "mean staleness",
        ],
        rows,
    )
    bound = summary.prediction.bound
    verdict = (
        f"async vs sync: {summary.ratio:.2f}x env-steps/s; bound {bound:.2f}x from the measured stage times "
        f"(ratio / bound {summary.ratio_to_bound:.2f})"
    )
    if summary.ttt_ratio == summary.ttt_ratio:
        verdict += f"; {summary.ttt_ratio:.2f}x faster to a return of {summary.regime.target_return:g}"
    else:
        verdict += " (the target was not reached by both modes: compare the final returns)"
    st = summary.stages
    stages = (
        f"stage times: policy call {st.policy_a_s * 1e3:.1f} + {st.policy_b_s * 1e3:.2f}·B ms, env step mean "
        f"{st.env_mean_s * 1e3:.1f} ms and slowest of {regime.num_envs} {st.env_max_s * 1e3:.1f} ms, learner "
        f"{st.learn_s * 1e3:.0f} ms per update of {regime.num_envs * regime.num_steps} steps"
    )
    print(f"\n{table}\n\n{verdict}\n{stages}\nMachine: {machine_line()}")
    throughput, curves, staleness = pipeline.figures([summary])
    save_report(
        "ppo_speed",
        table,
        throughput,
        out_dir=args.out_dir,
        command="python benchmarks/ppo_speed.py",
        notes=f"{verdict}\n\n{stages}",
    )
    save_figure("ppo_speed_curves", curves, out_dir=args.out_dir)
    save_figure("ppo_speed_staleness", staleness, out_dir=args.out_dir)
    return summary


if __name__ == "__main__":
    main(tyro.cli(Args))
