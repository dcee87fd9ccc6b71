"""PPO's default settings across tasks: every seed must leave the task's floor, sync and async.

For each task, mode (sync/async) and seed, one PPO run with the defaults (``agents.ppo.PRESETS``
picks them by env id) plus any ``--override``; reported per run: env steps, wall-clock,
env-steps/s, the final and the best 20-episode mean return, the first env step at which the
20-episode mean left the task's floor (its minimum return) and the step at which it reached
the task's target. The PNG shows the learning curves, mean and min-max band over seeds.

Run (about 40 minutes on 2 idle cores; ``--processes`` runs that many runs at once):
    python benchmarks/ppo_defaults.py
    python benchmarks/ppo_defaults.py --tasks CartPole-v1 --seeds 1 2 3 --override '{"correction": "tis"}'
    python benchmarks/ppo_defaults.py --quick   # a few seconds: the script runs end to end
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import machine_line, markdown_table, new_figure, save_report  # noqa: E402


@dataclass(frozen=True)
class Task:
    budget: int
    """env steps per run"""
    floor: float
    """the task's minimum return: a run whose 20-episode mean never rises above it did not learn"""
    target: float
    """a return that counts as solved (reported, not a stopping rule)"""


TASKS = {
    "CartPole-v1": Task(budget=100_000, floor=10.0, target=475.0),
    "MountainCar-v0": Task(budget=300_000, floor=-200.0, target=-110.0),
    "LunarLander-v3": Task(budget=500_000, floor=-200.0, target=200.0),
}


@dataclass
class Args:
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    """env ids (keys of TASKS)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds per task and mode"""
    modes: list[str] = field(default_factory=lambda: ["sync", "async"])
    """sync and/or async"""
    budget_scale: float = 1.0
    """multiply every task's env-step budget by this"""
    override: str = "{}"
    """JSON object of agents.ppo.Args fields applied to every run, e.g. '{"correction": "tis"}'"""
    processes: int = 1
    """runs at once (one torch thread each); keep it at or below the idle cores"""
    name: str = "ppo_defaults"
    """report name: writes benchmarks/results/<name>.md and .png"""
    out_dir: str | None = None
    """where the report goes (default benchmarks/results)"""
    quick: bool = False
    """smoke run: CartPole, one seed, both modes, 2,048 steps"""


def run_one(job: dict) -> dict:
    """One PPO run in a child process; returns its summary and learning curve."""
    import torch

    from agents import ppo

    torch.set_num_threads(1)
    args = ppo.Args(env=job["task"], mode=job["mode"], seed=job["seed"], total_timesteps=job["budget"],
                    progress=False, **job["override"])
    result = ppo.train(args)
    steps = [row["global_step"] for row in result.history]
    curve = [row["charts/episodic_return"] for row in result.history]
    return {**{k: job[k] for k in ("task", "mode", "seed")}, "steps": result.global_step, "wall_s": result.wall_time_s,
            "steps_per_s": result.env_steps_per_s, "final": result.final_return, "curve_steps": steps, "curve": curve,
            "staleness": result.staleness_mean}


def first_step(steps: list[int], curve: list[float], above: float) -> int | None:
    """The first env step whose 20-episode mean return is above ``above`` (None if never)."""
    for step, value in zip(steps, curve):
        if value == value and value > above:
            return step
    return None


def summarize(results: list[dict]) -> tuple[str, list[list]]:
    rows = []
    for r in sorted(results, key=lambda r: (r["task"], r["mode"], r["seed"])):
        task = TASKS[r["task"]]
        values = [v for v in r["curve"] if v == v]
        best = max(values) if values else float("nan")
        left = first_step(r["curve_steps"], r["curve"], task.floor)
        solved = first_step(r["curve_steps"], r["curve"], task.target - 1e-9)
        rows.append([r["task"], r["mode"], r["seed"], f"{r['steps']:,}", r["wall_s"], r["steps_per_s"], r["final"], best,
                     f"{left:,}" if left is not None else "never", f"{solved:,}" if solved is not None else "-"])
    headers = ["task", "mode", "seed", "env steps", "wall-clock (s)", "env-steps/s", "final return (20 ep.)",
               "best 20-ep. mean", "left the floor at step", "reached the target at step"]
    return markdown_table(headers, rows), rows


def plot(results: list[dict], tasks: list[str]):
    fig, axes = new_figure(ncols=len(tasks), width=5.0, height=3.6)
    for ax, task in zip(np.atleast_1d(axes), tasks):
        for mode, color in (("sync", "tab:blue"), ("async", "tab:orange")):
            runs = [r for r in results if r["task"] == task and r["mode"] == mode]
            if not runs:
                continue
            grid = np.linspace(0, max(r["steps"] for r in runs), 100)
            curves = np.array([np.interp(grid, r["curve_steps"], np.nan_to_num(r["curve"], nan=TASKS[task].floor)) for r in runs])
            ax.plot(grid, curves.mean(0), color=color, label=f"{mode} (mean of {len(runs)})")
            ax.fill_between(grid, curves.min(0), curves.max(0), color=color, alpha=0.2)
        ax.axhline(TASKS[task].target, color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(task)
        ax.set_xlabel("env steps")
        ax.set_ylabel("20-episode mean return")
        ax.legend(loc="lower right", fontsize=8)
    return fig


def main(args: Args) -> list[dict]:
    override = json.loads(args.override)
    tasks, seeds, modes, scale = args.tasks, args.seeds, args.modes, args.budget_scale
    if args.quick:
        tasks, seeds, modes, scale = ["CartPole-v1"], [1], ["sync", "async"], 2_048 / TASKS["CartPole-v1"].budget
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"unknown task {unknown}; known: {list(TASKS)}")
    jobs = [{"task": t, "mode": m, "seed": s, "budget": max(1, int(TASKS[t].budget * scale)), "override": override}
            for t in tasks for s in seeds for m in modes]
    print(f"{len(jobs)} runs, {args.processes} at once; {machine_line()}", flush=True)
    start = time.monotonic()
    results = []
    # Runs are queued interleaved (task, seed, mode) so a noisy spell of the machine hits both modes alike.
    # (A process pool's workers may start the env worker processes: they are not daemons.)
    with ProcessPoolExecutor(args.processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        for future in as_completed([pool.submit(run_one, job) for job in jobs]):
            r = future.result()
            results.append(r)
            print(f"{r['task']} {r['mode']} seed {r['seed']}: final {r['final']:.1f}, {r['steps']:,} steps in "
                  f"{r['wall_s']:.0f} s", flush=True)
    table, _ = summarize(results)
    print(f"\n{table}\n\n{len(jobs)} runs in {time.monotonic() - start:.0f} s; {machine_line()}")
    command = "python benchmarks/ppo_defaults.py " + " ".join(sys.argv[1:])
    notes = f"Overrides: {override or 'none'}. Floors and targets: " + ", ".join(
        f"{t} floor {TASKS[t].floor:g}, target {TASKS[t].target:g}" for t in tasks)
    for path in save_report(args.name, table, plot(results, tasks), out_dir=args.out_dir, command=command.strip(), notes=notes):
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
