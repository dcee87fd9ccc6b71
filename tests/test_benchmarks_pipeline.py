"""benchmarks/pipeline.py: the bound model, and the summary, tables and plots from recorded runs.

The PPO runs themselves take minutes, so they are measured by the benchmark, not here; these
tests keep the arithmetic and the report code honest with hand-made runs.
"""

from __future__ import annotations

import doctest
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import pipeline
from benchmarks.pipeline import REGIMES, Run, StageTimes, predict, summarize


def test_docstring_examples_run() -> None:
    result = doctest.testmod(pipeline)
    assert result.attempted > 0 and result.failed == 0


def test_bound_of_each_regime_shape() -> None:
    fast_server = 1e9
    # Policy-bound: a cheap learner and no stragglers leave little to overlap.
    policy_bound = StageTimes(0.020, 0.0, fast_server, 0.002, 0.002, learn_s=0.05)
    assert predict(policy_bound, 8, 32).bound == pytest.approx((32 * 0.022 + 0.05) / (32 * 0.022))
    # Learner-bound: learning as long as acting -> sync pays both, async the longer one: 2x.
    learner_bound = StageTimes(0.020, 0.0, fast_server, 0.002, 0.002, learn_s=32 * 0.022)
    assert predict(learner_bound, 8, 32).bound == pytest.approx(2.0)
    # Stragglers: lockstep waits for the slowest of N every step, async for each env's own.
    stragglers = StageTimes(0.005, 0.0, fast_server, 0.010, 0.042, learn_s=0.0)
    assert predict(stragglers, 16, 16).bound == pytest.approx(0.047 / 0.015)
    # A saturated server caps async: 16 envs at 100 requests/s need 0.16 s per round.
    slow_server = StageTimes(0.005, 0.0, 100.0, 0.010, 0.042, learn_s=0.0)
    assert predict(slow_server, 16, 16).async_collect_s == pytest.approx(16 * 0.16)
    # The per-item cost counts for sync's full batch and async's single requests.
    per_item = StageTimes(0.010, 0.001, fast_server, 0.0, 0.0, learn_s=0.0)
    assert predict(per_item, 8, 1).bound == pytest.approx(0.018 / 0.011)


def fake_run(regime: str, mode: str, seed: int, steps_per_s: float, reached: float | None, update_s: float) -> Run:
    """A run that advanced at ``steps_per_s`` and reached the target after ``reached`` seconds."""
    times = np.arange(1, 11, dtype=float)
    history = [
        {"global_step": int(256 * k), "time/wall_s": 256 * k / steps_per_s, "charts/episodic_return": 50.0 * k}
        for k in times
    ]
    result = SimpleNamespace(
        history=history,
        reached_target_s=reached,
        env_steps_per_s=steps_per_s,
        staleness_mean=0.5 if mode == "async" else 0.0,
    )
    staleness = np.array([5, 5]) if mode == "async" else np.array([10])
    return Run(regime, mode, seed, 20, result, [update_s] * 10, [update_s] * 10, staleness)


def test_summary_pairs_seeds_and_reports_the_bound(tmp_path) -> None:
    runs = []
    for seed, (sync_sps, async_sps) in enumerate([(100.0, 190.0), (110.0, 200.0), (90.0, 160.0)], start=1):
        runs.append(fake_run("b", "sync", seed, sync_sps, 40.0, 0.70))
        runs.append(fake_run("b", "async", seed, async_sps, 20.0 if seed != 3 else None, 0.75))
    stages = StageTimes(0.020, 0.0, 1e9, 0.002, 0.002)
    summary = summarize(REGIMES["b"], stages, runs)
    assert summary.stages.learn_s == pytest.approx(0.70)  # the sync runs' update time
    assert summary.learn_async_s == pytest.approx(0.75)
    assert summary.ratio == pytest.approx(np.median([1.9, 200 / 110, 160 / 90]))
    assert summary.prediction.bound == pytest.approx((32 * 0.022 + 0.7) / (32 * 0.022))
    assert summary.ttt_ratio == pytest.approx(2.0)  # seed 3 missed the target: left out
    assert summary.reached == "sync 3/3, async 2/3"
    assert summary.staleness_mean == pytest.approx(0.5)
    main_table, stage_table = pipeline.tables([summary], None)
    assert "| b. learner-bound" in main_table and "not reached" not in main_table.splitlines()[2]
    assert stage_table.count("\n") == 2
    paths = [
        pipeline.save_figure(name, figure, out_dir=tmp_path)
        for name, figure in zip(("throughput", "curves", "staleness"), pipeline.figures([summary]))
    ]
    assert all(path.stat().st_size > 1000 for path in paths)


def test_llm_regime_contract_computes_the_bound_from_stage_times(monkeypatch) -> None:
    module = SimpleNamespace(
        run=lambda quick, seeds: {
            "sync": {"throughput": 10.0, "time_to_target_s": 300.0},
            "async": {"throughput": 20.0, "time_to_target_s": 160.0},
            "stages": {"generate_s": 2.0, "reward_mean_s": 0.5, "reward_max_s": 3.0, "learn_s": 2.5},
        }
    )
    monkeypatch.setattr(pipeline.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setitem(__import__("sys").modules, "benchmarks.pipeline_llm", module)
    out = pipeline.llm_regime(pipeline.Args(quick=True))
    assert out["bound"] == pytest.approx((2.0 + 3.0 + 2.5) / 2.5)
    main_table, _ = pipeline.tables([], out)
    assert "d. LLM" in main_table
