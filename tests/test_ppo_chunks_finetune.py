"""agents/ppo_chunks.py after behaviour cloning (issue 50): the critic warm-up and the KL anchor.

* The warm-up trains the critic on rollouts of the cloned policy and leaves every actor parameter as it was.
* The anchor ``KL(pi || pi_cloned)`` holds the action mean near the cloned policy's when the advantages are noise.
* Without ``behavior_clone`` there is no reference: no anchor, no warm-up, no error.
* The defaults are on and documented (Args docstrings, docs/robots.md).
"""

from __future__ import annotations

from pathlib import Path

import torch

import asyncvec.envs  # noqa: F401  (registers the pixel envs)
from asyncvec.agents.ppo_chunks import Args, ChunkBatch, PPOChunks
from asyncvec.benchmarks.chunk_suite import demonstrations

torch.set_num_threads(1)


def small_args(**overrides) -> Args:
    settings = dict(image_size=16, num_envs=4, horizon=4, ticks_per_rollout=32, iterations=1, eval_rounds=0)
    settings.update(track=False, progress=False)
    return Args(**{**settings, **overrides})


def cloned(args: Args) -> PPOChunks:
    algo = PPOChunks(args)
    observations, chunks = demonstrations("cartpole", algo, 200, args.seed)
    algo.behavior_clone(observations, chunks, steps=30, batch_size=32)
    return algo


def actor_parameters(algo: PPOChunks) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in algo.agent.named_parameters() if not name.startswith("critic")}


def test_warm_up_trains_the_critic_and_leaves_the_actor_unchanged() -> None:
    algo = cloned(small_args(critic_warmup_iterations=2, iterations=0))
    actor_before = actor_parameters(algo)
    critic_before = algo.agent.critic.weight.detach().clone()
    history = algo.train()
    assert "warmup_value_loss" in history
    for name, value in actor_parameters(algo).items():
        torch.testing.assert_close(value, actor_before[name], rtol=0, atol=0, msg=name)
    assert not torch.equal(algo.agent.critic.weight, critic_before)


class NoiseAdvantages(PPOChunks):
    """Advantages replaced by seeded noise: an update that follows them only drifts."""

    def prepare(self, rollout) -> ChunkBatch:
        batch = super().prepare(rollout)
        batch.advantages = torch.randn(len(batch.advantages), generator=torch.Generator().manual_seed(0))
        return batch


def mean_drift(anchor_coef: float) -> float:
    algo = NoiseAdvantages(small_args(anchor_coef=anchor_coef, critic_warmup_iterations=0, iterations=4))
    observations, chunks = demonstrations("cartpole", algo, 200, 1)
    algo.behavior_clone(observations, chunks, steps=30, batch_size=32)
    probe = algo.flatten(observations)[:64]
    with torch.no_grad():
        reference = algo.agent(probe)[0]
    algo.train()
    with torch.no_grad():
        return float((algo.agent(probe)[0] - reference).abs().mean())


def test_the_anchor_keeps_the_action_mean_near_the_cloned_policy_under_noise_advantages() -> None:
    free, anchored = mean_drift(0.0), mean_drift(10.0)
    assert anchored < 0.5 * free, (free, anchored)


def test_without_cloning_there_is_no_anchor_and_no_warm_up() -> None:
    algo = PPOChunks(small_args())
    history = algo.train()
    assert algo.reference is None and "warmup_value_loss" not in history
    assert history["last_update"]["anchor_kl"] == 0.0


def test_the_defaults_are_on_and_documented() -> None:
    args = Args()
    assert args.critic_warmup_iterations > 0 and args.anchor_coef > 0
    page = (Path(__file__).resolve().parents[1] / "docs" / "robots.md").read_text(encoding="utf-8")
    for name in ("critic_warmup_iterations", "anchor_coef", "chunk_suite_ablation"):
        assert name in page, name
