"""PPO variants compared across tasks: every seed must leave the task's floor, sync and async.

The one default itself is measured by ``benchmarks/defaults.py`` (the wide suite); this script
compares variants side by side (e.g. the corrections under a forced lag, ``ppo_lag8``).
For each variant (the defaults, or Args fields changed from them), task, mode (sync/async) and
seed, one PPO run (agents/ppo.py's defaults plus the variant's fields); reported per run: env steps, wall-clock,
env-steps/s, the final and the best 20-episode mean return, the first env step at which the
20-episode mean left the task's floor (its minimum return) and the step at which it reached
the task's target. The PNG shows the learning curves, mean and min-max band over seeds.

Run (about 40 minutes on 2 idle cores; ``--processes`` runs that many runs at once):
    python benchmarks/ppo_defaults.py
    python benchmarks/ppo_defaults.py --tasks CartPole-v1 --modes async --name ppo_lag8 \
        --variants '{"tis": {"correction": "tis", "policy_lag": 8, "max_staleness": 12, "total_timesteps": 60000}}'
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

from asyncvec.benchmarks.report import RESULTS_DIR, machine_line, markdown_table, new_figure, save_report  # noqa: E402  (after the repository is put on sys.path)


@dataclass(frozen=True)
class Task:
    budget: int
    """env steps per run"""
    floor: float
    """a run whose 20-episode mean return never rises above this did not learn: the task's minimum
    return (CartPole about 10, MountainCar -200); LunarLander has none (a crash scores -100 to -600,
    random play about -180), so there 0 (no longer crashing) counts"""
    target: float
    """a return that counts as solved (reported, not a stopping rule)"""


TASKS = {
    "CartPole-v1": Task(budget=100_000, floor=10.0, target=475.0),
    "MountainCar-v0": Task(budget=200_000, floor=-200.0, target=-110.0),
    "LunarLander-v3": Task(budget=250_000, floor=0.0, target=200.0),
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
    variants: str = '{"defaults": {}}'
    """JSON object: variant name -> asyncvec.agents.ppo.Args fields that differ from the defaults (total_timesteps
    replaces the task's budget), e.g. '{"tis": {"correction": "tis"}, "vtrace": {"correction": "vtrace"}}'"""
    processes: int = 1
    """runs at once (one torch thread each); keep it at or below the idle cores"""
    name: str = "ppo_defaults"
    """report name: writes benchmarks/results/<name>.md and .png"""
    out_dir: str | None = None
    """where the report goes (default benchmarks/results)"""
    quick: bool = False
    """smoke run: CartPole, one seed, both modes, 2,048 steps"""
    from_json: str | None = None
    """rebuild the table and plot from the raw results a run saved (<name>.json) instead of running"""


def run_one(job: dict) -> dict:
    """One PPO run in a child process; returns its summary and learning curve."""
    import torch

    from asyncvec.agents import ppo

    torch.set_num_threads(1)
    overrides = {"total_timesteps": job["budget"], **job["overrides"]}
    args = ppo.Args(env=job["task"], mode=job["mode"], seed=job["seed"], progress=False, track=False, **overrides)
    result = ppo.train(args)
    steps = [row["global_step"] for row in result.history]
    curve = [row["charts/episodic_return"] for row in result.history]
    return {
        **{k: job[k] for k in ("variant", "task", "mode", "seed")},
        "steps": result.global_step,
        "wall_s": result.wall_time_s,
        "steps_per_s": result.env_steps_per_s,
        "final": result.final_return,
        "curve_steps": steps,
        "curve": curve,
        "staleness": result.staleness_mean,
    }


def first_step(steps: list[int], curve: list[float], above: float) -> int | None:
    """The first env step whose 20-episode mean return is above ``above`` (None if never)."""
    for step, value in zip(steps, curve):
        if value == value and value > above:
            return step
    return None


def summarize(results: list[dict]) -> tuple[str, list[list]]:
    rows = []
    for r in sorted(results, key=lambda r: (r["variant"], r["task"], r["mode"], r["seed"])):
        task = TASKS[r["task"]]
        values = [v for v in r["curve"] if v == v]
        best = max(values) if values else float("nan")
        left = first_step(r["curve_steps"], r["curve"], task.floor)
        solved = first_step(r["curve_steps"], r["curve"], task.target - 1e-9)
        rows.append(
            [
                r["variant"],
                r["task"],
                r["mode"],
                r["seed"],
                f"{r['steps']:,}",
                r["wall_s"],
                r["steps_per_s"],
                r["staleness"],
                values[0] if values else float("nan"),
                r["final"],
                best,
                f"{left:,}" if left is not None else "never",
                f"{solved:,}" if solved is not None else "-",
            ]
        )
    headers = [
        "variant",
        "task",
        "mode",
        "seed",
        "env steps",
        "wall-clock (s)",
        "env-steps/s",
        "mean staleness",
        "first mean return",
        "final return (20 ep.)",
        "best 20-ep. mean",
        "left the floor at step",
        "reached the target at step",
    ]
    return markdown_table(headers, rows), rows


def plot(results: list[dict]):
    """One panel per task: the 20-episode mean return of each (variant, mode), mean and min-max over seeds."""
    tasks = sorted({r["task"] for r in results}, key=list(TASKS).index)
    groups = sorted({(r["variant"], r["mode"]) for r in results})
    colors = dict(
        zip(
            groups,
            [
                "tab:blue",
                "tab:orange",
                "tab:green",
                "tab:red",
                "tab:purple",
                "tab:brown",
                "tab:pink",
                "tab:gray",
                "tab:olive",
                "tab:cyan",
            ]
            * 3,
        )
    )
    fig, axes = new_figure(ncols=len(tasks), width=5.0, height=3.6)
    for ax, task in zip(np.ravel(axes), tasks):
        for variant, mode in groups:
            runs = [r for r in results if r["task"] == task and r["mode"] == mode and r["variant"] == variant]
            if not runs:
                continue
            grid = np.linspace(0, max(r["steps"] for r in runs), 100)
            # Before the first episode ends there is no return yet: draw the floor.
            curves = np.array(
                [np.interp(grid, r["curve_steps"], np.nan_to_num(r["curve"], nan=TASKS[task].floor)) for r in runs]
            )
            label = f"{mode}" if len({g[0] for g in groups}) == 1 else f"{variant} {mode}"
            ax.plot(grid, curves.mean(0), color=colors[(variant, mode)], label=f"{label} ({len(runs)} seeds)")
            ax.fill_between(grid, curves.min(0), curves.max(0), color=colors[(variant, mode)], alpha=0.2)
        ax.axhline(TASKS[task].target, color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(task)
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:g}k")
        ax.set_xlabel("env steps")
        ax.set_ylabel("20-episode mean return")
        ax.legend(loc="lower right", fontsize=8)
    return fig


def report(results: list[dict], args: Args, variants: dict, measured_on: str = "") -> None:
    """Prints the table and writes <name>.md, <name>.png and the raw results <name>.json."""
    table, _ = summarize(results)
    print(f"\n{table}\n")
    command = "python benchmarks/ppo_defaults.py " + " ".join(sys.argv[1:])
    tasks = sorted({r["task"] for r in results}, key=list(TASKS).index)
    notes = (
        f"Variants (Args fields that differ from the defaults): {json.dumps(variants)}. Floors and targets: "
        + ", ".join(f"{t} floor {TASKS[t].floor:g}, target {TASKS[t].target:g}" for t in tasks)
        + "."
    )
    if measured_on:
        notes += f"\n\nMeasured on: {measured_on} (rendered from the saved results with --from-json)."
    for path in save_report(
        args.name, table, plot(results), out_dir=args.out_dir, command=command.strip(), notes=notes
    ):
        print(f"wrote {path}")


def main(args: Args) -> list[dict]:
    variants = json.loads(args.variants)
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        report(saved["results"], args, saved["variants"], saved.get("machine", ""))
        return saved["results"]
    tasks, seeds, modes, scale = args.tasks, args.seeds, args.modes, args.budget_scale
    if args.quick:
        tasks, seeds, modes, scale = ["CartPole-v1"], [1], ["sync", "async"], 2_048 / TASKS["CartPole-v1"].budget
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"unknown task {unknown}; known: {list(TASKS)}")
    # Queued interleaved (variant, task, seed, mode), so a noisy spell of the machine hits both modes alike.
    jobs = [
        {"variant": v, "task": t, "mode": m, "seed": s, "budget": max(1, int(TASKS[t].budget * scale)), "overrides": o}
        for v, o in variants.items()
        for t in tasks
        for s in seeds
        for m in modes
    ]
    jobs.sort(key=lambda job: -job["overrides"].get("total_timesteps", job["budget"]))  # longest first: better packing
    print(f"{len(jobs)} runs, {args.processes} at once; {machine_line()}", flush=True)
    start = time.monotonic()
    results: list[dict] = []
    raw = out_dir / f"{args.name}.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    # (A process pool's workers may start the env worker processes: they are not daemons.)
    with ProcessPoolExecutor(args.processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        for future in as_completed([pool.submit(run_one, job) for job in jobs]):
            r = future.result()
            results.append(r)
            raw.write_text(json.dumps({"variants": variants, "machine": machine_line(), "results": results}))
            print(
                f"{r['variant']} {r['task']} {r['mode']} seed {r['seed']}: final {r['final']:.1f}, {r['steps']:,} steps "
                f"in {r['wall_s']:.0f} s",
                flush=True,
            )
    print(f"{len(jobs)} runs in {time.monotonic() - start:.0f} s; {machine_line()}")
    report(results, args, variants)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
