"""PPO or SAC on action chunks (agents/ppo_chunks.py, agents/sac_chunks.py: ``--agent``) on a suite of pixel
tasks, several seeds each.

Each run: a behaviour-cloned warm start from a scripted expert (``--demos`` noisy expert samples,
``--bc-steps`` steps of regression), then ``--iterations`` of RL on the simulated clock, the mean
return of ``--eval-rounds`` x 8 episodes from reset before and after RL. The improvement is the
difference. One variant per ``--variants`` entry (Args fields changed from the agent's
defaults), every task and seed.

Tasks (none keyed anywhere in the agent; image size and horizon vary). The first four are the
tuning tasks (agents/ppo_chunks.py's defaults are chosen on them); the ``held_out`` ones are never
tuned on and are reported apart:

* ``cartpole``: asyncvec/PixelCartPole-v0, 16 px, H=8: the task agents/ppo_chunks.py's defaults
  were measured on before this suite existed.
* ``reach``: asyncvec/PixelReach-v0, 16 px, H=8: a dot onto the square the instruction names.
* ``reach32``: the same at 32 px with H=4.
* ``pendulum``: asyncvec/PixelPendulum-v0, 24 px, H=4, swing-up (the expert pumps energy, then
  balances).
* ``mountain_car`` (held out): asyncvec/PixelMountainCarContinuous-v0, 16 px, H=8, 200 steps (the
  expert pushes along the motion).
* ``cartpole24`` (held out): asyncvec/PixelCartPole-v0 at 24 px with H=4.
* ``reach24`` (held out): asyncvec/PixelReach-v0 at 24 px with H=6.

Each run is one row of ``benchmarks/results/<name>.jsonl`` (agent, variant, task, seed, cloned start,
end, expert, seconds), appended as it finishes; the table and the figure go to ``<name>.md`` and
``<name>.png``. ``--processes 1`` (the default) runs one run at a time, one thread each.

Run (the ablation of issue 50 on the tuning tasks, then the chosen defaults on every task):
    python benchmarks/chunk_suite.py --variants "$(python -c 'from benchmarks.chunk_suite import ABLATION; print(ABLATION)')"
    python benchmarks/chunk_suite.py --tasks reach --seeds 1 --iterations 2 --eval-rounds 1   # a smoke run
    python benchmarks/chunk_suite.py --agent sac --variants "$(python -c 'from benchmarks.chunk_suite import SAC_ABLATION; print(SAC_ABLATION)')" --tasks cartpole reach reach32 pendulum --seeds 1 --name chunk_suite_sac_ablation
    python benchmarks/chunk_suite.py --agent sac --variants "$(python -c 'from benchmarks.chunk_suite import SAC_ANCHOR_FILTERS; print(SAC_ANCHOR_FILTERS)')" --name chunk_suite_sac_qfilter
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncvec.benchmarks.report import RESULTS_DIR, markdown_table, new_figure, save_report  # noqa: E402  (after the path)


@dataclass(frozen=True)
class Task:
    env: str
    size: int
    horizon: int
    max_episode_steps: int
    held_out: bool = False  # never used to choose a default


TASKS = {
    "cartpole": Task("asyncvec/PixelCartPole-v0", 16, 8, 200),
    "reach": Task("asyncvec/PixelReach-v0", 16, 8, 40),
    "reach32": Task("asyncvec/PixelReach-v0", 32, 4, 40),
    "pendulum": Task("asyncvec/PixelPendulum-v0", 24, 4, 200),
    "mountain_car": Task("asyncvec/PixelMountainCarContinuous-v0", 16, 8, 200, held_out=True),
    "cartpole24": Task("asyncvec/PixelCartPole-v0", 24, 4, 200, held_out=True),
    "reach24": Task("asyncvec/PixelReach-v0", 24, 6, 40, held_out=True),
}
TUNING_TASKS = [name for name, task in TASKS.items() if not task.held_out]

# issue 50's ablation: agents/ppo_chunks.py's fine-tuning aids after behaviour cloning, off and on
ABLATION = json.dumps(
    {
        "none": {"critic_warmup_iterations": 0, "anchor_coef": 0.0},
        "warm-up only": {"anchor_coef": 0.0},
        "anchor only": {"critic_warmup_iterations": 0},
        "both (defaults)": {},
    }
)
# agents/sac_chunks.py's aids left out, as run: each with the anchor held everywhere (--anchor-filter none, the
# default until the filtered anchor was measured); the small initial entropy coefficient (0.01 against SAC's usual
# 0.2), a weaker anchor; then none of them (not run yet: docs/robots.md)
SAC_ABLATION = json.dumps(
    {
        "anchor everywhere": {"anchor_filter": "none"},
        "no warm-up": {"critic_warmup_iterations": 0, "anchor_filter": "none"},
        "no anchor": {"anchor_coef": 0.0, "anchor_filter": "none"},
        "anchor 0.1": {"anchor_coef": 0.1, "anchor_filter": "none"},
        "alpha 0.2": {"alpha": 0.2, "anchor_filter": "none"},
        "none (alpha 0.2)": {"critic_warmup_iterations": 0, "anchor_coef": 0.0, "alpha": 0.2, "anchor_filter": "none"},
    }
)
# where the anchor holds (--anchor-filter): everywhere, the Q-filter on min_j Q_j, and the pessimistic one (the
# default: let go only where both critics prefer the actor's chunk); q and anchor 10 only on cartpole, pendulum and
# mountain_car, seed 1
SAC_ANCHOR_FILTERS = json.dumps(
    {
        "q-filter": {"anchor_filter": "q"},
        "q-filter, anchor 10": {"anchor_filter": "q", "anchor_coef": 10.0},
        "q-filter, pessimistic": {"anchor_filter": "q-pessimistic"},
    }
)


@dataclass
class Args:
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    """keys of TASKS"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    agent: Literal["ppo", "sac"] = "ppo"
    """ppo: agents/ppo_chunks.py; sac: agents/sac_chunks.py"""
    variants: str = '{"defaults": {}}'
    """JSON: variant name -> the agent's Args fields changed from its defaults"""
    iterations: int = 20
    eval_rounds: int = 4
    demos: int = 800
    bc_steps: int = 150
    processes: int = 1
    """runs at a time (each one thread)"""
    name: str = "chunk_suite"
    resume: bool = False
    """keep the rows already in <name>.jsonl and run only the jobs that have none (a run replays bit for bit on
    the simulated clock, so a row is what the job would give again on the same machine)"""
    report_only: bool = False
    """run nothing: draw the table and the figure from the rows already in <name>.jsonl (implies --resume)"""


def expert_action(task: str, env: Any) -> np.ndarray:
    """A scripted controller on the simulator state (the warm start's demonstrator)."""
    inner = env.unwrapped  # the simulator under the pixel wrapper
    if task.startswith("cartpole"):
        _, _, angle, spin = inner.state
        return np.array([np.clip(3.0 * angle + 0.5 * spin, -1.0, 1.0)])
    if task.startswith("reach"):
        heading = inner._squares[inner._target] - inner._dot
        return np.clip(heading / 0.1, -1.0, 1.0)
    if task == "mountain_car":
        _, speed = inner.state
        return np.array([1.0 if speed >= 0 else -1.0])  # pump energy: push along the motion
    theta, speed = inner.state
    upright = ((theta + np.pi) % (2 * np.pi)) - np.pi
    if np.cos(upright) > 0.85:  # near the top: balance
        return np.array([np.clip(-8.0 * upright - 1.5 * speed, -2.0, 2.0)])
    return np.array([2.0 if speed >= 0 else -2.0])  # pump energy: push along the motion


def demonstrations(task: str, algo: Any, samples: int, seed: int, noise: float = 0.5) -> tuple[dict, np.ndarray]:
    env, horizon = algo.make_env(), algo.args.horizon
    rng = np.random.default_rng(seed)
    high = env.action_space.high
    observations, chunks, episode_obs, episode_actions = [], [], [], []
    obs, _ = env.reset(seed=seed)
    while len(observations) < samples:
        action = expert_action(task, env)
        episode_obs.append(obs)
        episode_actions.append(action)
        noisy = np.clip(action + rng.normal(0.0, noise, size=action.shape) * high, -high, high)
        obs, _, terminated, truncated, _ = env.step(noisy.astype(np.float32))
        if terminated or truncated:
            for t in range(len(episode_actions) - horizon + 1):
                observations.append(episode_obs[t])
                chunks.append(np.asarray(episode_actions[t : t + horizon], dtype=np.float32))
            episode_obs, episode_actions = [], []
            obs, _ = env.reset()
    env.close()
    batch = {key: np.stack([o[key] for o in observations]) for key in observations[0]}
    return batch, np.stack(chunks)


def expert_return(task: str, seed: int, episodes: int) -> float:
    """The scripted expert's mean return from reset on the full state, one action per step, no
    noise: the reference the gap is measured to (episodes seeded as the agent's evaluation)."""
    import gymnasium as gym

    import asyncvec  # noqa: F401  (registers the asyncvec/ ids)

    spec = TASKS[task]
    env = gym.make(spec.env, size=spec.size, max_episode_steps=spec.max_episode_steps)
    returns = []
    for episode in range(episodes):
        env.reset(seed=seed + 1000 * (episode // 8) + episode % 8)
        total, done = 0.0, False
        while not done:
            _, reward, terminated, truncated, _ = env.step(expert_action(task, env).astype(np.float32))
            total, done = total + float(reward), terminated or truncated
        returns.append(total)
    env.close()
    return float(np.mean(returns))


def run(job: dict) -> dict:
    import torch

    from asyncvec.agents import ppo_chunks, sac_chunks

    torch.set_num_threads(1)
    task = TASKS[job["task"]]
    agent = sac_chunks.SACChunks if job["agent"] == "sac" else ppo_chunks.PPOChunks
    ChunkArgs = sac_chunks.Args if job["agent"] == "sac" else ppo_chunks.Args
    args = ChunkArgs(
        env=task.env, env_kwargs=json.dumps({"size": task.size}), image_size=task.size, horizon=task.horizon,
        max_episode_steps=task.max_episode_steps, iterations=job["iterations"], eval_rounds=job["eval_rounds"],
        seed=job["seed"], **job["fields"],
    )  # fmt: skip
    algo = agent(args)  # type: ignore[arg-type]
    start = time.perf_counter()
    observations, chunks = demonstrations(job["task"], algo, job["demos"], job["seed"])
    algo.behavior_clone(observations, chunks, steps=job["bc_steps"], batch_size=64)
    history = algo.train()
    expert = expert_return(job["task"], job["seed"], 8 * job["eval_rounds"])
    return {**job, "eval_start": history["eval_start"], "eval_end": history["eval_end"], "expert": expert,
            "trained_fraction": history.get("trained_fraction"), "seconds": time.perf_counter() - start}  # fmt: skip


def same_job(row: dict, job: dict) -> bool:
    """A jsonl row is this job's result (every setting of the job equal; a row without an agent is PPO's, written
    before --agent existed)."""
    return all(row.get(key, "ppo" if key == "agent" else None) == value for key, value in job.items())


def main(args: Args) -> list[dict]:
    variants = json.loads(args.variants)
    jobs = [
        {"agent": args.agent, "variant": name, "fields": fields, "task": task, "seed": seed, "iterations": args.iterations,
         "eval_rounds": args.eval_rounds, "demos": args.demos, "bc_steps": args.bc_steps}
        for task in args.tasks for seed in args.seeds for name, fields in variants.items()
    ]  # fmt: skip
    context = multiprocessing.get_context("spawn")
    rows_path = RESULTS_DIR / f"{args.name}.jsonl"
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    resume = args.resume or args.report_only
    kept = [json.loads(line) for line in rows_path.read_text().splitlines()] if resume and rows_path.exists() else []
    if not resume:
        rows_path.write_text("", encoding="utf-8")
    results = [row for row in kept if any(same_job(row, job) for job in jobs)]
    jobs = [] if args.report_only else [job for job in jobs if not any(same_job(row, job) for row in kept)]
    with ProcessPoolExecutor(args.processes, mp_context=context) as pool:
        for result in pool.map(run, jobs):
            results.append(result)
            with rows_path.open("a", encoding="utf-8") as rows_file:
                rows_file.write(json.dumps({**result, "gain": result["eval_end"] - result["eval_start"]}) + "\n")
            print(f"{result['agent']} {result['variant']:>12} {result['task']:>9} seed {result['seed']}: {result['eval_start']:8.1f} -> "
                  f"{result['eval_end']:8.1f} ({result['seconds']:.0f} s)", flush=True)  # fmt: skip
    rows = []
    for name in variants:
        for task in args.tasks:
            runs = sorted((r for r in results if r["variant"] == name and r["task"] == task), key=lambda r: r["seed"])
            if not runs:  # not measured (--report-only over a partial run)
                continue
            gains = [r["eval_end"] - r["eval_start"] for r in runs]
            by_seed = {r["seed"]: r for r in runs}
            cells = [
                f"{r['eval_start']:.1f} -> {r['eval_end']:.1f} ({r['eval_end'] - r['eval_start']:+.1f})"
                if (r := by_seed.get(seed)) is not None
                else "not run"
                for seed in args.seeds
            ]
            gaps = [r["expert"] - r["eval_start"] for r in runs]
            closed = np.mean([gain / gap for gain, gap in zip(gains, gaps, strict=True) if gap > 0] or [np.nan])
            expert = np.mean([r["expert"] for r in runs])
            label = f"{task} (held out)" if TASKS[task].held_out else task
            rows.append([args.agent, name, label, *cells, f"{np.median(gains):+.1f}", f"{np.mean(gains):+.1f}",
                         f"{min(gains):+.1f}", f"{expert:.1f}", f"{closed:.0%}"])  # fmt: skip
    headers = ["agent", "variant", "task", *[f"seed {s}" for s in args.seeds], "median gain", "mean gain", "worst gain",
               "expert", "gap closed"]  # fmt: skip
    table = markdown_table(headers, rows)
    figure, axes = new_figure(width=8.0)
    labels = [f"{name}\n{task}" for name in variants for task in args.tasks]
    for i, (name, task) in enumerate((n, t) for n in variants for t in args.tasks):
        gains = [r["eval_end"] - r["eval_start"] for r in results if r["variant"] == name and r["task"] == task]
        axes.scatter(
            [i] * len(gains), gains, color=f"C{i // len(args.tasks)}", marker="x" if TASKS[task].held_out else "o"
        )
    axes.axhline(0.0, color="grey", linewidth=0.8)
    axes.set_xticks(range(len(labels)), labels, fontsize=7)
    axes.set_ylabel("eval return after RL - after the warm start")
    axes.set_title(f"agents/{args.agent}_chunks.py on pixel tasks, per seed")
    figure.tight_layout()
    command = "python benchmarks/chunk_suite.py " + " ".join(sys.argv[1:])
    notes = (f"agents/{args.agent}_chunks.py: {args.iterations} iterations of 64 ticks x 8 envs after {args.bc_steps} behaviour-cloning steps on "
             f"{args.demos} noisy expert samples; {args.eval_rounds} x 8 evaluation episodes before and after RL. "
             "expert: the scripted demonstrator on the full state, one action per step, no noise, on the same "
             "episodes; gap closed: the mean over seeds of gain / (expert - return after the warm start). Tasks marked "
             f"held out were never used to choose agents/{args.agent}_chunks.py's defaults.")  # fmt: skip
    for path in save_report(args.name, table, figure, command=command.strip(), notes=notes):
        print(path)
    print(table)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
