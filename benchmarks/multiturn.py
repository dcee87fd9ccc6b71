"""Multi-turn LM episodes: turn-level lockstep (sync) vs per-env turns (async), against a bound.

A simulated language model plays ``asyncvec/GuessNumber-v0`` in ``--num-envs`` envs of an
``AsyncLLMVectorEnv`` through ``asyncvec.lm.EpisodeCollector``:

* the model (``SimulatedLM``, a ``TextPolicy``): a random guess padded to a completion of
  lognormal length (median ``--median-tokens``), a batch costs ``a + per_token * longest
  completion`` (autoregressive decoding waits for the batch's longest sequence); it sleeps, as
  a remote engine would;
* the env: each step sleeps a heavy-tailed lognormal latency (``envs.slow.SlowEnv``, mean
  ``--env-latency-ms``, sigma ``--env-sigma``), as a tool or a remote simulator would.

**sync** (``lockstep=True``): all envs generate turn t, then all step; a round of episodes ends
with its longest episode. **async**: each env asks for its next turn when its step returns, the
waiting turns are batched, an env whose episode ended starts the next one at once. The async
run's batcher holds a lone turn up to ``--hold-ms`` (8 ms) for a second one (``DynamicBatcher``'s
``hold_ms``; a call of one costs c(1) = 32 ms of a call slot for one turn, a call of two 36 ms for
two) and sends two or more at once (``--max-wait-ms 0``); lockstep keeps ``max_wait_ms=1`` and no
hold (it submits all its turns at once).

The bound on async episodes/s, from stage times (``c(B)``: the mean cost of a model call of B
prompts. A call's time is mostly its draw, the longest of its completions, so c(B) is not the mean
time of some timed calls of B (1.2-1.4 ms off with 60 of them, and the bound picked the luckiest
sizes): ``--stage-calls`` timed calls of each size B = 1..N, K at once as in the runs, measured
before and after the runs, and the async run's own calls give a fit of a call's time on its
longest completion (`fit_call_cost`), taken at the mean longest completion of B drawn from the
async run's completions (`expected_longest`); each ``c(B)`` is the cheapest of the fits before,
after and (for sizes of 20 or more calls) in the async run: load from other processes only makes
a stage dearer, and a cheaper stage only raises the bound; ``E[L]``: the mean latency the async
run's env steps drew, replayed from their reset seeds, plus a timed step's overshoot over its
draw; ``E[T]``: the mean turns per episode of the async run). A call's cost grows with its batch
(it waits for the batch's longest completion), so a turn cannot have both the latency of a call
of one and the engine's throughput with calls of N. Whatever the schedule, with ``x_B`` turns/s served in calls of B::

    sum_B x_B c(B) / B      <= K     the engine: at most K calls run at once
    sum_B x_B (c(B) + E[L]) <= N     the envs: each turn waits at least for its call and its step

and the bound is ``max sum_B x_B / E[T]`` (a linear program; its optimum mixes at most two batch
sizes, so every vertex is checked). It is a fluid bound: it assumes turns arrive exactly when a
call slot frees, never a queue. ``K = --inflight-batches`` model calls may run at once (a server
with continuous batching or several replicas); sync sends one batch per turn, so it cannot use
more than one. The earlier bound, ``min(N / (E[T] (c(1) + E[L])), K N / (E[T] c(N)))``, credited
every turn with the latency of a call of one and the engine with the throughput of calls of N at
the same time; it is printed too.

Each mode also reports where a turn's time goes (per env, ms per turn): the env step as the
collector saw it (IPC included), the model call of the turn's batch, the wait for a batch and a
call slot, and the rest (the collector's handling, resets, idle envs).

Run (about a minute): ``python benchmarks/multiturn.py``; writes ``benchmarks/results/multiturn.md``
and ``.png``.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gymnasium as gym
import numpy as np
import tyro

import asyncvec.envs  # noqa: F401  (registers asyncvec/GuessNumber-v0)
from asyncvec.benchmarks.report import machine_line, markdown_table, new_figure, save_report
from asyncvec.envs.slow import SlowEnv
from asyncvec.inference.text import TextPolicy
from asyncvec.inference.tiny_models import build_char_tokenizer
from asyncvec.inference.types import BackendResult, TextPrompt
from asyncvec.lm import Episode, EpisodeCollector, make_text_vector_env, text_space


@dataclass
class Args:
    num_envs: int = 16
    """envs (each a worker process)"""
    group_size: int = 2
    """episodes per reset seed"""
    rounds: int = 12
    """episodes measured per mode: rounds * num_envs"""
    max_number: int = 16
    """GuessNumber range"""
    max_turns: int = 6
    """GuessNumber turns per episode"""
    a_ms: float = 20.0
    """fixed cost of a model call"""
    per_token_ms: float = 2.0
    """cost per decoding step (the batch's longest completion)"""
    median_tokens: float = 4.0
    """median completion length (lognormal, sigma 0.8, at most --max-new-tokens)"""
    max_new_tokens: int = 24
    """completion limit"""
    inflight_batches: int = 4
    """model calls running at once (a server with continuous batching or replicas; sync sends one per turn)"""
    env_latency_ms: float = 30.0
    """mean env step latency (lognormal)"""
    env_sigma: float = 1.0
    """lognormal sigma of the env latency (1: p99 about 6x the median)"""
    max_wait_ms: float = 0.0
    """async: the batcher's max_wait_ms (lockstep keeps 1 ms: it submits its turns one by one, and with 0 the
    first would leave alone)"""
    hold_ms: float = 8.0
    """async: a model call of fewer than --hold-below turns waits up to this long (from its oldest turn) for more
    (the batcher's hold; lockstep sends all its turns at once and does not use it)"""
    hold_below: int = 2
    """async: calls smaller than this are held (see --hold-ms)"""
    seed: int = 0
    """seed of the runs"""
    stage_calls: int = 60
    """timed model calls per batch size B = 1..num_envs (for the bound), --inflight-batches at once"""
    out_dir: str | None = None
    """where multiturn.md/.png go (default benchmarks/results)"""


class SimulatedLM(TextPolicy):
    """A text policy with a known cost: random guesses as completions of lognormal length.

    Example:
        >>> with SimulatedLM(a_ms=1, per_token_ms=0.1, median_tokens=3, max_new_tokens=8) as lm:
        ...     out = lm.submit(TextPrompt((5, 6, 7))).result(timeout=10)
        >>> 1 <= len(out.token_ids) <= 8 and out.text.strip().isdigit()
        True
    """

    def __init__(
        self, *, a_ms: float, per_token_ms: float, median_tokens: float, max_new_tokens: int, max_number: int = 16,
        seed: int = 0, **kwargs: Any,
    ) -> None:  # fmt: skip
        kwargs.setdefault("action_space", text_space())
        super().__init__(str, max_new_tokens=max_new_tokens, **kwargs)
        self.tokenizer = build_char_tokenizer()
        self.a_ms, self.per_token_ms, self.median_tokens = a_ms, per_token_ms, median_tokens
        self.max_number = max_number
        self.rng = np.random.default_rng(seed)
        self.calls: list[tuple[int, int, float]] = []
        """(batch size, longest completion in tokens, seconds) of every call"""

    def _forward_batch(self, prompts: list[TextPrompt]) -> list[BackendResult]:
        started = time.perf_counter()
        texts = []
        for prompt in prompts:
            guess = str(int(self.rng.integers(1, self.max_number + 1)))
            length = int(np.clip(round(self.median_tokens * np.exp(0.8 * self.rng.standard_normal())), 1, 10**6))
            length = max(len(guess), min(length, prompt.max_new_tokens))
            texts.append(guess + " " * (length - len(guess)))
        longest = max(map(len, texts))
        time.sleep((self.a_ms + self.per_token_ms * longest) / 1000.0)
        results = []
        for text in texts:
            ids = self.tokenizer(text).input_ids
            results.append(self._text_result(text, ids, [-1.0] * len(ids)))
        self.calls.append((len(prompts), longest, time.perf_counter() - started))
        return results

    def _apply_weights(self, weights: Any, version: int) -> None:
        """Nothing to load: the simulated model has no weights."""


def make_env(args: Args, index: int) -> Any:
    def make() -> gym.Env:
        env = gym.make(
            "asyncvec/GuessNumber-v0", max_number=args.max_number, max_turns=args.max_turns, transcript=False,
            max_completion_length=64,
        )  # fmt: skip
        return SlowEnv(env, latency_ms=args.env_latency_ms, distribution="lognormal", sigma=args.env_sigma,
                       seed=args.seed * 1000 + index)  # fmt: skip

    return make


def make_policy(args: Args, hold: bool = False) -> SimulatedLM:
    """The simulated model; ``hold``: with the async run's batching settings (--max-wait-ms, --hold-ms)."""
    return SimulatedLM(
        a_ms=args.a_ms, per_token_ms=args.per_token_ms, median_tokens=args.median_tokens,
        max_new_tokens=args.max_new_tokens, max_number=args.max_number, seed=args.seed,
        max_batch_size=args.num_envs, max_wait_ms=args.max_wait_ms if hold else 1.0,
        max_inflight_batches=args.inflight_batches, batch_hold_ms=args.hold_ms if hold else 0.0,
        batch_hold_below=args.hold_below,
    )  # fmt: skip


def fit_call_cost(calls: list[tuple[int, int, float]]) -> np.ndarray:
    """Least squares ``seconds = a + b * longest + d * size`` over timed calls ``(size, longest, seconds)``:
    what a call costs once its completions are drawn (``d``: per-prompt work around the decoding).

    Example:
        >>> calls = [(s, n, 0.02 + 0.002 * n + 0.0001 * s) for s in (1, 2, 4) for n in (3, 5, 9)]
        >>> np.round(fit_call_cost(calls) * 1000, 3).tolist()
        [20.0, 2.0, 0.1]
    """
    sizes, longest, seconds = (np.asarray(column, dtype=float) for column in zip(*calls, strict=True))
    design = np.column_stack([np.ones_like(sizes), longest, sizes])
    return np.linalg.lstsq(design, seconds, rcond=None)[0]


def expected_longest(lengths: list[int], sizes: range, draws: int = 20000, seed: int = 0) -> dict[int, float]:
    """Mean longest completion of a call of B prompts, for each B in ``sizes``: B lengths drawn at a
    time from ``lengths`` (the completions of a run), as pipeline.py computes ``E[max_N L]``.

    Example:
        >>> expected_longest([2, 2, 2], range(1, 3))
        {1: 2.0, 2: 2.0}
    """
    rng, pool = np.random.default_rng(seed), np.asarray(lengths)
    return {b: float(pool[rng.integers(0, len(pool), (draws, b))].max(axis=1).mean()) for b in sizes}


def call_costs(fit: np.ndarray, longest: dict[int, float]) -> dict[int, float]:
    """``c(B) = a + b * E[longest of B] + d * B`` (see `fit_call_cost`, `expected_longest`)."""
    a, per_token, per_prompt = fit
    return {size: float(a + per_token * n + per_prompt * size) for size, n in longest.items()}


def measure_stages(args: Args) -> dict[str, Any]:
    """Timed model calls of B = 1..N prompts (``--stage-calls`` each, ``--inflight-batches`` at once
    as in the runs), their cost fitted against their longest completion (`fit_call_cost`), and the
    env step's overhead over its drawn latency (timed env steps).

    Why a fit and not the mean time of the calls of each size: a call's time is mostly its draw (the
    longest of its completions: 9-11 ms of standard deviation per call here), so the mean of 60
    calls of one size is 1.2-1.4 ms off its expectation, and a bound that takes the cheapest of
    several such means, and the best of 16 sizes, picks lucky draws (a simulation of that estimator
    put the bound 1.7% high on average; docs/benchmarks.md). Given its longest completion,
    a call's time varies by a fraction of a millisecond, so the fit is exact to a few
    microseconds; the draws then come from the run itself (`expected_longest`)."""
    with make_policy(args) as policy, ThreadPoolExecutor(args.inflight_batches) as pool:
        prompts = [TextPrompt((5, 6, 7), max_new_tokens=args.max_new_tokens)] * args.num_envs
        sizes = [b for b in range(1, args.num_envs + 1) for _ in range(args.stage_calls)]
        list(pool.map(lambda batch: policy.forward_batch(prompts[:batch]), sizes))
        timed = policy.calls  # (size, longest completion, seconds) of each call, as the runs record theirs
    means = {b: statistics.mean(s for size, _, s in timed if size == b) for b in range(1, args.num_envs + 1)}
    env = make_env(args, 10**6)()
    env.reset(seed=0)
    steps, drawn = [], []
    for _ in range(40):
        start = time.perf_counter()
        _, _, terminated, truncated, info = env.step("1")
        steps.append(time.perf_counter() - start)
        drawn.append(info["latency_ms"] / 1000.0)
        if terminated or truncated:
            env.reset()
    env.close()
    overhead = statistics.mean(steps) - statistics.mean(drawn)  # sleep overshoot and the step itself
    return {"fit": fit_call_cost(timed), "mean_call_s": means, "env_overhead_s": overhead}


def drawn_latencies_s(args: Args, episodes: list[Episode]) -> list[float]:
    """The env latencies the run's steps drew: ``SlowEnv`` draws them from the reset seed, so a fresh
    env reset with an episode's seed draws its steps' latencies again, in order."""
    env = make_env(args, 0)()
    latencies = []
    for episode in episodes:
        env.reset(seed=episode.seed)
        latencies += [env.sample_latency_ms() / 1000.0 for _ in range(episode.num_turns)]
    env.close()
    return latencies


def fluid_bound(call_s: dict[int, float], env_s: float, num_envs: int, inflight: int) -> tuple[float, str]:
    """Most turns/s of any schedule (see the module docstring) and the batch sizes it uses.

    ``max sum_B x_B`` s.t. ``sum_B x_B c(B)/B <= K`` and ``sum_B x_B (c(B) + L) <= N``: two
    constraints, so an optimal vertex has at most two sizes; every one is checked.

    Example:
        >>> round(fluid_bound({1: 0.03, 2: 0.036}, env_s=0.03, num_envs=4, inflight=1)[0], 1)
        55.6
    """
    best, how = 0.0, ""
    for size, c in call_s.items():  # one size, whichever constraint binds
        turns = min(inflight * size / c, num_envs / (c + env_s))
        if turns > best:
            best, how = turns, f"calls of {size}"
    for (b1, c1), (b2, c2) in itertools.combinations(call_s.items(), 2):  # two sizes, both constraints bind
        g1, g2, h1, h2 = c1 / b1, c2 / b2, c1 + env_s, c2 + env_s
        det = g1 * h2 - g2 * h1
        if det == 0:
            continue
        x1, x2 = (inflight * h2 - num_envs * g2) / det, (num_envs * g1 - inflight * h1) / det
        if x1 >= 0 and x2 >= 0 and x1 + x2 > best:
            best, how = (
                x1 + x2,
                f"{x1 / (x1 + x2):.0%} of turns in calls of {b1}, {x2 / (x1 + x2):.0%} in calls of {b2}",
            )
    return best, how


def run_mode(args: Args, lockstep: bool) -> dict[str, float]:
    vec = make_text_vector_env([make_env(args, i) for i in range(args.num_envs)])
    episodes = args.rounds * args.num_envs
    try:
        with (
            make_policy(args, hold=not lockstep) as policy,
            EpisodeCollector(vec, policy, args.group_size, lockstep=lockstep, seed=args.seed) as collector,
        ):
            per_round, measured = args.num_envs // args.group_size, episodes // args.group_size
            # steady state: groups keep starting while the measured ones run (no tail of idle envs)
            collector.start(per_round * (args.rounds + 3), ahead=measured + per_round)
            collector.pop(per_round, timeout=600)  # warm-up: workers, first batches
            before, calls_before, taken_before = policy.stats(), len(policy.calls), collector.stats()["turns"]
            start = time.perf_counter()
            batch = collector.pop(measured, timeout=600)
            elapsed = time.perf_counter() - start
            after, calls, taken = policy.stats(), policy.calls[calls_before:], collector.stats()["turns"] - taken_before
    finally:
        vec.close()
    episodes = [e for group in batch.episodes for e in group]
    turns = [e.num_turns for e in episodes]
    steps = [t for e in episodes for t in e.turns]
    batches = after["batches"] - before["batches"]
    items = after["mean_batch_size"] * after["batches"] - before["mean_batch_size"] * before["batches"]
    # the rate: turns taken in the window (not the turns of the episodes that ended in it, which
    # began before it or leave the window's last turns out); an episode: mean turns of the measured ones
    turns_per_s = taken / elapsed
    cycle = args.num_envs / turns_per_s  # each env's time per turn
    env_seen = float(np.mean([t.env_latency_s for t in steps]))
    answered = float(np.mean([t.policy_latency_s for t in steps]))  # submit to answer
    call = sum(n * s for n, _, s in calls) / max(sum(n for n, _, _ in calls), 1)  # a turn's model call (its batch's)
    by_size: dict[int, list[float]] = {}
    for size, _, seconds in calls:
        by_size.setdefault(size, []).append(seconds)
    return {
        "drawn_env_s": float(np.mean(drawn_latencies_s(args, episodes))),
        "call_by_size_s": {n: (statistics.mean(t), len(t)) for n, t in sorted(by_size.items())},
        "episodes_per_s": turns_per_s / float(np.mean(turns)),
        "turns_per_s": turns_per_s,
        "mean_turns": float(np.mean(turns)),
        "mean_batch": items / batches if batches else 0.0,
        "seconds": elapsed,
        "cycle_ms": cycle * 1000,
        "env_ms": env_seen * 1000,
        "call_ms": call * 1000,
        "wait_ms": (answered - call) * 1000,
        "rest_ms": (cycle - env_seen - answered) * 1000,
        "slots_busy": sum(s for _, _, s in calls) / (args.inflight_batches * elapsed),
        "calls": calls,
        "completion_lengths": [len(t.completion_ids) for t in steps],
    }


def main(args: Args) -> dict[str, Any]:
    setting = (
        f"{args.num_envs} GuessNumber envs (1-{args.max_number}, {args.max_turns} turns), env step lognormal mean "
        f"{args.env_latency_ms:g} ms sigma {args.env_sigma:g}; simulated LM a={args.a_ms:g} ms + "
        f"{args.per_token_ms:g} ms x longest completion (lognormal, median {args.median_tokens:g} tokens), "
        f"{args.inflight_batches} calls at once (async: a lone turn held up to {args.hold_ms:g} ms for a "
        f"second, --hold-ms); "
        f"groups of {args.group_size}; {args.rounds * args.num_envs} episodes per mode in steady state (groups keep "
        f"starting while they are measured) after a warm-up round"
    )
    print(f"{setting}\nMachine: {machine_line()}", flush=True)
    before = measure_stages(args)
    results = {"sync (turn-level lockstep)": run_mode(args, lockstep=True), "async (per env)": run_mode(args, False)}
    after = measure_stages(args)
    sync, asyn = results["sync (turn-level lockstep)"], results["async (per env)"]
    # c(B): a call's cost given its longest completion, fitted before the runs, after them and, for the
    # sizes of 20 or more calls, on the async run's own calls; each at the cheapest of these fits (load
    # from other processes only makes a stage dearer, and a cheaper stage only raises the bound), at the
    # longest completion of B drawn from the async run's completions
    longest = expected_longest(asyn["completion_lengths"], range(1, args.num_envs + 1))
    fits = {"before": before["fit"], "after": after["fit"], "async run": fit_call_cost(asyn["calls"])}
    costs = {name: call_costs(fit, longest) for name, fit in fits.items()}
    paid_sizes = [size for size, (_, count) in asyn["call_by_size_s"].items() if count >= 20]
    stages = {
        "call_s": {b: min(costs["before"][b], costs["after"][b], costs["async run"][b] if b in paid_sizes else np.inf)
                   for b in longest},
        "env_overhead_s": min(before["env_overhead_s"], after["env_overhead_s"]),
        "fits_ms": {name: np.round(fit * 1000, 4).tolist() for name, fit in fits.items()},
    }  # fmt: skip
    # the earlier estimator, printed beside it: the mean time of the timed calls of each size, the
    # cheapest of before, after and what the async run paid (biased high by the draws; see measure_stages)
    mean_call_s = {b: min(before["mean_call_s"][b], after["mean_call_s"][b]) for b in longest}
    for size in paid_sizes:
        mean_call_s[size] = min(mean_call_s[size], asyn["call_by_size_s"][size][0])
    stages["c1_s"], stages["cN_s"] = stages["call_s"][1], stages["call_s"][args.num_envs]
    turns = asyn["mean_turns"]
    n, k = args.num_envs, args.inflight_batches
    # E[L]: the latencies the async run's steps drew, plus the overshoot of a timed step over its draw
    env_s = stages["env_s"] = asyn["drawn_env_s"] + stages["env_overhead_s"]
    bound_turns, how = fluid_bound(stages["call_s"], env_s, n, k)
    bound = bound_turns / turns
    means_bound = fluid_bound(mean_call_s, env_s, n, k)[0] / turns
    old_bound = min(n / (turns * (stages["c1_s"] + env_s)), k * n / (turns * stages["cN_s"]))
    rows = [
        [name, row["episodes_per_s"], row["turns_per_s"], row["mean_turns"], row["mean_batch"],
         row["episodes_per_s"] / sync["episodes_per_s"], row["episodes_per_s"] / bound]
        for name, row in results.items()
    ]  # fmt: skip
    table = markdown_table(
        ["mode", "episodes/s", "turns/s", "mean turns", "mean batch", "vs sync", "async bound share"], rows
    )
    stage_rows = [
        [name, row["cycle_ms"], row["env_ms"], row["call_ms"], row["wait_ms"], row["rest_ms"], row["slots_busy"]]
        for name, row in results.items()
    ]  # fmt: skip
    stage_table = markdown_table(
        ["mode (ms per turn, per env)", "turn cycle", "env step seen", "model call (its batch)",
         "wait for batch/slot", "rest (collector, resets, idle)", "call slots busy"],
        stage_rows,
    )  # fmt: skip
    costs = ", ".join(f"c({b}) = {c * 1000:.1f}" for b, c in stages["call_s"].items() if b in (1, 2, 4, 8, n))
    paid = ", ".join(
        f"{b}: {m * 1000:.1f} ms ({c} calls; c({b}) {stages['call_s'][b] * 1000:.1f})"
        for b, (m, c) in asyn["call_by_size_s"].items() if b <= 4
    )  # fmt: skip
    fits = "; ".join(
        f"{name} {a:.2f} + {b:.3f} x longest + {d:.3f} x B ms" for name, (a, b, d) in stages["fits_ms"].items()
    )
    stage_line = (
        f"stages: c(B), a call's cost fitted on its longest completion ({fits}; {args.stage_calls} timed calls of "
        f"each size before and after the runs, {k} at once, and the async run's calls), at the mean longest "
        f"completion of B drawn from the async run's completions, each the cheapest of those fits: {costs} ms; "
        f"E[L] = {env_s * 1000:.1f} ms "
        f"(the async run's drawn latencies {asyn['drawn_env_s'] * 1000:.1f} ms + a timed step's overshoot "
        f"{stages['env_overhead_s'] * 1000:.2f} ms), E[T] = {turns:.2f} turns; "
        f"async bound {bound:.2f} episodes/s ({bound_turns:.0f} turns/s: {how}; async "
        f"{asyn['episodes_per_s'] / bound:.3f} of it); the earlier bound formula "
        f"(c(1) latency with c({n}) throughput) gives {old_bound:.2f}; c(B) as the mean time of the timed calls of "
        f"each size (the estimator before 2026-12-02, biased high by the draws) gives {means_bound:.2f} "
        f"(async {asyn['episodes_per_s'] / means_bound:.3f} of it); the async run's calls by size paid {paid}"
    )
    print(f"\n{table}\n\n{stage_table}\n\n{stage_line}", flush=True)
    fig, ax = new_figure(width=6.0)
    names = list(results)
    ax.bar(names, [row["episodes_per_s"] for row in results.values()], color=["tab:gray", "tab:blue"])
    ax.axhline(bound, color="black", ls="--", label=f"async bound ({bound:.2f}/s)")
    ax.set_ylabel("episodes/s")
    ax.legend()
    save_report(
        "multiturn", f"{table}\n\n{stage_table}", fig, out_dir=args.out_dir,
        command="python benchmarks/multiturn.py", notes=f"{setting}.\n\n{stage_line}.",
    )  # fmt: skip
    return {"results": results, "stages": stages, "bound": bound, "old_bound": old_bound, "means_bound": means_bound}


if __name__ == "__main__":
    main(tyro.cli(Args))
