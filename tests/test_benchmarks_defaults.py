"""benchmarks/defaults.py: one run per process, rows appended with the load, resumable, a table per task."""

from __future__ import annotations

import json

from asyncvec.benchmarks import defaults


def test_defaults_suite_appends_rows_resumes_and_reports(tmp_path, capsys, no_leftover_children):
    args = defaults.Args(
        tasks=["ppo:CartPole-v1"], seeds=[1], modes=["sync"], budget_scale=0.01, out_dir=str(tmp_path), name="suite"
    )
    defaults.main(args)
    rows = [json.loads(line) for line in (tmp_path / "suite.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert row["task"] == "ppo:CartPole-v1" and row["mode"] == "sync" and row["budget"] == 2_000
    assert row["steps"] >= 2_000 and row["load_mean"] > 0 and row["curve"]
    report = (tmp_path / "suite.md").read_text()
    assert "| ppo:CartPole-v1 | sync | 475 | 100,000 |" in report and "rl-baselines3-zoo" in report
    assert (tmp_path / "suite.png").stat().st_size > 0
    capsys.readouterr()
    defaults.main(args)  # the row is there: nothing runs again
    assert "0 runs to do (1 rows already" in capsys.readouterr().out


def test_every_task_names_its_reference_and_runs_within_twice_its_budget():
    for task in defaults.TASKS.values():
        assert task.source and task.budget > 0
        assert task.run_budget <= 2 * task.budget


def test_the_ratio_interval_holds_the_ratio_and_widens_with_the_spread_of_seeds():
    """The report's 90% bootstrap interval of async/sync mean steps, and of sync against itself."""
    assert defaults.ratio_interval([2.0, 2.0, 2.0], [1.0, 1.0]) == (2.0, 2.0)  # no spread: the ratio itself
    tight = defaults.ratio_interval([10.0, 11.0, 12.0, 11.0, 10.0], [10.0, 10.5, 9.5, 10.0, 10.0])
    wide = defaults.ratio_interval([5.0, 20.0, 8.0, 15.0, 11.0], [10.0, 10.5, 9.5, 10.0, 10.0])
    assert tight[0] < 10.8 / 10.0 < tight[1] and wide[0] < 11.8 / 10.0 < wide[1]
    assert wide[1] - wide[0] > 3 * (tight[1] - tight[0])
    seeds = ([5.0, 20.0, 8.0], [10.0, 11.0])
    assert defaults.ratio_interval(*seeds) == defaults.ratio_interval(*seeds)  # seeded: a report repeats itself


def test_a_correction_variant_is_reported_against_the_default_sync_runs(tmp_path, capsys):
    row = {"budget": 100, "final": 1.0, "best": 1.0, "steps_per_s": 1.0, "load_mean": 1.0, "load_max": 1.0,
           "curve_steps": [1], "curve": [1.0]}  # fmt: skip
    rows = [
        {**row, "task": "ppo:CartPole-v1", "mode": mode, "seed": seed, "variant": variant, "reached_at": steps}
        for mode, variant, runs in (("sync", {}, (40, 50, 60)), ("async", {"correction": "decoupled"}, (80, 100, 120)))
        for seed, steps in enumerate(runs, 1)
    ]
    (tmp_path / "suite.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = defaults.Args(out_dir=str(tmp_path), name="suite", report=True, variant='{"correction": "decoupled"}')
    defaults.main(args)
    async_line = next(line for line in (tmp_path / "suite.md").read_text().splitlines() if "| async |" in line)
    assert "| 2.00 | 2.00 (" in async_line, async_line  # median and mean ratio against the defaults' sync runs
    defaults.main(defaults.Args(out_dir=str(tmp_path), name="suite", report=True, variant="all"))
    every_run = (tmp_path / "suite.md").read_text()  # each correction's verdicts, then one line per run
    assert 'Variant {"correction": "decoupled"}:' in every_run and "| 2.00 | 2.00 (" in every_run
    capsys.readouterr()
