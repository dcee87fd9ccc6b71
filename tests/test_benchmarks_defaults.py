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
