"""benchmarks/pipeline.py: the bound model, and the summary, tables and plots from recorded runs.

The PPO runs themselves take minutes, so they are measured by the benchmark, not here; these
tests keep the arithmetic and the report code honest with hand-made runs.
"""

from __future__ import annotations

import doctest
from types import SimpleNamespace

import numpy as np
import pytest

from asyncvec.benchmarks import pipeline, pipeline_llm
from asyncvec.benchmarks.pipeline import REGIMES, Run, StageTimes, predict, summarize


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


def llm_result(rounds: int) -> dict:
    """A result in ``benchmarks.pipeline_llm.llm_regime``'s shape: async 1.8x the completions/s, 2x faster."""

    def mode(rate: float, time_to_target: float) -> dict:
        run = {"completions_per_s": rate, "time_to_target_s": time_to_target, "reached": True, "updates": 30}
        run |= {"final_reward": 0.85, "wall_s": time_to_target, "stale_fraction": 0.1, "staleness_mean": 0.5}
        summary = {"completions_per_s": rate, "time_to_target_s": time_to_target, "reached": rounds, "updates": 30}
        return summary | {"runs": [run] * rounds}

    generation = {"batch_sizes": [8, 32, 128, 256], "seconds": [0.2, 0.3, 0.6, 1.0], "a_s": 0.2, "b_s": 0.003}
    latency = {"mean_ms": 80.0, "p50_ms": 50.0, "p90_ms": 180.0, "p99_ms": 500.0, "max_ms": 900.0}
    bound = pipeline_llm.llm_bound(generation_s=0.584, reward_s=0.9, learn_s=0.5, publish_s=0.1)
    return {
        "regime": "llm",
        "setup": {"reward_median_ms": 50.0, "reward_sigma": 1.0, "target_reward": 0.8},
        "modes": {"sync": mode(100.0, 200.0), "async": mode(180.0, 100.0)},
        "stages": {
            "generation": generation,
            "reward_latency": latency,
            "reward_makespan_s": 0.9,
            "learner_update_s": 0.5,
            "publish_s": 0.1,
        },
        "bound": bound,
        "ratio": 1.8,
        "time_to_target_ratio": 2.0,
        "ratio_over_bound": 1.8 / bound["bound"],
    }


def test_regime_d_runs_pipeline_llm_one_round_per_seed_and_reports_its_row(monkeypatch, tmp_path) -> None:
    """Regime d goes through pipeline_llm's main (its table and PNG) with the seeds as rounds; the LLM
    runs themselves (a vLLM server) are replaced by a recorded result here and measured by the benchmark."""
    calls = []

    def recorded_llm_regime(**kwargs):
        calls.append(kwargs)
        return llm_result(kwargs["rounds"])

    monkeypatch.setattr(pipeline_llm, "llm_regime", recorded_llm_regime)
    out = pipeline.llm_regime(pipeline.Args(seeds=[4, 5], llm_max_prompts=640, out_dir=str(tmp_path)))
    assert (calls[0]["rounds"], calls[0]["seed"], calls[0]["max_prompts"]) == (2, 4, 640)
    assert (tmp_path / "pipeline_llm.md").exists() and (tmp_path / "pipeline_llm.png").stat().st_size > 1000
    # sync G + R + L + P against async max(G + P, L + P, R): here the reward makespan R paces async
    assert out["bound"]["bound"] == pytest.approx((0.584 + 0.9 + 0.5 + 0.1) / 0.9)
    main_table, _ = pipeline.tables([], out)
    row = main_table.splitlines()[2].split(" | ")
    assert row[0].startswith("| d. LLM") and row[1:4] == ["100", "180", "1.80"]
    assert row[5] == f"{1.8 / out['bound']['bound']:.2f}"
    assert row[6:10] == ["200", "100", "2.00", "sync 2/2, async 2/2"]
