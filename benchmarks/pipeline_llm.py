"""The LLM regime of the pipeline benchmark: RLOO on a real vLLM server with a heavy-tailed
reward latency, sync vs async, against the bound computed from measured stage times.

Run: ``python benchmarks/pipeline_llm.py`` (about 10 minutes on 2 cores: a supervised warm
start, a vLLM server start, the stage measurements, then sync and async RLOO runs interleaved
over ``--rounds``). ``benchmarks/pipeline.py --regimes d`` runs :func:`main` (one round per seed)
and puts its result in the pipeline table.

The reward is ``exact_answer`` behind a remote-call latency drawn from a lognormal
distribution (median ``--reward-median-ms``, shape ``--reward-sigma``): an async scorer, as by
a remote reward model or a tool. The agent scores with ``REWARD_WORKERS`` calls at a time and no
score cache (on SingleDigitSums most completions repeat, and a cache would skip the latency), as
the bound's reward stage is measured.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncvec.agents import rloo  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.inference import OpenAIPolicy, VLLMServer, build_tiny_lm, fit_batch_cost  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.lm import (  # noqa: E402  (after the repository is put on sys.path)
    quiet_model_libraries,
    rewards,  # noqa: E402  (after the repository is put on sys.path)
    sft_warm_start,
)
from asyncvec.lm.prompts import completion_with_answer, iter_prompts, make_prompt_env, solved_prompts  # noqa: E402  (after the repository is put on sys.path)

ENV = "asyncvec/SingleDigitSums-v0"


#: scorer calls at a time, in the runs and in the bound's reward stage
REWARD_WORKERS = 4


class LognormalLatencyReward:
    """``exact_answer`` after an ``asyncio.sleep`` of lognormal length; records every latency (s).

    Example:
        >>> reward = LognormalLatencyReward(median_ms=1.0, sigma=1.0, seed=0)
        >>> asyncio.run(reward("3+4=", "7")), len(reward.latencies)
        (1.0, 1)
    """

    def __init__(self, median_ms: float, sigma: float, seed: int = 0) -> None:
        self.median_s = median_ms / 1000.0
        self.sigma = sigma
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self.latencies: list[float] = []

    async def __call__(self, prompt: str, completion: str, **info: Any) -> float:
        with self._lock:
            latency = float(self.median_s * np.exp(self.sigma * self._rng.standard_normal()))
            self.latencies.append(latency)
        await asyncio.sleep(latency)
        return rewards.exact_answer(prompt, completion)


def _percentiles_ms(values: list[float]) -> dict[str, float]:
    seconds = np.asarray(values, dtype=np.float64)
    return {
        "mean_ms": float(seconds.mean() * 1000),
        "p50_ms": float(np.percentile(seconds, 50) * 1000),
        "p90_ms": float(np.percentile(seconds, 90) * 1000),
        "p99_ms": float(np.percentile(seconds, 99) * 1000),
        "max_ms": float(seconds.max() * 1000),
    }


def _generation_costs(base_url: str, model_name: str, prompts: list[str], sizes: list[int], repeats: int) -> dict:
    """Seconds of one batched generation call (one HTTP request) for each batch size, and the a + b*B fit."""
    seconds: dict[int, float] = {}
    with OpenAIPolicy(
        base_url,
        model_name,
        completion_with_answer,
        server_kind="vllm",
        max_new_tokens=4,
        max_batch_size=max(sizes),
        max_wait_ms=1.0,
        fallback=lambda obs, env_id: "",
    ) as policy:
        policy.act(prompts[:8], timeout=120)  # warm-up
        for size in sizes:
            batch = [prompts[i % len(prompts)] for i in range(size)]
            times = []
            for _ in range(repeats):
                start = time.monotonic()
                policy.act(batch, timeout=120)
                times.append(time.monotonic() - start)
            seconds[size] = statistics.median(times)
    a, b = fit_batch_cost(list(seconds), list(seconds.values()))
    return {"batch_sizes": list(seconds), "seconds": list(seconds.values()), "a_s": a, "b_s": b}


def _reward_makespan(plugin_name: str, prompts: list[str], batch: int, repeats: int) -> float:
    """Median seconds until all ``batch`` completions submitted at once are scored."""
    times = []
    with rewards.RewardService(plugin_name, timeout_s=60.0, num_workers=REWARD_WORKERS, cache_size=0) as service:
        for _ in range(repeats):
            start = time.monotonic()
            futures = [service.submit(prompts[i % len(prompts)], "0") for i in range(batch)]
            for future in futures:
                future.result(timeout=120)
            times.append(time.monotonic() - start)
    return statistics.median(times)


def llm_bound(generation_s: float, reward_s: float, learn_s: float, publish_s: float) -> dict[str, float]:
    """Seconds per update of the sync loop and of an ideal async pipeline, and their ratio.

    Sync runs the stages one after the other: ``T_sync = G + R + L + P`` (generation of the
    update's completions, the slowest of their rewards, the learner update, publishing the
    weights). Async overlaps them; the slowest resource sets the pace: the server generates
    and loads weights (``G + P``, a publish pauses generation), the learner learns and
    publishes (``L + P``), and rewards are scored concurrently, one batch's makespan ``R`` per
    update at worst. ``bound = T_sync / max(G + P, L + P, R)`` is the most async can gain.

    Example:
        >>> llm_bound(generation_s=0.2, reward_s=0.5, learn_s=0.1, publish_s=0.2)["bound"]
        2.0
    """
    sync = generation_s + reward_s + learn_s + publish_s
    ideal = max(generation_s + publish_s, learn_s + publish_s, reward_s)
    return {"sync_update_s": sync, "async_update_s": ideal, "bound": sync / ideal}


def llm_regime(
    *,
    base_url: str | None = None,
    model_dir: str | None = None,
    served_model: str | None = None,
    rounds: int = 2,
    target_reward: float = 0.8,
    max_prompts: int = 4800,
    prompts_per_update: int = 16,
    group_size: int = 8,
    prefetch_updates: int = 2,
    reward_median_ms: float = 50.0,
    reward_sigma: float = 1.0,
    sft_steps: int = 400,
    seed: int = 0,
    repeats: int = 3,
) -> dict[str, Any]:
    """RLOO on a vLLM server with a lognormal reward latency, sync vs async, with its bound.

    Starts a vLLM server (``VLLMServer``) on a tiny GPT-2 after ``sft_steps`` of supervised
    warm start, unless ``base_url`` names a running vLLM server (started with
    ``VLLM_SERVER_DEV_MODE=1``) of ``model_dir`` under the name ``served_model`` (default: the
    folder's name); each run first sends its starting weights to it. Runs ``rounds`` x (sync,
    async) RLOO runs from the
    same model (order alternating per round), each until the mean reward of 10 updates reaches
    ``target_reward`` or ``max_prompts`` prompts are used, and measures the stages.

    Returns:
        A plain dict::

            {
              "regime": "llm",
              "setup": {...the arguments...},
              "modes": {"sync" | "async": {
                  "completions_per_s": median over rounds,
                  "time_to_target_s": median wall-clock to target_reward (nan if a round missed it),
                  "reached": rounds that reached it, "updates": median updates,
                  "runs": [{"completions_per_s", "time_to_target_s", "updates", "final_reward", ...}]}},
              "stages": {
                  "generation": {"batch_sizes": [...], "seconds": [...], "a_s", "b_s"},  # one call vs B
                  "reward_latency": {"mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"},  # per completion
                  "reward_makespan_s": the slowest of one update's rewards, all submitted at once,
                  "learner_update_s": median learner update, "publish_s": median weight publish},
              "bound": {"sync_update_s", "async_update_s", "bound"},  # see llm_bound
              "ratio": async / sync completions/s, "time_to_target_ratio": sync / async time to target,
              "ratio_over_bound": ratio / bound,
            }
    """
    quiet_model_libraries()
    setup = dict(locals())
    plugin_name = f"pipeline_llm_lognormal_{id(setup)}"
    scorer = LognormalLatencyReward(reward_median_ms, reward_sigma, seed)
    rewards.register(plugin_name)(scorer)
    server = None
    try:
        with tempfile.TemporaryDirectory(prefix="asyncvec-pipeline-llm-") as work:
            work_dir = Path(work)
            if model_dir is None:
                base = build_tiny_lm(work_dir / "base", n_layer=2, n_embd=64, seed=seed)
                model_dir = str(sft_warm_start(base, work_dir / "sft", solved_prompts(ENV, seed), sft_steps, seed=seed))
            if base_url is None:
                server = VLLMServer(model_dir, max_model_len=128, seed=seed).start()
                base_url, served_model = server.url, server.served_model_name
            served_model = served_model or Path(model_dir).name
            with make_prompt_env(ENV) as env:
                prompts = list(itertools.islice(iter_prompts(env, seed + 7), 256))
            batch = prompts_per_update * group_size
            sizes = sorted({group_size, batch // 4, batch, 2 * batch})
            generation = _generation_costs(base_url, served_model, prompts, sizes, repeats)
            makespan = _reward_makespan(plugin_name, prompts, batch, repeats)
            runs: dict[str, list[dict]] = {"sync": [], "async": []}
            learn, publish = [], []
            for round_index in range(rounds):
                for mode in ("sync", "async") if round_index % 2 == 0 else ("async", "sync"):
                    args = rloo.Args(
                        model=model_dir,
                        backend="openai",
                        server_kind="vllm",
                        base_url=base_url,
                        served_model=served_model,
                        weights_dir=str(work_dir / "weights"),
                        reward=plugin_name,
                        reward_timeout_s=60.0,
                        reward_workers=REWARD_WORKERS,
                        reward_cache_size=0,
                        mode=mode,
                        total_prompts=max_prompts,
                        prompts_per_update=prompts_per_update,
                        group_size=group_size,
                        prefetch_updates=prefetch_updates,
                        max_staleness=prefetch_updates + 2,
                        target_reward=target_reward,
                        eval_prompts=0,
                        progress=False,
                        seed=seed + round_index,
                    )
                    result = rloo.RLOO(args).train()
                    wall_to_target = result.history[-1]["time/wall_s"] if result.reached_target else float("nan")
                    runs[mode].append(
                        {
                            "completions_per_s": result.samples_per_s,
                            "time_to_target_s": wall_to_target,
                            "reached": result.reached_target,
                            "updates": result.updates,
                            "final_reward": float(np.mean(result.reward_curve[-10:])),
                            "wall_s": result.wall_time_s,
                            "stale_fraction": result.stale_fraction,
                            "staleness_mean": result.staleness_mean,
                        }
                    )
                    learn += [row["time/learn_s"] for row in result.history]
                    if mode == "sync":
                        publish += [row["time/publish_s"] for row in result.history]
                    print(f"round {round_index} {mode}: {runs[mode][-1]}", flush=True)
            stages = {
                "generation": generation,
                "reward_latency": _percentiles_ms(scorer.latencies),
                "reward_makespan_s": makespan,
                "learner_update_s": statistics.median(learn),
                "publish_s": statistics.median(publish),
            }
    finally:
        if server is not None:
            server.stop()
        rewards.unregister(plugin_name)
    generation_s = generation["a_s"] + generation["b_s"] * prompts_per_update * group_size
    bound = llm_bound(generation_s, makespan, stages["learner_update_s"], stages["publish_s"])
    modes = {
        mode: {
            "completions_per_s": statistics.median(r["completions_per_s"] for r in rs),
            "time_to_target_s": (
                statistics.median(r["time_to_target_s"] for r in rs) if all(r["reached"] for r in rs) else float("nan")
            ),
            "reached": sum(r["reached"] for r in rs),
            "updates": statistics.median(r["updates"] for r in rs),
            "runs": rs,
        }
        for mode, rs in runs.items()
    }
    ratio = modes["async"]["completions_per_s"] / modes["sync"]["completions_per_s"]
    return {
        "regime": "llm",
        "setup": setup,
        "modes": modes,
        "stages": stages,
        "bound": bound,
        "ratio": ratio,
        "time_to_target_ratio": modes["sync"]["time_to_target_s"] / modes["async"]["time_to_target_s"],
        "ratio_over_bound": ratio / bound["bound"],
    }


@dataclass
class Args:
    """RLOO on a vLLM server with a heavy-tailed reward latency: sync vs async against the bound."""

    rounds: int = 2
    """sync and async runs per mode, interleaved"""
    target_reward: float = 0.8
    """a run stops once the mean reward of 10 updates reaches this"""
    max_prompts: int = 4800
    """prompts per run at most"""
    reward_median_ms: float = 50.0
    """median reward latency"""
    reward_sigma: float = 1.0
    """lognormal shape of the reward latency (1.0: p99 is about 10x the median)"""
    prefetch_updates: int = 2
    """async: updates' worth of prompts generated ahead of the learner"""
    sft_steps: int = 400
    """supervised warm start before RL"""
    seed: int = 0
    """seed of the model, the warm start and the runs"""
    out_dir: str | None = None
    """where pipeline_llm.md/.png go (default benchmarks/results)"""


def main(args: Args, command: str = "python benchmarks/pipeline_llm.py") -> dict[str, Any]:
    """Runs :func:`llm_regime`, prints its table and stage times, writes ``pipeline_llm.md`` and ``.png``."""
    from asyncvec.benchmarks.report import machine_line, markdown_table, new_figure, save_report

    print(f"machine: {machine_line()}", flush=True)
    result = llm_regime(
        rounds=args.rounds,
        target_reward=args.target_reward,
        max_prompts=args.max_prompts,
        reward_median_ms=args.reward_median_ms,
        reward_sigma=args.reward_sigma,
        prefetch_updates=args.prefetch_updates,
        sft_steps=args.sft_steps,
        seed=args.seed,
    )
    stages, bound, modes = result["stages"], result["bound"], result["modes"]
    table = markdown_table(
        ["mode", "completions/s", f"time to reward {args.target_reward:g} (s)", "reached", "updates"],
        [
            [mode, m["completions_per_s"], m["time_to_target_s"], f"{m['reached']}/{args.rounds}", m["updates"]]
            for mode, m in modes.items()
        ],
    )
    gen = stages["generation"]
    latency = stages["reward_latency"]
    notes = "\n".join(
        [
            f"- generation, one request of B completions: {gen['a_s'] * 1000:.0f} ms + {gen['b_s'] * 1000:.2f} ms x B "
            f"(B = {gen['batch_sizes']}: {[round(s * 1000) for s in gen['seconds']]} ms)",
            f"- reward latency per completion: median {latency['p50_ms']:.0f} ms, p90 {latency['p90_ms']:.0f} ms, "
            f"p99 {latency['p99_ms']:.0f} ms, max {latency['max_ms']:.0f} ms; one update's makespan "
            f"{stages['reward_makespan_s']:.2f} s",
            f"- learner update {stages['learner_update_s']:.3f} s, publish (server reload) {stages['publish_s']:.3f} s",
            f"- seconds per update: sync {bound['sync_update_s']:.2f}, ideal async {bound['async_update_s']:.2f}",
            f"- async/sync completions/s {result['ratio']:.2f}x, time to target {result['time_to_target_ratio']:.2f}x, "
            f"bound {bound['bound']:.2f}x, ratio/bound {result['ratio_over_bound']:.2f}",
        ]
    )
    print(table + "\n\n" + notes)
    figure, axes = new_figure(ncols=2)
    rates, parts = np.ravel(axes)
    rates.bar(list(modes), [m["completions_per_s"] for m in modes.values()], color=["tab:gray", "tab:blue"])
    rates.axhline(modes["sync"]["completions_per_s"] * bound["bound"], color="tab:red", linestyle="--", label="bound")
    rates.set_ylabel("completions/s")
    rates.legend()
    generation_s = (
        bound["sync_update_s"] - stages["reward_makespan_s"] - stages["learner_update_s"] - stages["publish_s"]
    )
    names = ["generation", "reward (makespan)", "learner update", "publish"]
    values = [generation_s, stages["reward_makespan_s"], stages["learner_update_s"], stages["publish_s"]]
    parts.barh(names, values)
    parts.set_xlabel("seconds per update (measured stages)")
    save_report("pipeline_llm", table, figure, out_dir=args.out_dir, command=command, notes=notes)
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
