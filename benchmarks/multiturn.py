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
waiting turns are batched, an env whose episode ended starts the next one at once.

The bound on async episodes/s, from stage times measured before the runs (``c(B)``: timed model
calls of B prompts; ``E[L]``: timed env steps; ``E[T]``: the mean turns per episode of the runs)::

    async <= min( N / (E[T] * (c(1) + E[L])),      each env cycles turn after turn on its own
                  K * N / (E[T] * c(N)) )          the engine serves at most K batches of N per c(N)

``K = --inflight-batches`` model calls may run at once (a server with continuous batching or
several replicas); sync sends one batch per turn, so it cannot use more than one.

Run (about a minute): ``python benchmarks/multiturn.py``; writes ``benchmarks/results/multiturn.md``
and ``.png``.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gymnasium as gym
import numpy as np
import tyro

import envs  # noqa: F401  (registers asyncvec/GuessNumber-v0)
from asyncvec.inference.text import TextPolicy
from asyncvec.inference.tiny_models import build_char_tokenizer
from asyncvec.inference.types import BackendResult, TextPrompt
from asyncvec.lm import EpisodeCollector, make_text_vector_env, text_space
from benchmarks.report import machine_line, markdown_table, new_figure, save_report
from envs.slow import SlowEnv


@dataclass
class Args:
    num_envs: int = 16
    """envs (each a worker process)"""
    group_size: int = 2
    """episodes per reset seed"""
    rounds: int = 3
    """episodes per mode: rounds * num_envs"""
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
    seed: int = 0
    """seed of the runs"""
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

    def _forward_batch(self, prompts: list[TextPrompt]) -> list[BackendResult]:
        texts = []
        for prompt in prompts:
            guess = str(int(self.rng.integers(1, self.max_number + 1)))
            length = int(np.clip(round(self.median_tokens * np.exp(0.8 * self.rng.standard_normal())), 1, 10**6))
            length = max(len(guess), min(length, prompt.max_new_tokens))
            texts.append(guess + " " * (length - len(guess)))
        time.sleep((self.a_ms + self.per_token_ms * max(map(len, texts))) / 1000.0)
        results = []
        for text in texts:
            ids = self.tokenizer(text).input_ids
            results.append(self._text_result(text, ids, [-1.0] * len(ids)))
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


def make_policy(args: Args) -> SimulatedLM:
    return SimulatedLM(
        a_ms=args.a_ms, per_token_ms=args.per_token_ms, median_tokens=args.median_tokens,
        max_new_tokens=args.max_new_tokens, max_number=args.max_number, seed=args.seed,
        max_batch_size=args.num_envs, max_wait_ms=1.0, max_inflight_batches=args.inflight_batches,
    )  # fmt: skip


def measure_stages(args: Args) -> dict[str, float]:
    """``c(1)``, ``c(N)`` (mean of timed model calls) and ``E[L]`` (mean of timed env steps)."""
    with make_policy(args) as policy:
        prompts = [TextPrompt((5, 6, 7), max_new_tokens=args.max_new_tokens)] * args.num_envs
        calls = {}
        for batch in (1, args.num_envs):
            times = []
            for _ in range(15):
                start = time.perf_counter()
                policy.forward_batch(prompts[:batch])
                times.append(time.perf_counter() - start)
            calls[batch] = statistics.mean(times)
    env = make_env(args, 10**6)()
    env.reset(seed=0)
    steps = []
    for _ in range(120):
        start = time.perf_counter()
        _, _, terminated, truncated, _ = env.step("1")
        steps.append(time.perf_counter() - start)
        if terminated or truncated:
            env.reset()
    env.close()
    return {"c1_s": calls[1], "cN_s": calls[args.num_envs], "env_s": statistics.mean(steps)}


def run_mode(args: Args, lockstep: bool) -> dict[str, float]:
    vec = make_text_vector_env([make_env(args, i) for i in range(args.num_envs)])
    episodes = args.rounds * args.num_envs
    try:
        with make_policy(args) as policy, EpisodeCollector(
            vec, policy, args.group_size, lockstep=lockstep, seed=args.seed
        ) as collector:
            per_round, measured = args.num_envs // args.group_size, episodes // args.group_size
            # steady state: groups keep starting while the measured ones run (no tail of idle envs)
            collector.start(per_round * (args.rounds + 3), ahead=measured + per_round)
            collector.pop(per_round, timeout=600)  # warm-up: workers, first batches
            before = policy.stats()
            start = time.perf_counter()
            batch = collector.pop(measured, timeout=600)
            elapsed = time.perf_counter() - start
            after = policy.stats()
    finally:
        vec.close()
    turns = [e.num_turns for group in batch.episodes for e in group]
    batches = after["batches"] - before["batches"]
    items = after["mean_batch_size"] * after["batches"] - before["mean_batch_size"] * before["batches"]
    return {
        "episodes_per_s": len(turns) / elapsed,
        "turns_per_s": sum(turns) / elapsed,
        "mean_turns": float(np.mean(turns)),
        "mean_batch": items / batches if batches else 0.0,
        "seconds": elapsed,
    }


def main(args: Args) -> dict[str, Any]:
    setting = (
        f"{args.num_envs} GuessNumber envs (1-{args.max_number}, {args.max_turns} turns), env step lognormal mean "
        f"{args.env_latency_ms:g} ms sigma {args.env_sigma:g}; simulated LM a={args.a_ms:g} ms + "
        f"{args.per_token_ms:g} ms x longest completion (lognormal, median {args.median_tokens:g} tokens), "
        f"{args.inflight_batches} calls at once; "
        f"groups of {args.group_size}; {args.rounds * args.num_envs} episodes per mode in steady state (groups keep "
        f"starting while they are measured) after a warm-up round"
    )
    print(f"{setting}\nMachine: {machine_line()}", flush=True)
    stages = measure_stages(args)
    results = {"sync (turn-level lockstep)": run_mode(args, lockstep=True), "async (per env)": run_mode(args, False)}
    sync, asyn = results["sync (turn-level lockstep)"], results["async (per env)"]
    turns = asyn["mean_turns"]
    n = args.num_envs
    bound = min(
        n / (turns * (stages["c1_s"] + stages["env_s"])), args.inflight_batches * n / (turns * stages["cN_s"])
    )
    rows = [
        [name, row["episodes_per_s"], row["turns_per_s"], row["mean_turns"], row["mean_batch"],
         row["episodes_per_s"] / sync["episodes_per_s"], row["episodes_per_s"] / bound]
        for name, row in results.items()
    ]  # fmt: skip
    table = markdown_table(
        ["mode", "episodes/s", "turns/s", "mean turns", "mean batch", "vs sync", "async bound share"], rows
    )
    stage_line = (
        f"measured stages: c(1) = {stages['c1_s'] * 1000:.1f} ms, c({n}) = {stages['cN_s'] * 1000:.1f} ms, "
        f"E[L] = {stages['env_s'] * 1000:.1f} ms, E[T] = {turns:.2f} turns; async bound {bound:.2f} episodes/s"
    )
    print(f"\n{table}\n\n{stage_line}", flush=True)
    fig, ax = new_figure(width=6.0)
    names = list(results)
    ax.bar(names, [row["episodes_per_s"] for row in results.values()], color=["tab:gray", "tab:blue"])
    ax.axhline(bound, color="black", ls="--", label=f"async bound ({bound:.2f}/s)")
    ax.set_ylabel("episodes/s")
    ax.legend()
    save_report(
        "multiturn", table, fig, out_dir=args.out_dir, command="python benchmarks/multiturn.py",
        notes=f"{setting}.\n\n{stage_line}.",
    )  # fmt: skip
    return {"results": results, "stages": stages, "bound": bound}


if __name__ == "__main__":
    main(tyro.cli(Args))
