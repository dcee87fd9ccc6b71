"""Learning on a multi-turn text env: RL improves a weak warm start on FrozenLake (HF backend, a
tiny char-level GPT-2 built from a config, CPU).

FrozenLake 4x4, deterministic, through ``TextEnv`` (``asyncvec/FrozenLakeText-v0``, 8 turns at
most; the shortest path takes 6). The model has 128 positions and the collector drops the oldest
turns of a conversation that would overflow them (``--on-overflow drop_oldest``: the board shows
where the player is, so the recent turns are enough); the same setup runs on vLLM, in process
and on a server, in tests/test_lm_agents_vllm.py. A short supervised warm start on the env's
expert (shortest-path play, rendered as the collector renders it, context cuts included) leaves
the model reaching the goal in a fraction of the episodes; RLOO in async mode, the model acting in
32 envs of an ``AsyncLLMVectorEnv``, must raise the held-out success rate by a margin.
GuessNumber is in tests/test_guess_number_learning.py.

Settings: 50 warm-start steps; RLOO async, 32 envs, up to 40 updates x 4 groups x 8 episodes,
lr 1e-3 (the default), ``--gamma 0.9``, ``--kl-coef 0.05`` (a KL penalty to the warm start in
the reward), stopping once the mean training reward of 10 updates reaches 0.8
(``--target-reward``); 64 held-out episodes before and after. Measured on the shared 2-core
machine, success before RL -> after RL:

* these settings, three runs side by side (load 2-4, 109-110 s each, 40 updates each): seed 1
  0.36 -> 0.78, seed 2 0.42 -> 0.81, seed 3 0.50 -> 0.92; this test
  (seed 1, a vLLM run alongside, load 2-4) 0.33 -> 0.83 in 93 s;
* with the stop, without the KL penalty (load 1-3): seed 1 0.45 -> 0.86 (40 updates), seed 2
  0.36 -> 0.83 (stopped after 39), seed 3 0.47 -> 0.83 (after 32); this test (seed 1, alone)
  0.39 -> 0.27: its training reward reached 0.85 at update 38, then fell to 0.66 and 0.56;
* without either (40 updates): seed 1 0.47 -> 0.92, seed 2 0.53 -> 0.88, seed 3 0.38 -> 0.84
  (four runs side by side, load 6-15); seed 2 0.44 -> 0.88, seed 3 0.41 -> 0.39 (load 1-3: its
  training reward fell from 0.95 to 0.43 over the last 3 updates); this test (seed 1) 0.34 ->
  0.70 (192 s, a vLLM run alongside) and 0.38 -> 0.78 (58 s alone, load 0.4-2.5);
* vLLM, in process and on a server: tests/test_lm_agents_vllm.py's docstring.

So RL improves the weak warm start in all but 2 of 15 runs (+0.31 to +0.50); those 2 collapsed
in their last updates at lr 1e-3, which the KL penalty is there to prevent (3 runs with it are
too few to say it does every time). 0.8 is reached in most runs but not all: the test asks for
+0.15 and >= 0.6 after RL, not 0.8. What did not do better (seed 1 unless said;
docs/lm_agents.md lists them): 12-32 updates at lr 3e-4 or 1e-3 (0.17 -> 0.36, 0.19 -> 0.58);
lr 2e-3 gets there faster (0.19 -> 0.91 in 32 updates, 0.33 -> 0.95 in 24)
but its training reward collapses to ~0 for several updates in some seeds (seed 2 ended at
0.78); ``--per-turn`` at lr 2e-3 collapsed seed 1 to all-invalid completions. The warm start's
success varies between runs of one seed (40 steps: 0.17-0.31): sampling is not seeded, so a
seed fixes the warm start, not the run.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

import envs  # noqa: F401  (registers the ids)
from agents import rloo
from agents.lm_setup import LMTrainResult, expert_conversations
from asyncvec.inference import build_tiny_lm
from asyncvec.lm import load_causal_lm, sft_warm_start

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# The task and the model's context, shared with the vLLM runs (tests/test_lm_agents_vllm.py).
FROZEN_LAKE = {
    "env": "asyncvec/FrozenLakeText-v0", "env_kwargs": json.dumps({"max_turns": 8}), "on_overflow": "drop_oldest",
    "max_new_tokens": 6, "num_envs": 32, "mode": "async", "progress": False,
}  # fmt: skip
CONTEXT = 128  # positions of the model (and vLLM's max_model_len)
WARM_START_STEPS = 50
# RL settings: see the module docstring for what they reach, per seed.
# 40 updates at most; the run stops early once the mean training reward of 10 updates reaches 0.8, and a
# KL penalty to the warm start (0.05) holds the policy near it: without them, 2 of 11 runs collapsed at the end.
RL = {
    "total_prompts": 160, "prompts_per_update": 4, "group_size": 8, "gamma": 0.9, "learning_rate": 1e-3,
    "target_reward": 0.8, "kl_coef": 0.05,
}  # fmt: skip
# Thresholds below every run with these settings, with room (see the module docstring): gains +0.39 to
# +0.50, success after RL 0.78-0.92. 0.8 after RL is reached in most runs, not in all: reported, not asserted.
MARGIN = 0.15
MIN_SUCCESS = 0.6


def frozen_lake_warm_start(folder: Path, seed: int, steps: int = WARM_START_STEPS) -> Path:
    """A char-level GPT-2 (2 layers, 64 wide, ``CONTEXT`` positions; the architecture of
    tests/test_lm_agents_vllm.py's engine) after ``steps`` supervised steps on the expert."""
    base = build_tiny_lm(folder / "base", n_layer=2, n_embd=64, max_positions=CONTEXT, seed=0)
    # the expert's play rendered as the collector renders it, context cuts (drop_oldest) included
    examples = expert_conversations(rloo.Args(**FROZEN_LAKE), load_causal_lm(base)[1], CONTEXT)
    return sft_warm_start(base, folder / "sft", examples, steps, seed=seed)


def check_learned(result: LMTrainResult) -> None:
    """Held-out success after RL >= ``MIN_SUCCESS``, and up by ``MARGIN`` from the warm start."""
    before, after = result.eval_details[0]["success"], result.eval_details[-1]["success"]
    assert after >= MIN_SUCCESS and after - before >= MARGIN, (before, after, result.eval_details, result.reward_curve)


def test_rloo_improves_a_weak_warm_start_on_frozen_lake_text():
    torch.set_num_threads(1)
    warm = frozen_lake_warm_start(Path(tempfile.mkdtemp()), seed=1)
    args = rloo.Args(model=str(warm), eval_prompts=64, seed=1, **FROZEN_LAKE, **RL)
    result = rloo.RLOO(args).train()
    print("frozen lake, HF:", result.eval_details, result.reward_curve)  # shown with pytest -s
    assert 10 <= result.updates <= RL["total_prompts"] // RL["prompts_per_update"]
    check_learned(result)
