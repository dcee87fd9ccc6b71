"""CPU demo: a tiny language model learns single-digit sums with RLOO and REINFORCE++ (async mode).

    asyncvec demo-llm                          # installed; about 2 minutes on 2 cores
    asyncvec demo-llm --agents rloo grpo       # the agents to run
    python benchmarks/demo_llm.py              # in a clone, the same

1. builds a character-level GPT-2 (2 layers, 64 wide) from a config: no download;
2. a short supervised warm start on random sums ("3+4=" -> "7<eos>") that leaves most sampled
   answers wrong (the reward before RL is printed);
3. from that same model, each agent trains in async mode: a generator thread samples k
   completions per prompt with HFTextPolicy and scores them with the RewardService while the
   learner trains on the previous groups; new weights go to the policy after every update.
   Each stops once the mean reward of 10 updates reaches --target-reward (or after --max-prompts);
4. prints the reward before and after RL and the reward curve.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

from asyncvec.agents import grpo, reinforce_pp, rloo
from asyncvec.inference import build_tiny_lm
from asyncvec.lm import quiet_model_libraries, sft_warm_start
from asyncvec.lm.prompts import solved_prompts
from asyncvec.lm.results import LMTrainResult, summary


@dataclass
class DemoArgs:
    """RLOO and REINFORCE++ on single-digit sums, after a short supervised warm start."""

    agents: list[Literal["rloo", "reinforce_pp", "grpo"]] = field(default_factory=lambda: ["rloo", "reinforce_pp"])
    """which agents to run, one after the other, each from the same warm-started model"""
    sft_steps: int = 400
    """supervised steps (batches of 32 sums) before RL"""
    target_reward: float = 0.85
    """an agent stops once the mean reward of its last 10 updates reaches this"""
    max_prompts: int = 6400
    """prompts per agent at most (16 per update, 8 completions each)"""
    seed: int = 0
    """seed of the model, the warm start and the runs"""


def curve_line(curve: list[float], every: int = 10) -> str:
    """The reward curve as means over ``every`` updates."""
    means = [np.mean(curve[i : i + every]) for i in range(0, len(curve), every)]
    return " ".join(f"{m:.2f}" for m in means)


def main(args: DemoArgs) -> dict[str, LMTrainResult]:
    quiet_model_libraries()
    results = {}
    with tempfile.TemporaryDirectory(prefix="asyncvec-demo-llm-") as work:
        start = time.monotonic()
        base = build_tiny_lm(Path(work) / "base", arch="gpt2", n_layer=2, n_embd=64, seed=args.seed)
        examples = solved_prompts("asyncvec/SingleDigitSums-v0", args.seed)
        warm = sft_warm_start(base, Path(work) / "sft", examples, args.sft_steps, seed=args.seed)
        print(f"supervised warm start: {args.sft_steps} steps in {time.monotonic() - start:.1f} s", flush=True)
        for name in args.agents:
            module, cls = {
                "rloo": (rloo, rloo.RLOO),
                "reinforce_pp": (reinforce_pp, reinforce_pp.ReinforcePP),
                "grpo": (grpo, grpo.GRPO),
            }[name]
            run_args = module.Args(
                model=str(warm),
                mode="async",
                total_prompts=args.max_prompts,
                target_reward=args.target_reward,
                eval_prompts=400,
                progress=False,
                seed=args.seed,
            )
            result = cls(run_args).train()
            results[name] = result
            print(f"\n{summary(cls.__name__, result)}")
            print(f"  reward curve, mean per 10 updates: {curve_line(result.reward_curve)}")
            print(
                f"  reward before RL: {result.eval_reward_before:.2f}   after RL: {result.eval_reward_after:.2f}",
                flush=True,
            )
    print(f"\ndemo finished in {time.monotonic() - start:.0f} s")
    return results


if __name__ == "__main__":
    results = main(tyro.cli(DemoArgs))
    sys.exit(0 if all(r.reached_target for r in results.values()) else 1)
