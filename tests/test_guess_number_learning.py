"""Learning on a multi-turn text env: GuessNumber (HF backend, a tiny char-level GPT-2 built from a config, CPU).

GuessNumber (1-8, 4 turns, feedback only) from a short warm start (40 supervised steps of binary
search), then 60 sync RLOO updates of 8 groups x 8 episodes at lr 1e-3 (3,840 episodes): the
held-out success rate (128 episodes, the same targets before and after) must go up and the mean
turns down, averaged over seeds 1-3. Measured here, two repetitions (success before -> after, turns):

    rep 1: seed 1 0.60 -> 0.84 (3.09 -> 2.91), seed 2 0.59 -> 0.77 (2.97 -> 2.84),
           seed 3 0.70 -> 0.89 (2.82 -> 2.71): mean success +0.200, turns -0.143
    rep 2: seed 1 0.60 -> 0.80 (3.11 -> 2.97), seed 2 0.64 -> 0.80 (2.90 -> 2.80),
           seed 3 0.70 -> 0.86 (2.84 -> 2.70): mean success +0.177, turns -0.130

98-120 s per seed at load 1-4. The test asks the three-seed means for +0.08 success and -0.04
turns, well below the worst mean and the worst seed (+0.164, -0.102). With 40 updates the margin
was not robust: three repetitions gave mean success +0.081, +0.091, +0.039 and turns -0.065,
-0.083, +0.029 (seed 2 once went 0.61 -> 0.55); see docs/lm_agents.md "Measured learning".
"""

from __future__ import annotations

import tempfile

import pytest
import torch

import envs  # noqa: F401  (registers the ids)
from agents import rloo
from asyncvec.inference import build_tiny_lm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _guess_number_run(seed: int, updates: int = 60) -> tuple[dict[str, float], dict[str, float]]:
    """A 40-step warm start, then ``updates`` sync RLOO updates of 8 groups x 8 episodes; (before,
    after) on the same 128 held-out episodes."""
    base = build_tiny_lm(tempfile.mkdtemp(), n_layer=2, n_embd=64, max_positions=512, seed=0)
    args = rloo.Args(
        model=str(base), env="asyncvec/GuessNumber-v0",
        env_kwargs='{"max_number": 8, "max_turns": 4, "transcript": false}', sft_steps=40,
        total_prompts=8 * updates, prompts_per_update=8, group_size=8, num_envs=8, eval_prompts=128, progress=False,
        mode="sync", gamma=0.8, learning_rate=1e-3, seed=seed, max_new_tokens=4,
    )  # fmt: skip
    result = rloo.RLOO(args).train()
    return result.eval_details[0], result.eval_details[-1]


@pytest.mark.timeout(1800)
def test_guess_number_rl_improves_a_short_warm_start():
    torch.set_num_threads(1)
    runs = [_guess_number_run(seed) for seed in (1, 2, 3)]
    success_gain = sum(after["success"] - before["success"] for before, after in runs) / len(runs)
    turns_drop = sum(before["turns_mean"] - after["turns_mean"] for before, after in runs) / len(runs)
    assert success_gain >= 0.08 and turns_drop >= 0.04, (success_gain, turns_drop, runs)
