"""PPO's and SAC's one default, measured on a suite of tasks nobody tuned it for.

For each task x seed x mode (sync, async), one run of ``agents/ppo.py`` or ``agents/sac.py`` with
its defaults (only the env id, mode, seed and budget given), each in a fresh process, one at a
time. Each run stops once the mean return of its recent episodes (20 for PPO, 10 for SAC) reaches
the task's reference score, or at its budget. Its row is appended to
``benchmarks/results/<name>.jsonl`` as soon as it ends, with ``os.getloadavg()`` sampled during
the run: a rerun skips the rows already there (resumable, and several invocations can fill one
table piece by piece). ``--report`` renders ``<name>.md`` and ``<name>.png`` from the rows.

Each task has a reference score and budget from a public source (named in ``TASKS``); the
targets are: every seed reaches the reference within 2x the reference budget, no seed ends at
the task's floor (random play, or the minimum return), async needs at most 1.25x the env steps
of sync. Where 2x the reference budget does not fit on the machine, the task runs at a capped
budget, which the table says.

Run:
    python benchmarks/defaults.py                          # the whole suite (hours on 2 busy cores)
    python benchmarks/defaults.py --tasks ppo:Acrobot-v1 --seeds 1 --modes sync
    python benchmarks/defaults.py --report                 # table and plot from the saved rows
    python benchmarks/defaults.py --quick --name defaults_quick   # seconds: the script end to end
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncvec.benchmarks.report import RESULTS_DIR, machine_line, markdown_table, new_figure, save_report  # noqa: E402  (after the repository is put on sys.path)

ZOO = "rl-baselines3-zoo benchmark.md"
CLEANRL = "CleanRL docs (ppo.md)"


@dataclass(frozen=True)
class Task:
    algo: Literal["ppo", "sac"]
    env: str
    reference: float
    """the score that counts as reached (mean of the recent training episodes)"""
    budget: int
    """the reference's env-step budget"""
    source: str
    """where the reference score and budget come from"""
    floor: float
    """a run whose final mean return is at or below this has not left random play / the task's minimum"""
    cap: int | None = None
    """env steps run here when 2x the reference budget does not fit on the machine (reported)"""

    @property
    def key(self) -> str:
        return f"{self.algo}:{self.env}"

    @property
    def run_budget(self) -> int:
        return min(2 * self.budget, self.cap) if self.cap else 2 * self.budget


TASKS: dict[str, Task] = {
    t.key: t
    for t in [
        Task("ppo", "CartPole-v1", 475, 100_000, f"{ZOO}: PPO 500 at 100k; gymnasium threshold 475", floor=25),
        Task(
            "ppo",
            "Acrobot-v1",
            -100,
            500_000,
            f"{CLEANRL}: ppo.py -82.5 at 500k; gymnasium threshold -100",
            floor=-500,
            cap=100_000,
        ),
        Task(
            "ppo",
            "MountainCar-v0",
            -110,
            1_000_000,
            f"{ZOO}: PPO -110.4 at 1M; gymnasium threshold -110",
            floor=-200,
            cap=150_000,
        ),
        Task(
            "ppo",
            "Pendulum-v1",
            -200,
            100_000,
            f"{ZOO}: PPO -172 (+-104) at 100k (tuned, gSDE)",
            floor=-1200,
            cap=150_000,
        ),
        Task(
            "ppo",
            "MountainCarContinuous-v0",
            90,
            20_000,
            f"{ZOO}: PPO 88.3 at 20k (tuned, gSDE); gymnasium threshold 90",
            floor=0,
        ),
        Task(
            "ppo",
            "LunarLander-v3",
            200,
            1_000_000,
            f"{ZOO}: PPO 242 at 1M (v2); gymnasium threshold 200",
            floor=-150,
            cap=100_000,
        ),
        Task(
            "ppo",
            "InvertedPendulum-v5",
            950,
            1_000_000,
            "rl-baselines3-zoo ppo.yml: 1M (InvertedPendulum-v3); gymnasium threshold 950",
            floor=20,
            cap=100_000,
        ),
        Task(  # added after the defaults were chosen: never tuned on
            "ppo",
            "InvertedDoublePendulum-v5",
            9100,
            1_000_000,
            "gymnasium threshold 9100; 1M env steps as CleanRL's ppo_continuous_action MuJoCo runs",
            floor=100,
            cap=100_000,
        ),
        Task("sac", "Pendulum-v1", -200, 20_000, f"{ZOO}: SAC -157 (+-89) at 20k", floor=-1200, cap=15_000),
        Task(
            "sac",
            "MountainCarContinuous-v0",
            90,
            50_000,
            f"{ZOO}: SAC 94.7 at 50k; gymnasium threshold 90",
            floor=0,
            cap=15_000,
        ),
        Task(
            "sac",
            "LunarLanderContinuous-v3",
            200,
            500_000,
            f"{ZOO}: SAC 260 at 500k (v2); gymnasium threshold 200",
            floor=-150,
            cap=15_000,
        ),
        Task(
            "sac",
            "InvertedPendulum-v5",
            950,
            1_000_000,
            "rl-baselines3-zoo sac.yml: 1M (MuJoCo default); gymnasium threshold 950",
            floor=20,
            cap=15_000,
        ),
    ]
}


@dataclass
class Args:
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    """task keys (algo:env id) to run, in this order"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds per task and mode"""
    modes: list[str] = field(default_factory=lambda: ["sync", "async"])
    """sync and/or async"""
    variant: str = "{}"
    """JSON object of Args fields changed from the agent's defaults (empty: the defaults); its rows are kept
    apart from the defaults' rows ("all" with --report: one table of every variant's runs)"""
    budget_scale: float = 1.0
    """multiply every run budget by this"""
    name: str = "defaults"
    """rows go to benchmarks/results/<name>.jsonl, the report to <name>.md and <name>.png"""
    out_dir: str | None = None
    """where the rows and report go (default benchmarks/results)"""
    report: bool = False
    """only render the table and plot from the saved rows"""
    quick: bool = False
    """smoke run: CartPole and Pendulum (PPO), one seed, both modes, 2,048 steps"""
    one: str | None = None
    """(internal) run one job given as JSON and print its row"""


def run_one(job: dict) -> dict:
    """One run in this process; returns its row (summary and learning curve)."""
    import torch

    torch.set_num_threads(1)
    task = TASKS[job["task"]]
    if task.algo == "ppo":
        from asyncvec.agents import ppo as agent
    else:
        from asyncvec.agents import sac as agent
    args = agent.Args(
        env=task.env,
        mode=job["mode"],
        seed=job["seed"],
        total_timesteps=job["budget"],
        target_return=task.reference,
        progress=False,
        **job["variant"],
    )
    result = agent.train(args)
    steps = [int(row["global_step"]) for row in result.history]
    curve = [float(row["charts/episodic_return"]) for row in result.history]
    values = [v for v in curve if v == v]
    return {
        **{k: job[k] for k in ("task", "mode", "seed", "budget", "variant")},
        "steps": result.global_step,
        "reached_at": result.global_step if result.reached_target_s is not None else None,
        "final": result.final_return,
        "best": max(values) if values else float("nan"),
        "wall_s": result.wall_time_s,
        "steps_per_s": result.env_steps_per_s,
        "staleness": result.staleness_mean,
        "curve_steps": steps,
        "curve": curve,
    }


def variant_label(variant: dict) -> str:
    return json.dumps(variant, sort_keys=True) if variant else "defaults"


def load_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_suite(args: Args, path: Path) -> None:
    variant = json.loads(args.variant)
    tasks, seeds, modes, scale = args.tasks, args.seeds, args.modes, args.budget_scale
    if args.quick:
        tasks, seeds, modes = ["ppo:CartPole-v1", "ppo:Pendulum-v1"], [1], ["sync", "async"]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"unknown task {unknown}; known: {list(TASKS)}")
    done = {(r["task"], r["mode"], r["seed"], variant_label(r["variant"])) for r in load_rows(path)}
    # Modes interleaved per seed, so that a noisy spell of the machine hits both alike.
    jobs = [
        {
            "task": t,
            "mode": m,
            "seed": s,
            "variant": variant,
            "budget": 2_048 if args.quick else max(1, int(TASKS[t].run_budget * scale)),
        }
        for t in tasks
        for s in seeds
        for m in modes
        if (t, m, s, variant_label(variant)) not in done
    ]
    print(f"{len(jobs)} runs to do ({len(done)} rows already in {path}); {machine_line()}", flush=True)
    for job in jobs:
        loads: list[float] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                loads.append(os.getloadavg()[0])
                stop.wait(5.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(job)],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        stop.set()
        sampler.join()
        if proc.returncode != 0:
            print(f"FAILED {job}: {proc.stderr[-2000:]}", flush=True)
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row.update(load_mean=float(np.mean(loads)), load_max=float(np.max(loads)), process_s=time.monotonic() - started)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        reached = (
            f"reached {TASKS[job['task']].reference:g} at {row['reached_at']:,}" if row["reached_at"] else "not reached"
        )
        print(
            f"{job['task']} {job['mode']} seed {job['seed']}: {reached}, final {row['final']:.1f}, "
            f"{row['steps']:,} steps in {row['wall_s']:.0f} s, load {row['load_mean']:.1f}",
            flush=True,
        )


def _k(steps: int | None) -> str:
    return f"{steps / 1000:.1f}k" if steps is not None else "-"


def ratio_interval(numerator: list[float], denominator: list[float], draws: int = 20000) -> tuple[float, float]:
    """90% bootstrap interval of ``mean(numerator) / mean(denominator)``: seeds drawn with replacement from each
    side apart (seed 0: a report gives the same interval again)."""
    rng = np.random.default_rng(0)
    top = rng.choice(numerator, (draws, len(numerator))).mean(1)
    bottom = rng.choice(denominator, (draws, len(denominator))).mean(1)
    low, high = np.percentile(top / bottom, [5, 95])
    return float(low), float(high)


def steps_or_budget(run: dict) -> int:
    """Steps to the reference, the run's budget where it never reached it (so a ratio with it is a lower bound)."""
    return run["reached_at"] if run["reached_at"] is not None else run["budget"]


def summarize(rows: list[dict]) -> tuple[str, str]:
    """The per-seed table and the per-task verdict table (markdown)."""
    per_seed, verdicts = [], []
    keys = [k for k in TASKS if any(r["task"] == k for r in rows)]
    for key in keys:
        task = TASKS[key]
        medians, task_rows = {}, []
        for mode in ("sync", "async"):
            runs = sorted((r for r in rows if r["task"] == key and r["mode"] == mode), key=lambda r: r["seed"])
            if not runs:
                continue
            for r in runs:
                per_seed.append(
                    [
                        key,
                        mode,
                        r["seed"],
                        f"{task.reference:g}",
                        f"{r['budget']:,}",
                        _k(r["reached_at"]),
                        r["final"],
                        r["best"],
                        "yes" if r["final"] <= task.floor else "no",
                        r["steps_per_s"],
                        r["load_mean"],
                    ]
                )
            reached = [r["reached_at"] for r in runs if r["reached_at"] is not None]
            medians[mode] = float(np.median(reached)) if len(reached) == len(runs) else None
            budget = max(r["budget"] for r in runs)
            task_rows.append(
                [
                    key,
                    mode,
                    f"{task.reference:g}",
                    f"{task.budget:,}",
                    task.source,
                    f"{budget:,}" + (" (capped)" if budget < 2 * task.budget else ""),
                    ", ".join(_k(r["reached_at"]) if r["reached_at"] else f"never ({r['best']:.0f})" for r in runs),
                    f"{len(reached)}/{len(runs)}",
                    f"{sum(r['final'] <= task.floor for r in runs)}/{len(runs)}",
                    f"{min(r['load_mean'] for r in runs):.1f}-{max(r['load_max'] for r in runs):.1f}",
                    "",
                    "",
                    "",
                ]
            )
        if medians.get("sync") and medians.get("async"):
            task_rows[-1][-3] = f"{medians['async'] / medians['sync']:.2f}"
        steps = {m: [steps_or_budget(r) for r in rows if r["task"] == key and r["mode"] == m] for m in medians}
        reached_both = all(any(r["reached_at"] for r in rows if r["task"] == key and r["mode"] == m) for m in steps)
        if len(steps.get("sync", [])) > 1 and len(steps.get("async", [])) > 1 and reached_both:
            low, high = ratio_interval(steps["async"], steps["sync"])
            mean_ratio = np.mean(steps["async"]) / np.mean(steps["sync"])
            task_rows[-1][-2] = f"{mean_ratio:.2f} ({low:.2f}-{high:.2f})"
            task_rows[-1][-1] = "{:.2f}-{:.2f}".format(*ratio_interval(steps["sync"], steps["sync"]))
        verdicts += task_rows
    seed_table = markdown_table(
        [
            "task",
            "mode",
            "seed",
            "reference",
            "run budget",
            "steps to reference",
            "final mean return",
            "best mean return",
            "ended at floor",
            "env-steps/s",
            "load (mean)",
        ],
        per_seed,
    )
    verdict_table = markdown_table(
        [
            "task",
            "mode",
            "reference score",
            "reference budget",
            "source",
            "run budget",
            "steps to reference per seed (best mean if never)",
            "seeds reached",
            "ended at floor",
            "load",
            "async/sync median steps",
            "async/sync mean steps (90% bootstrap interval)",
            "sync against itself (90%)",
        ],
        verdicts,
    )
    return verdict_table, seed_table


def plot(rows: list[dict]):
    keys = [k for k in TASKS if any(r["task"] == k for r in rows)]
    ncols = min(4, len(keys))
    nrows = (len(keys) + ncols - 1) // ncols
    fig, axes = new_figure(ncols=ncols * nrows, width=4.2, height=3.2)
    axes = np.ravel(axes)
    for ax, key in zip(axes, keys):
        task = TASKS[key]
        for mode, color in (("sync", "tab:blue"), ("async", "tab:orange")):
            for i, r in enumerate(r for r in rows if r["task"] == key and r["mode"] == mode):
                ax.plot(
                    r["curve_steps"], r["curve"], color=color, alpha=0.8, linewidth=1, label=mode if i == 0 else None
                )
        ax.axhline(task.reference, color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(key, fontsize=9)
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:g}k")
        ax.legend(loc="lower right", fontsize=7)
    for ax in axes[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def variants_table(rows: list[dict]) -> str:
    """One line per run, whatever its variant (for comparisons of single settings)."""
    return markdown_table(
        [
            "variant",
            "task",
            "mode",
            "seed",
            "run budget",
            "steps to reference",
            "final mean return",
            "env-steps/s",
            "load",
        ],
        [
            [
                variant_label(r["variant"]),
                r["task"],
                r["mode"],
                r["seed"],
                f"{r['budget']:,}",
                _k(r["reached_at"]),
                r["final"],
                r["steps_per_s"],
                r["load_mean"],
            ]
            for r in rows
        ],
    )


def with_default_sync_runs(every_row: list[dict], variant: dict) -> list[dict]:
    """The variant's rows, and where it has no sync run of a task (a correction: async only) the defaults' sync runs."""
    rows = [r for r in every_row if variant_label(r["variant"]) == variant_label(variant)]
    synced = {r["task"] for r in rows if r["mode"] == "sync"}
    return rows + [r for r in every_row if r["mode"] == "sync" and not r["variant"] and r["task"] not in synced]


def variant_label_verdicts(every_row: list[dict], variant: dict) -> str:
    """One variant's per-task verdict table, headed by its label."""
    return f"Variant {variant_label(variant)}:\n\n{summarize(with_default_sync_runs(every_row, variant))[0]}"


def report(path: Path, args: Args) -> None:
    if args.variant == "all":
        rows = load_rows(path)
        variants = {variant_label(r["variant"]): r["variant"] for r in rows if r["variant"]}  # each correction's
        table = "\n\n".join([*(variant_label_verdicts(rows, v) for v in variants.values()), variants_table(rows)])
        print(f"\n{table}\n")
        command = "python benchmarks/defaults.py " + " ".join(sys.argv[1:])
        for out in save_report(
            args.name,
            table,
            plot(rows),
            out_dir=args.out_dir,
            command=command.strip(),
            notes=f"Rows: {path.name} ({len(rows)} runs, one process each).",
        ):
            print(f"wrote {out}")
        return
    rows = with_default_sync_runs(load_rows(path), json.loads(args.variant))
    if not any(variant_label(r["variant"]) == variant_label(json.loads(args.variant)) for r in rows):
        raise SystemExit(f"no rows for variant {args.variant} in {path}")
    verdicts, seeds = summarize(rows)
    print(f"\n{verdicts}\n\n{seeds}\n")
    notes = (
        f"Variant: {variant_label(json.loads(args.variant))}. Rows: {path.name} ({len(rows)} runs, one process each, "
        "one at a time). A run stops when the mean return of its recent episodes (PPO 20, SAC 10) reaches the "
        "reference. 'load' is os.getloadavg()[0] sampled every 5 s during the run (mean, and the range over "
        "the task's runs).\n\n" + seeds
    )
    command = "python benchmarks/defaults.py " + " ".join(a for a in sys.argv[1:])
    for out in save_report(args.name, verdicts, plot(rows), out_dir=args.out_dir, command=command.strip(), notes=notes):
        print(f"wrote {out}")


def main(args: Args) -> None:
    if args.one is not None:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.name}.jsonl"
    if not args.report:
        run_suite(args, path)
    report(path, args)


if __name__ == "__main__":
    main(tyro.cli(Args))
