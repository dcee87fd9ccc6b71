"""The integration learning tests, measured: each library's own training loop through its adapter, per seed.

Runs the seedable helpers of ``tests/test_integrations_*.py`` (``train_sb3_ppo``, ``train_tianshou_dqn``,
``train_torchrl_ppo``, ``train_rllib_ppo``, ``train_cleanrl_ppo``) with the settings the tests use, one run
at a time, each in a fresh process (torch on one thread, as the tests' ``one_torch_thread`` fixture sets
it), and prints per run: the score the test checks, env steps, wall-clock seconds and the machine load.
The numbers in the tests' comments and in docs/integrations.md come from this script.

Run (about 30 minutes on 2 loaded cores):
    python benchmarks/integrations_learning.py
    python benchmarks/integrations_learning.py --libraries torchrl --seeds 3 --merge   # add to the last table
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncvec.benchmarks.report import (  # noqa: E402  (after the repository is put on sys.path)
    RESULTS_DIR,
    machine_line,
    markdown_table,
    new_figure,
    save_report,
)

LIBRARIES = ["sb3", "tianshou", "torchrl", "rllib", "cleanrl"]


@dataclass
class Args:
    libraries: list[str] = field(default_factory=lambda: list(LIBRARIES))
    """which helpers to run (sb3, tianshou, torchrl, rllib, cleanrl)"""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """seeds per library"""
    name: str = "integrations_learning"
    """report name: writes benchmarks/results/<name>.md and .png"""
    out_dir: str | None = None
    """where the report goes (default benchmarks/results)"""
    merge: bool = False
    """keep the rows of <name>.json for the runs not repeated here (e.g. one library measured again)"""
    run_one: str | None = None
    """internal: LIBRARY:SEED runs one training in this process and prints its result as JSON"""


def train(library: str, seed: int) -> dict:
    """One training run with the test's settings: the score the test checks and the env steps."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "tests"))
    if library == "sb3":
        from test_integrations_sb3 import train_sb3_ppo

        mean, steps = train_sb3_ppo(seed)
        return {"score": mean, "steps": steps, "detail": f"20-episode mean {mean:.1f}"}
    if library == "tianshou":
        from test_integrations_tianshou import train_tianshou_dqn

        result, steps = train_tianshou_dqn(seed, threshold=150, max_epochs=20)
        return {
            "score": float(result.best_score),
            "steps": int(steps),
            "detail": "best test return (8 episodes)",
        }
    if library == "torchrl":
        from test_integrations_torchrl import train_torchrl_ppo

        first, last, frames = train_torchrl_ppo(seed)
        return {
            "score": last,
            "steps": frames,
            "detail": f"20-episode mean {first:.1f} -> {last:.1f}",
        }
    if library == "rllib":
        import ray
        from test_integrations_rllib import train_rllib_ppo

        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        try:
            returns, steps = train_rllib_ppo(seed)
        finally:
            ray.shutdown()
        return {
            "score": returns[-1],
            "steps": steps,
            "detail": "by iteration " + "/".join(f"{r:.1f}" for r in returns),
        }
    if library == "cleanrl":
        from test_integrations_gymnasium import train_cleanrl_ppo

        mean, steps = train_cleanrl_ppo(seed)
        return {"score": mean, "steps": steps, "detail": f"20-episode mean {mean:.1f}"}
    raise ValueError(f"unknown library {library!r}; expected one of {LIBRARIES}")


def run_in_child(library: str, seed: int) -> dict:
    """Runs :func:`train` in a fresh interpreter (no state shared between runs) and times it."""
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    child = subprocess.run(
        [sys.executable, __file__, "--run-one", f"{library}:{seed}"],
        check=False,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    seconds = time.monotonic() - start
    if child.returncode != 0:
        raise RuntimeError(f"{library} seed {seed} failed:\n{child.stdout[-3000:]}\n{child.stderr[-3000:]}")
    result = json.loads(child.stdout.strip().splitlines()[-1])
    return {
        "library": library,
        "seed": seed,
        **result,
        "seconds": seconds,
        "load": (load_before + os.getloadavg()[0]) / 2,
    }


def main(args: Args) -> None:
    if args.run_one is not None:
        library, seed = args.run_one.split(":")
        print(json.dumps(train(library, int(seed))))
        return
    print(machine_line(), flush=True)
    raw = Path(args.out_dir or RESULTS_DIR) / f"{args.name}.json"
    rows = json.loads(raw.read_text()) if args.merge and raw.exists() else []
    for library in args.libraries:
        for seed in args.seeds:
            row = run_in_child(library, seed)
            rows = [r for r in rows if (r["library"], r["seed"]) != (library, seed)] + [row]
            print(json.dumps(row), flush=True)
    rows.sort(key=lambda r: (LIBRARIES.index(r["library"]), r["seed"]))
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(rows, indent=1))
    headers = ["library", "seed", "score", "env steps", "seconds", "load", "detail"]
    table = markdown_table(
        headers,
        [
            [
                r["library"],
                r["seed"],
                r["score"],
                r["steps"],
                r["seconds"],
                r["load"],
                r["detail"],
            ]
            for r in rows
        ],
    )
    print(table)
    fig, ax = new_figure()
    for library in dict.fromkeys(r["library"] for r in rows):
        mine = [r for r in rows if r["library"] == library]
        ax.scatter([r["steps"] for r in mine], [r["score"] for r in mine], label=library)
    ax.set_xlabel("env steps used")
    ax.set_ylabel("score the test checks")
    ax.legend()
    command = "python benchmarks/integrations_learning.py " + " ".join(sys.argv[1:])
    save_report(args.name, table, fig, out_dir=args.out_dir, command=command.strip(),
                notes="load: the 1-minute load average, mean of before and after the run.")  # fmt: skip


if __name__ == "__main__":
    main(tyro.cli(Args))
