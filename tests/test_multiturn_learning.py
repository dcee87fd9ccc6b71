"""Learning on a multi-turn text env: FrozenLake (HF backend, a tiny char-level GPT-2 built from a config, CPU).

FrozenLake 4x4, deterministic, through ``TextEnv`` (``asyncvec/FrozenLakeText-v0``): a
supervised warm start on shortest-path play (150 steps), then 6 RLOO updates in async mode with
the model acting in 8 envs of an ``AsyncLLMVectorEnv``; the held-out success rate after RL must
be >= 0.8. What this shows is the whole multi-turn path working end to end (warm start,
collection, update, publish, evaluation) without losing the warm start, not RL improving it.
GuessNumber, where RL improves a warm start, is in tests/test_guess_number_learning.py.

Measured with these settings but 32 held-out episodes (success before RL -> after RL), on the
shared 2-core machine at load 8-15: seed 1 0.97 -> 0.88, seed 2 0.94 -> 0.94 (the test
evaluates 64 episodes: at a true 0.88 a 64-episode estimate falls below 0.8 about 1 run in 40).
With ``learning_rate=1e-3``, 8 updates took seed 1 from 0.94 down to 0.69; with 3e-4 and 100
warm-start steps, seeds 1 and 2 went 0.88 -> 0.84 and 0.88 -> 0.78.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

import envs  # noqa: F401  (registers the ids)
from agents import rloo
from asyncvec.inference import build_tiny_lm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_frozen_lake_text_reaches_the_goal():
    torch.set_num_threads(1)
    base = build_tiny_lm(tempfile.mkdtemp(), n_layer=2, n_embd=64, max_positions=512, seed=0)
    args = rloo.Args(
        model=str(base), env="asyncvec/FrozenLakeText-v0", env_kwargs='{"max_turns": 8}', sft_steps=150,
        total_prompts=24, prompts_per_update=4, group_size=4, num_envs=8, eval_prompts=64, progress=False,
        mode="async", gamma=0.9, learning_rate=1e-4, seed=1, max_new_tokens=6,
    )  # fmt: skip
    result = rloo.RLOO(args).train()
    assert result.updates == 6
    assert result.eval_details[-1]["success"] >= 0.8, result.eval_details
