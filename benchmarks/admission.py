"""Staleness at admission vs drop-after: what each trains on when completion lengths are heavy-tailed.

RLOO (``asyncvec.agents.rloo``, async mode) learns a one-step text task whose answers have
heavy-tailed lengths: the prompt ``"k:"`` asks for the first ``k`` digits of ``1234567890123...``
(exact match, reward 1), ``k`` drawn from ``P(k) ~ k^-a`` on ``1..--max-length`` (``--zipf-exponent``):
most answers are a few characters, a few are long. Scoring is slow in proportion to the length
(``--score-ms-per-token`` per token of the completion, a ``time.sleep`` in the reward plugin: a reward
model or a tool whose cost grows with the text, or an engine where a completion finishes in time
proportional to its tokens), on ``--reward-workers`` threads, so a long completion's group completes
late. Two runs per seed, the same options but one (``--max-staleness``, ``--prefetch-updates``):

* **drop**: ``--staleness-control drop``: generate ``--prefetch-updates`` ahead, train on groups as
  they complete, drop those more than ``--max-staleness`` versions old;
* **admission**: ``--staleness-control admission``: start a prompt only once it cannot be more than
  ``--max-staleness`` versions old when trained on; train on groups in prompt order.

Both start from the same supervised warm start per seed (``--sft-steps`` on the env's answers, a share
``1 - --sft-correct`` of them 1 or 2 characters off), which leaves the model writing about the right
length and often a wrong one: RL sharpens it (RLOO, ``--group-size`` completions per prompt). Per run: the completion
lengths (tokens, eos included) of what reached the learner ("generated") and of what it trained on,
mean (sum of tokens / sum of samples over the run) and p90 over all of the run's samples (collected
by the benchmark's learner, and checked against the library's ``length/*`` totals in the history),
the share of samples discarded as stale, and the wall-clock seconds and updates until the 10-update
mean training reward reaches ``--target-reward`` and a fresh batch confirms it. Medians and ranges over
the seeds.

Run: ``python benchmarks/admission.py`` (5 seeds, about 3 minutes on 2 cores); writes
``benchmarks/results/admission.{md,png,json}``. ``--quick`` is a short smoke run (one seed, a
smaller model, a few updates, no target) into ``--out-dir``.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gymnasium as gym
import numpy as np
import torch
import tyro
from gymnasium import spaces

from asyncvec.agents import rloo
from asyncvec.benchmarks.report import RESULTS_DIR, markdown_table, new_figure, save_report
from asyncvec.inference import build_tiny_lm
from asyncvec.lm import quiet_model_libraries, rewards, sft_warm_start
from asyncvec.lm.evaluation import TARGET_WINDOW

ENV_ID = "HeavyTailLengths-v0"
"""The benchmark's prompt env (registered when this module is imported)."""
ENV_SPEC = "asyncvec.benchmarks.admission:" + ENV_ID
"""``--env`` of the runs: importing this module registers the env."""
REWARD_NAME = "admission_benchmark_slow_exact_length"
"""The reward plugin of the runs (registered by :func:`register_slow_exact_length`)."""
MODES = ("drop", "admission")
"""``--staleness-control`` of the two runs per seed, in the table's order."""
COLUMNS = [
    "mode", "generated mean", "trained mean", "trained/generated", "generated p90", "trained p90",
    "discarded stale", "time to target s", "updates to target", "reached", "s/update", "final reward",
]  # fmt: skip
"""The columns of the summary table (tests/test_benchmarks_admission.py checks them)."""
DIGITS = "1234567890"


def answer_of(length: int) -> str:
    """The correct answer to ``"k:"``: the first ``k`` digits of ``1234567890`` repeated.

    Example:
        >>> answer_of(3), answer_of(12)
        ('123', '123456789012')
    """
    return (DIGITS * (length // len(DIGITS) + 1))[:length]


def zipf_weights(max_length: int, exponent: float) -> np.ndarray:
    """``P(k) ~ k^-exponent`` on ``1..max_length``, normalized.

    Example:
        >>> [round(float(p), 2) for p in zipf_weights(3, 1.0)]
        [0.55, 0.27, 0.18]
    """
    weights = np.arange(1, max_length + 1, dtype=float) ** -exponent
    return weights / weights.sum()


def exact_length_answer(prompt: str, completion: str, **info: Any) -> float:
    """1.0 when ``completion`` (stripped) is the answer to ``prompt`` (``"k:"``), else 0.0.

    Example:
        >>> exact_length_answer("4:", "1234"), exact_length_answer("4:", "12345")
        (1.0, 0.0)
    """
    return float(completion.strip() == answer_of(int(prompt.rstrip(":"))))


class HeavyTailLengthsEnv(gym.Env[str, str]):
    """One-step text task: the prompt ``"k:"`` asks for :func:`answer_of` ``(k)``; reward 1.0 for the
    exact answer (:func:`exact_length_answer`). ``k`` follows ``P(k) ~ k^-zipf_exponent`` on
    ``1..max_length``: most answers are short, a few long.

    Example:
        >>> env = HeavyTailLengthsEnv(max_length=24)
        >>> prompt, _ = env.reset(seed=0)
        >>> prompt, env.step(answer_of(int(prompt[:-1])))[1]
        ('4:', 1.0)
    """

    metadata = {"render_modes": [], "multi_turn": False}

    def __init__(self, max_length: int = 24, zipf_exponent: float = 1.2) -> None:
        if max_length < 1 or zipf_exponent <= 0:
            raise ValueError(f"max_length must be >= 1 and zipf_exponent > 0, got {max_length}, {zipf_exponent}")
        self.weights = zipf_weights(max_length, zipf_exponent)
        self.observation_space = spaces.Text(min_length=2, max_length=len(str(max_length)) + 1, charset=DIGITS + ":")
        self.action_space = spaces.Text(min_length=0, max_length=max_length + 8, charset=DIGITS)
        self._prompt: str | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._prompt = f"{1 + int(self.np_random.choice(len(self.weights), p=self.weights))}:"
        return self._prompt, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._prompt is None:
            raise gym.error.ResetNeeded("HeavyTailLengthsEnv: call reset() before step() (episodes last one step)")
        prompt, self._prompt = self._prompt, None
        return prompt, exact_length_answer(prompt, action), True, False, {}


if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point=HeavyTailLengthsEnv)


def register_slow_exact_length(ms_per_token: float) -> str:
    """Registers (or replaces) :data:`REWARD_NAME`: :func:`exact_length_answer` after a sleep of
    ``ms_per_token`` per character of the completion plus one for its eos (the char-level model's
    tokens): scoring cost grows with the length. Returns the name.

    Example:
        >>> rewards.score(register_slow_exact_length(0.0), "2:", "12")
        1.0
    """

    def slow_exact_length(prompt: str, completion: str, **info: Any) -> float:
        time.sleep(ms_per_token * (len(completion) + 1) / 1000.0)
        return exact_length_answer(prompt, completion)

    rewards.register(REWARD_NAME, replace=True)(slow_exact_length)
    return REWARD_NAME


def noisy_answers(max_length: int, zipf_exponent: float, correct_share: float, seed: int) -> Iterator[tuple[str, str]]:
    """Endless ``(prompt, answer)`` pairs of the env for :func:`asyncvec.lm.sft_warm_start`: the right
    answer with probability ``correct_share``, else one 1 or 2 characters too short or too long, so the
    warm-started model writes about the right length and RL has the exact one to learn.

    Example:
        >>> next(noisy_answers(24, 1.2, correct_share=1.0, seed=0))
        ('4:', '1234')
    """
    env = HeavyTailLengthsEnv(max_length, zipf_exponent)
    rng = np.random.default_rng(seed + 10**6)
    prompt, _ = env.reset(seed=seed)
    while True:
        length = int(prompt[:-1])
        if rng.random() >= correct_share:
            length = max(1, length + int(rng.choice([-2, -1, 1, 2])))
        yield prompt, answer_of(length)
        prompt, _ = env.reset()


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    """seeds: each gets its own warm start, shared by the two modes"""
    max_staleness: int = 1
    """--max-staleness of both modes"""
    prefetch_updates: int = 2
    """--prefetch-updates of both modes (drop generates this far ahead; admission's bound is tighter)"""
    max_length: int = 24
    """longest answer (characters); --max-new-tokens is this + 2"""
    zipf_exponent: float = 1.2
    """answer lengths: P(k) ~ k^-a on 1..--max-length"""
    score_ms_per_token: float = 20.0
    """scoring sleeps this long per completion token (its cost grows with length)"""
    reward_workers: int = 64
    """scorer threads (sleeping ones use no CPU): scoring overlaps"""
    prompts_per_update: int = 8
    """prompts (groups) per update"""
    group_size: int = 8
    """completions per prompt"""
    learning_rate: float = 1e-3
    """Adam learning rate of RLOO"""
    sft_steps: int = 200
    """supervised warm-start steps (batches of 32) before RL"""
    sft_correct: float = 0.5
    """share of the warm start's answers that are right (the others 1 or 2 characters off)"""
    target_reward: float = 0.75
    """stop once the 10-update mean training reward reaches this and a fresh batch confirms it"""
    max_updates: int = 200
    """updates at most per run"""
    quick: bool = False
    """a short smoke run: one seed, a 1-layer model after 20 supervised steps, 4 updates per mode, no target"""
    out_dir: str | None = None
    """where the report goes (default benchmarks/results)"""
    name: str = "admission"
    """the report's file name: <name>.md, .png, .json"""


class LengthRecordingRLOO(rloo.RLOO):
    """RLOO that keeps the length (tokens) of every completion that reached the learner and of every
    one it trained on (``compute_advantages`` sees exactly the trained rows), for run-wide quantiles."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.generated_lengths: list[int] = []
        self.trained_lengths: list[int] = []

    def update(self, groups: Any) -> dict[str, float]:
        for group in groups.completions:  # what length/generated_* counts: all but deadline misses
            self.generated_lengths += [len(s.output.token_ids or ()) for s in group if not s.missed_deadline]
        return super().update(groups)

    def compute_advantages(self, data: Any, logp: torch.Tensor, ref_logp: torch.Tensor | None) -> torch.Tensor:
        self.trained_lengths += data.mask.sum(-1).tolist()
        return super().compute_advantages(data, logp, ref_logp)


def command_line(args: Args) -> str:
    """The command that reruns ``args``: the script and the options that differ from the defaults
    (``--out-dir`` left out).

    Example:
        >>> command_line(Args(prefetch_updates=1, seeds=[1, 2], quick=True, out_dir="/tmp/x"))
        'python benchmarks/admission.py --seeds 1 2 --prefetch-updates 1 --quick'
    """
    defaults, words = Args(), ["python benchmarks/admission.py"]
    for name, value in asdict(args).items():
        if name == "out_dir" or value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words.append(f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}")
    return " ".join(words)


def run_args(args: Args, seed: int, model: Path, mode: str) -> rloo.Args:
    """The RLOO options of one run: the two modes differ in ``staleness_control`` only."""
    updates = 4 if args.quick else args.max_updates
    return rloo.Args(
        model=str(model), env=ENV_SPEC,
        env_kwargs=json.dumps({"max_length": args.max_length, "zipf_exponent": args.zipf_exponent}),
        reward=REWARD_NAME, reward_workers=args.reward_workers, reward_cache_size=0,
        max_new_tokens=args.max_length + 2, mode="async", staleness_control=mode,
        max_staleness=args.max_staleness, prefetch_updates=args.prefetch_updates,
        prompts_per_update=args.prompts_per_update, group_size=args.group_size,
        total_prompts=args.prompts_per_update * updates, learning_rate=args.learning_rate,
        target_reward=None if args.quick else args.target_reward, eval_prompts=0,
        progress=False, track=False, seed=seed, timeout_s=120.0,
    )  # fmt: skip


def warm_start(args: Args, folder: Path, seed: int) -> Path:
    """A tiny char-level GPT-2 after ``--sft-steps`` supervised steps on the env's answers, some of them
    a little off (:func:`noisy_answers`)."""
    layers, width = (1, 32) if args.quick else (2, 64)
    base = build_tiny_lm(folder / "base", n_layer=layers, n_embd=width, max_positions=64, seed=seed)
    examples = noisy_answers(args.max_length, args.zipf_exponent, args.sft_correct, seed)
    steps = 20 if args.quick else args.sft_steps
    return sft_warm_start(base, folder / f"sft{seed}", examples, steps, batch_size=32, seed=seed)


def run_one(args: Args, seed: int, model: Path, mode: str) -> dict[str, Any]:
    """One RLOO run: its lengths, discards, time and updates to the target, and reward curve."""
    agent = LengthRecordingRLOO(run_args(args, seed, model, mode))
    result = agent.train()
    history = result.history
    totals = {key: sum(row[f"length/{key}"] for row in history)
              for key in ("generated_tokens", "generated_samples", "trained_tokens", "trained_samples")}  # fmt: skip
    generated, trained = agent.generated_lengths, agent.trained_lengths
    if (sum(generated), len(generated), sum(trained), len(trained)) != tuple(int(v) for v in totals.values()):
        raise RuntimeError(f"{mode}: the lengths recorded here disagree with the history's length/* totals {totals}")
    received = sum(row["samples_received"] for row in history)
    rewards_seen = [row["reward"] for row in history]
    return {
        "mode": mode, "seed": seed, "updates": result.updates, "wall_s": result.wall_time_s,
        "reached": result.reached_target,
        "time_to_target_s": result.wall_time_s if result.reached_target else None,
        "updates_to_target": result.updates if result.reached_target else None,
        "generated_mean": totals["generated_tokens"] / max(totals["generated_samples"], 1),
        "trained_mean": totals["trained_tokens"] / max(totals["trained_samples"], 1),
        "generated_p90": float(np.percentile(generated, 90)) if generated else float("nan"),
        "trained_p90": float(np.percentile(trained, 90)) if trained else float("nan"),
        "discarded_stale": sum(row["stale_samples"] for row in history) / max(received, 1),
        "samples_received": received, "final_reward": float(np.mean(rewards_seen[-10:])),
        "curve": [(row["time/wall_s"], row["reward"]) for row in history],
        "length_curve": [(row["length/generated_mean"], row["length/trained_mean"]) for row in history],
        "generated_lengths": generated, "trained_lengths": trained,
    }  # fmt: skip


def without_lengths(run: dict[str, Any]) -> dict[str, Any]:
    """A run's record without its per-sample length lists."""
    return {key: value for key, value in run.items() if key not in ("generated_lengths", "trained_lengths")}


def length_counts(run: dict[str, Any]) -> dict[str, list[int]]:
    """How many samples of each length (index: tokens) a run generated and trained on (the JSON keeps these).

    Example:
        >>> length_counts({"generated_lengths": [1, 3, 3], "trained_lengths": [1]})
        {'generated': [0, 1, 0, 2], 'trained': [0, 1]}
    """
    return {
        name: np.bincount(np.asarray(run[f"{name}_lengths"], dtype=int)).tolist() for name in ("generated", "trained")
    }


def median_range(values: list[float], digits: int = 1) -> str:
    """``median (min-max)`` of ``values``; ``n/a`` when empty. An infinite value (a run that never reached
    the target) counts as the largest and shows as ``not reached``.

    Example:
        >>> median_range([3.0, 1.0, 2.0]), median_range([]), median_range([1.0, 2.0, math.inf])
        ('2.0 (1.0-3.0)', 'n/a', '2.0 (1.0-not reached)')
    """

    def shown(value: float) -> str:
        return "not reached" if math.isinf(value) else f"{value:.{digits}f}"

    if not values:
        return "n/a"
    if len(values) == 1:
        return shown(values[0])
    return f"{shown(statistics.median(values))} ({shown(min(values))}-{shown(max(values))})"


def summarize(runs: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per mode: medians (and ranges) over the seeds.

    Example:
        >>> run = {"generated_mean": 5.0, "trained_mean": 4.0, "generated_p90": 12.0, "trained_p90": 9.0,
        ...        "discarded_stale": 0.2, "reached": True, "time_to_target_s": 30.0, "updates_to_target": 40,
        ...        "wall_s": 30.0, "updates": 40, "final_reward": 0.7}
        >>> rows = summarize([{**run, "mode": mode} for mode in MODES])
        >>> [row[0] for row in rows], rows[0][3]
        (['drop', 'admission'], '0.800')
    """
    rows = []
    for mode in MODES:
        mine = [run for run in runs if run["mode"] == mode]
        if not mine:
            continue
        ratio = [run["trained_mean"] / run["generated_mean"] for run in mine]
        reached = [run for run in mine if run["reached"]]
        rows.append([
            mode, median_range([run["generated_mean"] for run in mine], 2),
            median_range([run["trained_mean"] for run in mine], 2), median_range(ratio, 3),
            median_range([run["generated_p90"] for run in mine]), median_range([run["trained_p90"] for run in mine]),
            median_range([100 * run["discarded_stale"] for run in mine]) + " %",
            median_range([run["time_to_target_s"] if run["reached"] else math.inf for run in mine]),
            median_range([run["updates_to_target"] if run["reached"] else math.inf for run in mine], 0),
            f"{len(reached)}/{len(mine)}",
            median_range([run["wall_s"] / max(run["updates"], 1) for run in mine], 2),
            median_range([run["final_reward"] for run in mine], 2),
        ])  # fmt: skip
    return rows


def per_seed_table(runs: list[dict[str, Any]]) -> str:
    """Every run on its own row."""
    headers = ["mode", "seed", "generated mean", "trained mean", "generated p90", "trained p90", "discarded stale",
               "time to target s", "updates to target", "wall s", "updates", "s/update", "final reward"]  # fmt: skip
    rows = [
        [run["mode"], run["seed"], run["generated_mean"], run["trained_mean"], run["generated_p90"],
         run["trained_p90"], f"{100 * run['discarded_stale']:.1f} %",
         "n/a" if run["time_to_target_s"] is None else f"{run['time_to_target_s']:.1f}",
         "n/a" if run["updates_to_target"] is None else run["updates_to_target"], run["wall_s"], run["updates"],
         run["wall_s"] / max(run["updates"], 1), run["final_reward"]]
        for run in sorted(runs, key=lambda run: (MODES.index(run["mode"]), run["seed"]))
    ]  # fmt: skip
    return markdown_table(headers, rows)


def plot(runs: list[dict[str, Any]], target: float) -> Any:
    """Left: the length distributions generated vs trained on per mode; middle: reward over time; right:
    the mean length generated per update (what the policy writes as it learns)."""
    fig, axes = new_figure(ncols=3, width=5.0)
    lengths_ax, reward_ax, drift_ax = axes[0]
    colors = {"drop": "tab:orange", "admission": "tab:blue"}
    for mode in MODES:
        generated = [n for run in runs if run["mode"] == mode for n in run["generated_lengths"]]
        trained = [n for run in runs if run["mode"] == mode for n in run["trained_lengths"]]
        for values, style, what in ((generated, ":", "generated"), (trained, "-", "trained on")):
            if values:
                ordered = np.sort(values)
                survival = 1.0 - np.arange(len(ordered)) / len(ordered)
                lengths_ax.step(ordered, survival, ls=style, color=colors[mode], label=f"{mode}: {what}")
    lengths_ax.set_yscale("log")
    lengths_ax.set_xlabel("completion tokens")
    lengths_ax.set_ylabel("share of samples with at least this length")
    lengths_ax.legend()
    for index, run in enumerate(runs):
        if len(run["curve"]) >= TARGET_WINDOW:
            times, values = zip(*run["curve"], strict=True)
            smooth = np.convolve(values, np.ones(TARGET_WINDOW) / TARGET_WINDOW, mode="valid")
            first = all(other["mode"] != run["mode"] for other in runs[:index])
            reward_ax.plot(times[TARGET_WINDOW - 1 :], smooth, color=colors[run["mode"]], alpha=0.8,
                           label=run["mode"] if first else None)  # fmt: skip
    reward_ax.axhline(target, color="black", ls="--", lw=0.8, label=f"target {target:g}")
    reward_ax.set_xlabel("wall-clock s")
    reward_ax.set_ylabel(f"training reward (mean of {TARGET_WINDOW} updates)")
    reward_ax.legend()
    for index, run in enumerate(runs):
        if len(run["length_curve"]) >= TARGET_WINDOW:
            generated = [mean for mean, _ in run["length_curve"]]
            smooth = np.convolve(generated, np.ones(TARGET_WINDOW) / TARGET_WINDOW, mode="valid")
            first = all(other["mode"] != run["mode"] for other in runs[:index])
            drift_ax.plot(np.arange(TARGET_WINDOW, len(generated) + 1), smooth, color=colors[run["mode"]],
                          alpha=0.8, label=run["mode"] if first else None)  # fmt: skip
    drift_ax.set_xlabel("update")
    drift_ax.set_ylabel(f"generated mean tokens (mean of {TARGET_WINDOW} updates)")
    if drift_ax.get_legend_handles_labels()[0]:  # a quick run has fewer updates than the window
        drift_ax.legend()
    return fig


def main(args: Args) -> dict[str, Any]:
    """Runs both modes per seed, prints and writes the report; returns its rows, tables and runs."""
    quiet_model_libraries()
    torch.set_num_threads(1)
    register_slow_exact_length(args.score_ms_per_token)
    seeds = args.seeds[:1] if args.quick else args.seeds
    runs = []
    with tempfile.TemporaryDirectory(prefix="asyncvec-admission-") as work:
        for seed in seeds:
            model = warm_start(args, Path(work) / f"seed{seed}", seed)
            for mode in MODES:
                run = run_one(args, seed, model, mode)
                runs.append(run)
                print(f"seed {seed} {mode}: {run['updates']} updates in {run['wall_s']:.1f} s, "
                      f"generated mean {run['generated_mean']:.2f}, trained mean {run['trained_mean']:.2f}, "
                      f"discarded {100 * run['discarded_stale']:.1f} %, reached {run['reached']}", flush=True)  # fmt: skip
    rows = summarize(runs)
    table = markdown_table(COLUMNS, rows)
    per_seed = per_seed_table(runs)
    print(table, "\n", per_seed, sep="\n")
    command = command_line(args)
    setting = (
        f"RLOO (async, lr {args.learning_rate:g}) on the prompt 'k:' -> the first k digits of 1234567890..., "
        f"P(k) ~ k^-{args.zipf_exponent:g} on 1..{args.max_length}, exact match; scoring sleeps "
        f"{args.score_ms_per_token:g} ms per completion token on {args.reward_workers} threads (no cache); "
        f"{args.prompts_per_update} prompts x {args.group_size} completions per update, --max-staleness "
        f"{args.max_staleness}, --prefetch-updates {args.prefetch_updates}; tiny char-level GPT-2 "
        f"({'1 x 32' if args.quick else '2 x 64'}) after {20 if args.quick else args.sft_steps} supervised steps per seed; "
        f"seeds {seeds}. Lengths in tokens (eos included). Means: sum of tokens / sum of samples over the run; p90 "
        "over all of a run's samples; 'generated': what reached the learner. Target: 10-update mean training "
        f"reward {args.target_reward:g}, confirmed by a fresh batch; time to target: the run's wall time (from the "
        "start of generation to the confirming batch); a run that did not reach it counts as slower than all that "
        "did. Cells: median (range) over seeds."
    )
    notes = f"{setting}\n\nPer run:\n\n{per_seed}"
    out_dir = Path(args.out_dir) if args.out_dir is not None else RESULTS_DIR
    save_report(args.name, table, plot(runs, args.target_reward), out_dir=out_dir, command=command, notes=notes)
    saved = [{**without_lengths(run), "length_counts": length_counts(run)} for run in runs]
    (out_dir / f"{args.name}.json").write_text(json.dumps({"args": asdict(args), "runs": saved}), encoding="utf-8")
    return {"rows": rows, "table": table, "per_seed": per_seed, "runs": runs}


if __name__ == "__main__":
    main(tyro.cli(Args))
