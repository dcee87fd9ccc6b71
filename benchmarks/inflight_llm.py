"""In-flight weight updates vs update-after-batch vs sync: RLOO on a multi-turn text task with a slow
model whose completions are long and heavy-tailed.

RLOO (``asyncvec.agents.rloo``) plays ``asyncvec/FrozenLakeText-v0`` (4x4, 8 turns, 4 groups x 8
episodes per update, 32 envs, lr 1e-3, ``--gamma 1``, ``--kl-coef 0.05``, temperature 0.7) from a
supervised warm start on the env's expert whose every answer is followed by a lognormal number of
dots (median ``--tail-median``, shape ``--tail-sigma``): the action is the completion's first word,
and then the model goes on writing, as a reasoning model does, for a length it decides itself. The
completions the warm-started model samples are long and heavy-tailed (their quantiles are in the
report), and at most ``--max-new-tokens``. Three modes, the same seeds and warm start per seed:

* **in-flight**: ``--mode async --inflight-updates``: a publish reaches the engine between two
  decoding steps; a turn's tokens may come from several versions (per-token versions in the loss);
* **after-batch**: ``--mode async`` (the default): a publish waits for the running batches, and
  new ones wait for it (the engine drains);
* **sync**: ``--mode sync``: generate a batch, learn, publish, repeat.

The engine (``--backend vllm``, the default): an in-process ``VLLMPolicy`` with continuous admission
(``max_inflight_batches=--policy-inflight-batches``: turns that arrive while others run join the
engine between two steps), in float32 on the CPU. ``--backend hf`` runs ``HFTextPolicy`` instead, one
static batch at a time. The slow model: every engine step also waits a lognormal time (median
``--step-ms``, shape ``--step-sigma``) while it holds the engine (and, in flight, the weights), as a
remote accelerator's forward would; ``time.sleep`` uses no CPU, so the 2 shared cores stay for the
learner and the envs. Tokens, log-probs and weight swaps are real: the wait only adds latency.

Per mode (median and range over seeds): wall-clock seconds to the target (``--target-reward``:
the mean training reward of 10 updates reaches it and a batch sampled by the final weights
confirms it; the time counts from the first sample to the confirmation), generated tokens/s,
updates/s, the final training reward (mean of the last 10 updates), the share of trained
samples (turns) whose tokens span versions, and where the learner's time goes (waiting for a
batch, learning, publishing). The bound: the sync run's time per update split into generation
(its wait for a batch) and learning + publishing; a perfect pipeline costs per update the slower
of the two, so ``sync time / max(generation, learning)`` is the most any async mode can gain
over sync at the same number of updates.

Run: ``python benchmarks/inflight_llm.py`` (3 seeds, about 30 minutes on 2 shared cores);
writes ``benchmarks/results/inflight_llm.{md,png,json}``. ``--quick`` runs a short smoke
version (tiny model, 2 updates per mode, one seed) into ``--out-dir``.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import tyro

import asyncvec.envs  # noqa: F401  (registers the ids)
from asyncvec.agents import reinforce_pp, rloo
from asyncvec.benchmarks.report import RESULTS_DIR, machine_line, markdown_table, new_figure, save_report
from asyncvec.inference import HFTextPolicy, VLLMPolicy, build_tiny_lm
from asyncvec.inference.types import BackendResult, TextPrompt
from asyncvec.lm import load_causal_lm, sft_warm_start, text_space
from asyncvec.lm.prompts import expert_conversations

MODES = {
    "in-flight updates": {"mode": "async", "inflight_updates": True},
    "update after batch": {"mode": "async", "inflight_updates": False},
    "sync": {"mode": "sync", "inflight_updates": False},
}
"""The three modes: the ``rloo.Args`` fields that differ."""

COLUMNS = [
    "mode", "time to target s (median)", "range", "reached", "tokens/s", "updates/s", "final reward",
    "spanning samples", "completion tokens p50/p90/max", "wait s/update", "learn s/update", "publish s/update",
    "vs after-batch",
]  # fmt: skip
"""The columns of the result table (tests/test_benchmarks_inflight.py checks them)."""


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds: each gets its own warm start, shared by the three modes"""
    agent: Literal["rloo", "reinforce_pp"] = "rloo"
    """the learner: RLOO (lr 1e-3) or REINFORCE++ (its own defaults: lr 5e-4, 2 epochs, clip 0.2)"""
    backend: Literal["vllm", "hf"] = "vllm"
    """the engine: in-process vLLM with continuous admission, or transformers (one static batch at a time)"""
    policy_batch_size: int = 1
    """requests per batch: 1 lets each turn join and leave the engine on its own (continuous batching)"""
    policy_inflight_batches: int = 32
    """vllm: batches sharing the engine at once (continuous admission; with --policy-batch-size 1, the turns)"""
    kl_coef: float = 0.05
    """KL penalty against the warm-started model"""
    step_ms: float = 10.0
    """median wait added to every engine step (lognormal)"""
    step_sigma: float = 0.3
    """lognormal shape of a step's wait"""
    tail_median: float = 4.0
    """warm start: median number of dots after each expert answer (the completions' length)"""
    tail_sigma: float = 1.0
    """warm start: lognormal shape of that number (1.0: p99 about 10x the median)"""
    max_updates: int = 60
    """updates at most per run (a run stops earlier at the target)"""
    target_reward: float = 0.9
    """the training reward to reach (as tests/test_multiturn_learning.py)"""
    warm_start_steps: int = 60
    """supervised steps on the expert before RL"""
    max_new_tokens: int = 96
    """completion limit per turn"""
    max_positions: int = 512
    """the model's context (a prompt over it drops its oldest turns)"""
    num_envs: int = 32
    """envs playing at once (their turns reach the engine batched)"""
    prefetch_updates: int = 1
    """async modes: updates' worth of episodes generated ahead of the learner"""
    modes: list[str] = field(default_factory=lambda: list(MODES))
    """which of the modes to run (default all three: "in-flight updates", "update after batch", "sync")"""
    quick: bool = False
    """a seconds-long smoke run: a 1-layer model, 2 updates per mode, one seed, no target"""
    out_dir: str | None = None
    """where the report goes (default benchmarks/results)"""
    name: str = "inflight_llm"
    """the report's file name: <name>.md, .png, .json"""
    from_json: str | None = None
    """rebuild the report from a former run's <name>.json (its runs, setting and loads) instead of running"""


class SlowSteps:
    """A slow engine: every decoding step also waits a lognormal time; counts the tokens generated
    and keeps each completion's length. Mixed into a text policy (`SlowHFTextPolicy`, `SlowVLLMPolicy`)."""

    def _init_slow(self, step_ms: float, step_sigma: float, wait_seed: int) -> None:
        if step_ms < 0 or step_sigma < 0:
            raise ValueError(f"{type(self).__name__}: step_ms and step_sigma must be >= 0, got {step_ms}, {step_sigma}")
        self.step_s, self.step_sigma = step_ms / 1000.0, step_sigma
        self._wait_rng = np.random.default_rng(wait_seed)
        self._count_lock = threading.Lock()
        self.generated_tokens = 0
        self.completion_lengths: list[int] = []
        self.step_waits_s: list[float] = []

    def _step_wait(self) -> None:
        with self._count_lock:
            wait = float(self.step_s * np.exp(self.step_sigma * self._wait_rng.standard_normal()))
            self.step_waits_s.append(wait)
        time.sleep(wait)

    def _count(self, results: list[BackendResult]) -> list[BackendResult]:
        lengths = [len(result.token_ids or ()) for result in results]
        with self._count_lock:
            self.generated_tokens += sum(lengths)
            self.completion_lengths.extend(lengths)
        return results


class SlowHFTextPolicy(SlowSteps, HFTextPolicy):
    """``HFTextPolicy`` whose decoding steps each also wait a lognormal time (inside the step: with
    ``inflight_updates`` a publish waits for it, without it the whole batch holds the weights anyway).

    Example:
        >>> folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
        >>> with SlowHFTextPolicy(folder, action_parser=str, action_space=text_space(), step_ms=5, max_new_tokens=3,
        ...                       seed=0) as policy:
        ...     out = policy.submit("3+4=").result(timeout=30)
        >>> policy.generated_tokens == len(out.token_ids) and len(policy.step_waits_s) >= 1
        True
    """

    def __init__(self, *args: Any, step_ms: float, step_sigma: float = 0.0, wait_seed: int = 0, **kwargs: Any) -> None:
        self._init_slow(step_ms, step_sigma, wait_seed)
        super().__init__(*args, **kwargs)

    @contextlib.contextmanager
    def _decoding_step(self) -> Iterator[int]:
        with super()._decoding_step() as version:
            self._step_wait()
            yield version

    def _forward_batch(self, prompts: list[TextPrompt]) -> list[BackendResult]:
        return self._count(super()._forward_batch(prompts))


class SlowVLLMPolicy(SlowSteps, VLLMPolicy):
    """``VLLMPolicy`` whose engine steps each also wait a lognormal time, holding the engine (and, with
    ``inflight_updates``, the weights) as a slow accelerator's forward would."""

    def __init__(self, *args: Any, step_ms: float, step_sigma: float = 0.0, wait_seed: int = 0, **kwargs: Any) -> None:
        self._init_slow(step_ms, step_sigma, wait_seed)
        super().__init__(*args, **kwargs)

    def _engine_step(self) -> list[Any]:
        outputs = super()._engine_step()
        self._step_wait()
        return outputs

    def _forward_batch(self, prompts: list[TextPrompt]) -> list[BackendResult]:
        return self._count(super()._forward_batch(prompts))


AGENTS: dict[str, Any] = {"rloo": (rloo.Args, rloo.RLOO), "reinforce_pp": (reinforce_pp.Args, reinforce_pp.ReinforcePP)}
"""``--agent``: its options class and its learner."""


def frozen_lake_args(args: Args, seed: int, model: Path, mode: str) -> Any:
    """The agent's options of one run."""
    updates = 2 if args.quick else args.max_updates
    options, _ = AGENTS[args.agent]
    own = {"learning_rate": 1e-3} if args.agent == "rloo" else {}
    return options(
        model=str(model), env="asyncvec/FrozenLakeText-v0", env_kwargs=json.dumps({"max_turns": 8}),
        on_overflow="drop_oldest", max_new_tokens=args.max_new_tokens, num_envs=8 if args.quick else args.num_envs,
        prefetch_updates=args.prefetch_updates, policy_inflight_batches=args.policy_inflight_batches,
        policy_batch_size=args.policy_batch_size,
        total_prompts=4 * updates, prompts_per_update=4, group_size=2 if args.quick else 8, gamma=1.0,
        target_reward=None if args.quick else args.target_reward, kl_coef=args.kl_coef,
        temperature=0.7, eval_prompts=0, progress=False, seed=seed, timeout_s=300.0, **own, **MODES[mode],
    )  # fmt: skip


def warm_start(folder: Path, seed: int, args: Args) -> Path:
    """A tiny char-level GPT-2 after the supervised warm start on the expert's answers, each followed by
    a lognormal number of dots (``--tail-median``, ``--tail-sigma``; at most ``--max-new-tokens`` - 8)."""
    width, layers = (32, 1) if args.quick else (64, 2)
    base = build_tiny_lm(folder / "base", n_layer=layers, n_embd=width, max_positions=args.max_positions, seed=0)
    rng = np.random.default_rng(seed)

    def with_tail(answer: str) -> str:
        dots = args.tail_median * np.exp(args.tail_sigma * rng.standard_normal())
        return answer + "." * int(min(dots, args.max_new_tokens - 8))

    examples = expert_conversations(
        frozen_lake_args(args, seed, base, "sync"), load_causal_lm(base)[1], args.max_positions, render_answer=with_tail
    )
    return sft_warm_start(base, folder / f"sft{seed}", examples, 2 if args.quick else args.warm_start_steps, seed=seed)


def make_policy(args: Args, options: Any, model: Path, seed: int) -> Any:
    """The slow engine of one run (``--backend``)."""
    common = {
        "step_ms": args.step_ms, "step_sigma": args.step_sigma, "wait_seed": seed, "action_space": text_space(),
        "max_new_tokens": options.max_new_tokens, "temperature": options.temperature,
        "max_batch_size": min(options.policy_batch_size, options.num_envs), "max_wait_ms": options.policy_wait_ms,
        "inflight_updates": options.inflight_updates,
    }  # fmt: skip
    if args.backend == "hf":
        return SlowHFTextPolicy(*load_causal_lm(model), str, seed=seed, **common)
    engine = {"dtype": "float32", "max_model_len": args.max_positions, "enforce_eager": True, "seed": seed}
    return SlowVLLMPolicy(
        model, str, engine_kwargs=engine, max_inflight_batches=options.policy_inflight_batches, **common
    )


def run_one(args: Args, seed: int, model: Path, mode: str) -> dict[str, Any]:
    """One RLOO run; what the table needs, and its reward curve over wall-clock time."""
    options = frozen_lake_args(args, seed, model, mode)
    with make_policy(args, options, model, seed) as policy:
        result = AGENTS[args.agent][1](options, policy=policy).train()
        tokens, lengths = policy.generated_tokens, list(policy.completion_lengths)
        swaps = policy.stats().get("inflight_swaps", 0)
    history = result.history
    stage = {
        name: float(np.mean([row.get(f"time/{name}_s", np.nan) for row in history]))
        for name in ("wait", "learn", "publish")
    }
    rewards = [row["reward"] for row in history]
    quantiles = np.percentile(lengths, [50, 90, 99]).tolist() if lengths else [float("nan")] * 3
    return {
        "mode": mode, "seed": seed, "updates": result.updates, "wall_s": result.wall_time_s,
        "reached": result.reached_target, "time_to_target_s": result.wall_time_s if result.reached_target else None,
        "tokens": tokens, "tokens_per_s": tokens / result.wall_time_s, "updates_per_s": result.updates / result.wall_time_s,
        "final_reward": float(np.mean(rewards[-10:])) if rewards else float("nan"),
        "confirmations": result.target_confirmations, "spanning_fraction": result.spanning_fraction,
        "stale_fraction": result.stale_fraction, "inflight_swaps": swaps, "stages_s": stage,
        "completion_tokens": {"p50": quantiles[0], "p90": quantiles[1], "p99": quantiles[2],
                              "max": max(lengths, default=0), "mean": float(np.mean(lengths)) if lengths else float("nan")},
        "curve": [(row["time/wall_s"], row["reward"]) for row in history],
    }  # fmt: skip


def training_target_s(curve: list[tuple[float, float]], target: float, window: int = 10) -> float:
    """Wall-clock seconds of the first update whose mean training reward over ``window`` updates reaches
    ``target`` (the run's own stop criterion before its confirming batch); NaN if none did.

    Example:
        >>> training_target_s([(1.0, 0.5), (2.0, 1.0), (3.0, 1.0)], target=0.8, window=2)
        3.0
    """
    rewards = [reward for _, reward in curve]
    for index in range(window - 1, len(curve)):
        if np.mean(rewards[index - window + 1 : index + 1]) >= target:
            return float(curve[index][0])
    return float("nan")


def _median_range(values: list[float]) -> tuple[float, str]:
    if not values:
        return float("nan"), "n/a"
    return statistics.median(values), f"{min(values):.0f}-{max(values):.0f}"


def summarize(runs: list[dict[str, Any]]) -> tuple[list[list[Any]], dict[str, Any]]:
    """The table's rows (one per mode, medians over seeds) and the bound from the sync runs.

    Example:
        >>> run = {"time_to_target_s": 10.0, "reached": True, "tokens_per_s": 5.0, "updates_per_s": 1.0,
        ...        "final_reward": 0.9, "spanning_fraction": 0.0, "wall_s": 10.0, "updates": 10,
        ...        "completion_tokens": {"p50": 8, "p90": 40, "max": 96},
        ...        "stages_s": {"wait": 0.6, "learn": 0.3, "publish": 0.1}}
        >>> rows, bound = summarize([{**run, "mode": mode} for mode in MODES])
        >>> [len(row) for row in rows] == [len(COLUMNS)] * 3, round(bound["speedup_bound"], 2)
        (True, 1.67)
    """
    rows, medians = [], {}
    for mode in MODES:
        mine = [run for run in runs if run["mode"] == mode]
        if not mine:
            continue
        times = [run["time_to_target_s"] for run in mine if run["reached"]]
        median, spread = _median_range(times)
        medians[mode] = median
        med = {key: statistics.median(run[key] for run in mine)
               for key in ("tokens_per_s", "updates_per_s", "final_reward", "spanning_fraction")}  # fmt: skip
        stages = {
            name: statistics.median(run["stages_s"][name] for run in mine) for name in ("wait", "learn", "publish")
        }
        lengths = {key: statistics.median(run.get("completion_tokens", {}).get(key, float("nan")) for run in mine)
                   for key in ("p50", "p90", "max")}  # fmt: skip
        rows.append([
            mode, median, spread, f"{len(times)}/{len(mine)}", med["tokens_per_s"], med["updates_per_s"],
            med["final_reward"], med["spanning_fraction"], f"{lengths['p50']:.0f}/{lengths['p90']:.0f}/{lengths['max']:.0f}",
            stages["wait"], stages["learn"], stages["publish"], mode,
        ])  # fmt: skip
    base = medians.get("update after batch", float("nan"))
    for row in rows:  # speed to target relative to update-after-batch (time ratio)
        row[-1] = base / row[1] if row[1] == row[1] and row[1] > 0 else float("nan")
    sync = [run for run in runs if run["mode"] == "sync"]
    bound: dict[str, Any] = {"speedup_bound": float("nan")}
    if sync:
        per_update = statistics.median(run["wall_s"] / max(run["updates"], 1) for run in sync)
        generation = statistics.median(run["stages_s"]["wait"] for run in sync)
        learning = statistics.median(run["stages_s"]["learn"] + run["stages_s"]["publish"] for run in sync)
        bound = {
            "sync_s_per_update": per_update,
            "generation_s": generation,
            "learning_s": learning,
            "speedup_bound": per_update / max(generation, learning, 1e-9),
        }
    after = [run for run in runs if run["mode"] == "update after batch"]
    inflight = [run for run in runs if run["mode"] == "in-flight updates"]
    if after and inflight:
        # what in-flight updates can save: the learner's wait in publish (for the running batch, after-batch;
        # for one decoding step, in flight), per update, against after-batch's time per update
        per_update = statistics.median(run["wall_s"] / max(run["updates"], 1) for run in after)
        saved = statistics.median(run["stages_s"]["publish"] for run in after) - statistics.median(
            run["stages_s"]["publish"] for run in inflight
        )
        bound.update(after_s_per_update=per_update, publish_saved_s=saved,
                     inflight_bound=per_update / max(per_update - max(saved, 0.0), 1e-9))  # fmt: skip
    return rows, bound


def plot(runs: list[dict[str, Any]], target: float) -> Any:
    fig, ax = new_figure(width=7.0)
    colors = dict(zip(MODES, ["tab:blue", "tab:orange", "tab:gray"], strict=True))
    for index, run in enumerate(runs):
        if not run["curve"]:
            continue
        times, rewards = zip(*run["curve"], strict=True)
        smooth = np.convolve(rewards, np.ones(5) / 5, mode="valid") if len(rewards) >= 5 else np.asarray(rewards)
        ax.plot(times[len(times) - len(smooth):], smooth, color=colors[run["mode"]], alpha=0.8,
                label=run["mode"] if all(r["mode"] != run["mode"] for r in runs[:index]) else None)  # fmt: skip
    ax.axhline(target, color="black", ls="--", lw=0.8, label=f"target {target:g}")
    ax.set_xlabel("wall-clock s (from the first sample)")
    ax.set_ylabel("training reward (mean of 5 updates)")
    ax.legend()
    return fig


def main(args: Args) -> dict[str, Any]:
    torch.set_num_threads(1)
    unknown = [mode for mode in args.modes if mode not in MODES]
    if unknown or not args.modes:
        raise ValueError(f"--modes must name some of {list(MODES)}, got {args.modes!r}")
    seeds = args.seeds[:1] if args.quick else args.seeds
    setting = (
        f"{'RLOO (lr 1e-3)' if args.agent == 'rloo' else 'REINFORCE++ (its defaults)'} on asyncvec/FrozenLakeText-v0 (4x4, 8 turns), tiny GPT-2 (2 layers x 64, {args.max_positions} "
        f"positions) after {args.warm_start_steps} supervised warm-start steps per seed on the expert's answers each "
        f"followed by lognormal(median {args.tail_median:g}, sigma {args.tail_sigma:g}) dots; 4 groups x 8 episodes "
        f"per update, {args.num_envs} envs (async: {args.prefetch_updates} update(s) ahead), kl 0.05, "
        f"temperature 0.7, max_new_tokens {args.max_new_tokens}; at most {args.max_updates} "
        f"updates, stop at training reward {args.target_reward:g} (10-update mean, confirmed by a fresh batch; "
        f"'reached' counts confirmed runs, the per-run table also gives when the 10-update mean got there); engine: "
        + (
            f"in-process vLLM (float32, CPU), up to {args.policy_inflight_batches} batches sharing it "
            "(continuous admission)"
            if args.backend == "vllm"
            else "transformers (HFTextPolicy), one static batch at a time"
        )
        + f"; every engine step waits lognormal median {args.step_ms:g} ms sigma {args.step_sigma:g} (the slow "
        f"model); seeds {seeds}, the modes interleaved per seed"
    )
    if args.quick:
        setting = (
            f"--quick smoke run (1-layer model, 2 updates per mode, 8 envs, groups of 2; not a measurement): {setting}"
        )
    command = "python benchmarks/inflight_llm.py " + " ".join(sys.argv[1:]) if __name__ == "__main__" else ""
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        return report(
            args,
            saved["setting"],
            saved["machine"],
            saved["runs"],
            (saved.get("command") or "python benchmarks/inflight_llm.py")
            + f" (report rebuilt: --from-json {args.from_json})",
        )
    print(f"{setting}\nMachine: {machine_line()}", flush=True)
    loads, runs = [machine_line()], []
    with tempfile.TemporaryDirectory(prefix="inflight-llm-") as scratch:
        for seed in seeds:
            model = warm_start(Path(scratch) / f"seed{seed}", seed, args)
            for mode in args.modes:
                run = run_one(args, seed, model, mode)
                runs.append(run)
                loads.append(machine_line())
                print(
                    f"seed {seed} {mode}: {run['updates']} updates, {run['wall_s']:.1f} s, reached {run['reached']}, "
                    f"final {run['final_reward']:.2f}, {run['tokens_per_s']:.0f} tokens/s, spanning "
                    f"{run['spanning_fraction']:.3f}, stages {run['stages_s']} | {loads[-1]}", flush=True,
                )  # fmt: skip
    return report(args, setting, loads, runs, command)


def report(args: Args, setting: str, loads: list[str], runs: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """The table, the reading, ``<name>.json``, ``.md`` and ``.png`` of the runs."""
    rows, bound = summarize(runs)
    table = markdown_table(COLUMNS, rows)
    reading = (
        f"Bound (from the sync runs): {bound.get('sync_s_per_update', float('nan')):.2f} s per sync update = "
        f"generation {bound.get('generation_s', float('nan')):.2f} s + learning and publishing "
        f"{bound.get('learning_s', float('nan')):.2f} s; a perfect pipeline would take the slower of the two, "
        f"{bound['speedup_bound']:.2f}x faster than sync per update."
    )
    if "inflight_bound" in bound:
        reading += (
            f" In-flight updates save the learner's wait in publish: after-batch takes "
            f"{bound['after_s_per_update']:.2f} s per update, of which in-flight saves "
            f"{bound['publish_saved_s']:.3f} s (the publish's wait for the running batch less its wait for one step), "
            f"so at the same number of updates in-flight can be at most {bound['inflight_bound']:.2f}x after-batch."
        )
    print(f"\n{table}\n\n{reading}", flush=True)
    folder = Path(args.out_dir) if args.out_dir is not None else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{args.name}.json").write_text(
        json.dumps(
            {"setting": setting, "machine": loads, "bound": bound, "runs": runs, "command": command},
            indent=1,
            default=str,
        )
    )
    per_run = markdown_table(
        ["seed", "mode", "updates", "wall s", "s/update", "reached (confirmed)", "10-update mean at target, s",
         "final reward", "tokens/s", "spanning", "in-flight swaps", "completion tokens p50/p90/p99/max"],
        [[r["seed"], r["mode"], r["updates"], r["wall_s"], r["wall_s"] / max(r["updates"], 1), r["reached"],
          training_target_s(r["curve"], args.target_reward), r["final_reward"], r["tokens_per_s"],
          r["spanning_fraction"], r["inflight_swaps"], "/".join(
              f"{r.get('completion_tokens', {}).get(k, float('nan')):.0f}" for k in ("p50", "p90", "p99", "max"))]
         for r in runs],
    )  # fmt: skip
    save_report(
        args.name, table, plot(runs, args.target_reward), out_dir=folder, command=command,
        notes=f"{setting}.\n\n{reading}\n\nLoad during the runs: " + "; ".join(loads) + f"\n\n{per_run}",
    )  # fmt: skip
    return {"rows": rows, "bound": bound, "runs": runs, "table": table}


if __name__ == "__main__":
    main(tyro.cli(Args))
