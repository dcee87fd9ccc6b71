"""agents/ppo_chunks.py: PPO from executed chunk actions on a pixel task.

* Replaced actions (overlap blend, fallback, safety, reset step) get zero policy-loss weight.
* Each executed action's behavior log-prob is its own chunk's action log-prob under its own
  chunk's policy version (checked against the weights of that version), and the IS weight
  ``min(pi_prox / mu, C)`` uses it.
* Learning: on PixelCartPole at 16x16 pixels, returns improve over a behavior-cloning warm start
  (a scripted controller on the state, 800 noisy steps, 150 BC steps) by a margin (seed 1
  here; seeds 1-18 measured), on the executor's simulated clock: the same data at any machine load (the margins
  measured are far above the test).
* A seeded `GaussianChunkPolicy` answers the same whether its requests were batched or not.
"""

from __future__ import annotations

import copy
import math
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode

import asyncvec.envs  # noqa: F401  (registers the pixel envs)
from asyncvec.agents.ppo_chunks import Args, PPOChunks
from asyncvec.benchmarks.chunk_suite import demonstrations
from asyncvec.control import SOURCES, ChunkExecutor, SafetyFilter, action_logps_from_tokens, hashed_words
from asyncvec.control.chunk_policy import GaussianChunkPolicy
from asyncvec.losses import truncated_importance_weights

torch.set_num_threads(1)
HORIZON = 4


def small_args(**overrides) -> Args:
    settings = dict(image_size=16, num_envs=4, horizon=HORIZON, ticks_per_rollout=32, iterations=1, eval_rounds=0)
    return Args(**{**settings, **overrides})


def test_action_logps_from_tokens() -> None:
    np.testing.assert_allclose(action_logps_from_tokens([-1.0, -2.0], horizon=2), [-1.0, -2.0])
    np.testing.assert_allclose(action_logps_from_tokens([-1, -1, -2, -2, -3, -3], horizon=3), [-2, -4, -6])
    assert action_logps_from_tokens([-1.0, -2.0, -3.0], horizon=2) is None
    assert action_logps_from_tokens((), horizon=2) is None


def test_gaussian_chunk_policy_reports_each_action() -> None:
    algo = PPOChunks(small_args())
    obs = {"image": np.full((16, 16, 3), 100, np.uint8), "instruction": hashed_words("balance the pole", 64)}
    with algo.make_policy(max_wait_ms=1) as policy:
        out = policy.submit(obs, env_id=0).result(timeout=30)
    with GaussianChunkPolicy(copy.deepcopy(algo.agent), algo.chunk_space, obs_key="camera") as wrong_key:
        with pytest.raises(ValueError, match="no key 'camera'"):
            wrong_key.submit(obs, env_id=3)
    assert out.action.shape == (HORIZON, 1) and len(out.token_logps) == HORIZON
    assert math.isclose(sum(out.token_logps), out.behavior_logp, rel_tol=1e-6)
    flat = algo.flatten({key: value[None] for key, value in obs.items()}).repeat(HORIZON, 1)
    with torch.no_grad():
        expected = algo.agent.action_logp(
            flat, torch.zeros(HORIZON, dtype=torch.long), torch.arange(HORIZON), torch.as_tensor(out.action)
        )
    np.testing.assert_allclose(out.token_logps, expected.numpy(), rtol=1e-5, atol=1e-5)


def test_seeded_policy_answers_do_not_depend_on_batching() -> None:
    algo = PPOChunks(small_args())
    images = np.random.default_rng(0).integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    observations = [{"image": image, "instruction": hashed_words("balance", 64)} for image in images]
    answers = []
    for batched in (True, False):
        with algo.make_policy(seed=7, max_batch_size=6, max_wait_ms=50) as policy:
            if batched:  # one batch of 6
                outs = policy.act(observations, timeout=30)
            else:  # one request at a time
                outs = [policy.submit(obs, env_id=i).result(timeout=30) for i, obs in enumerate(observations)]
            assert policy.stats()["batches"] == (1 if batched else 6)
        answers.append(outs)
    for a, b in zip(*answers, strict=True):
        np.testing.assert_array_equal(a.action, b.action)
        assert a.token_logps == b.token_logps
    assert not np.array_equal(answers[0][0].action, answers[0][1].action)  # noise differs between requests


@pytest.fixture(scope="module")
def mixed_rollout():
    """A real rollout whose chunks come from two policy versions with different weights, a safety
    filter that replaces some actions, and short episodes (reset steps, fallbacks)."""
    algo = PPOChunks(small_args(max_episode_steps=12))
    envs_ = gym.vector.SyncVectorEnv([algo.make_env] * 4, autoreset_mode=AutoresetMode.NEXT_STEP)
    weights = {0: copy.deepcopy(algo.agent.state_dict())}
    policy = algo.make_policy(max_wait_ms=1)
    safety = SafetyFilter(envs_.single_action_space, max_delta=1.0)
    executor = ChunkExecutor(envs_, policy, period_s=0.005, horizon=HORIZON, safety=safety, record_obs=True)
    with torch.no_grad():  # version 1: other weights, still sane actions
        algo.agent.actor_mean.weight.add_(0.05 * torch.randn_like(algo.agent.actor_mean.weight))
        algo.agent.actor_mean.bias.add_(0.2)
        algo.agent.log_std.add_(0.1)
    weights[1] = copy.deepcopy(algo.agent.state_dict())

    def publish_midway() -> None:  # as an asynchronous learner does: new weights while chunks play
        while executor.stats()["chunks"] < 8:
            time.sleep(0.001)
        policy.load_weights(copy.deepcopy(weights[1]), 1)

    executor.reset(seed=0)
    publisher = threading.Thread(target=publish_midway)
    publisher.start()
    rollout = executor.run(60)
    publisher.join(timeout=60)
    policy.close()
    envs_.close()
    algo.version = 1
    yield algo, weights, rollout


def test_rollout_records_each_actions_own_chunk(mixed_rollout) -> None:
    algo, weights, rollout = mixed_rollout
    played = rollout.policy_choice
    assert played.sum() > 20 and rollout.safety_replaced.any() and rollout.count("reset") > 0
    versions = set(rollout.policy_version[played].tolist())
    assert versions == {0, 1}, versions  # chunks of version 0 still play after version 1 was published
    assert np.isfinite(rollout.action_logp[played]).all()
    assert len(rollout.observations) == 60 and rollout.next_obs["image"].shape == (4, 16, 16, 3)
    net = copy.deepcopy(algo.agent)
    for version in (0, 1):  # mu of each executed action = its chunk's action j, under its version's weights
        rows = played & (rollout.policy_version == version)
        net.load_state_dict(weights[version])
        chunk_obs = [rollout.chunk_obs[c] for c in rollout.chunk_id[rows]]
        flat = algo.flatten({key: np.stack([obs[key] for obs in chunk_obs]) for key in ("image", "instruction")})
        with torch.no_grad():
            recomputed = net.action_logp(
                flat,
                torch.arange(len(flat)),
                torch.as_tensor(rollout.chunk_index[rows]),
                torch.as_tensor(rollout.proposed[rows], dtype=torch.float32),
            )
        np.testing.assert_allclose(rollout.action_logp[rows], recomputed.numpy(), rtol=1e-4, atol=1e-4)
        assert not np.allclose(rollout.action_logp[rows], rollout.behavior_logp[rows])  # not the joint one


def test_replaced_actions_get_zero_policy_loss_weight(mixed_rollout) -> None:
    algo, _, rollout = mixed_rollout
    batch = algo.prepare(rollout)
    replaced = torch.as_tensor(rollout.replaced.reshape(-1))
    assert not (batch.policy_mask & replaced).any()
    np.testing.assert_array_equal(batch.value_mask.numpy(), rollout.source.reshape(-1) != SOURCES.index("reset"))
    everything = torch.arange(len(batch.advantages))

    def loss_and_grads(b):
        algo.agent.zero_grad()
        loss, _ = algo.loss(b, everything)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in algo.agent.actor_encoder.parameters()]

    base_loss, base_grads = loss_and_grads(batch)
    wild = copy.copy(batch)
    wild.advantages = torch.where(replaced, torch.full_like(batch.advantages, 1e3), batch.advantages)
    wild.actions = torch.where(replaced[:, None], torch.full_like(batch.actions, 5.0), batch.actions)
    wild.behavior_logp = torch.where(replaced, torch.full_like(batch.behavior_logp, -50.0), batch.behavior_logp)
    wild_loss, wild_grads = loss_and_grads(wild)
    assert wild_loss == pytest.approx(base_loss, rel=1e-5, abs=1e-6)
    for a, b in zip(base_grads, wild_grads, strict=True):
        torch.testing.assert_close(a, b)
    # and a policy action's advantage does move the gradient (not necessarily the loss's value: with the
    # advantages normalized over the policy's actions and weights near 1 the loss stays near 0)
    moved = copy.copy(batch)
    moved.advantages = torch.where(
        batch.policy_mask, batch.advantages + torch.randn_like(batch.advantages), batch.advantages
    )
    _, moved_grads = loss_and_grads(moved)
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(base_grads, moved_grads, strict=True))


def test_importance_weights_use_each_actions_own_chunk(mixed_rollout) -> None:
    algo, _, rollout = mixed_rollout
    batch = algo.prepare(rollout)
    played = torch.as_tensor(rollout.policy_choice.reshape(-1))
    torch.testing.assert_close(
        batch.behavior_logp[played],
        torch.as_tensor(rollout.action_logp.reshape(-1)[played.numpy()], dtype=torch.float32),
    )
    torch.testing.assert_close(batch.versions, torch.as_tensor(rollout.policy_version.reshape(-1)))
    # the learner holds version 1's weights: its actions have weight 1, version 0's have pi_1/mu_0 != 1
    weights, _ = truncated_importance_weights(
        batch.prox_logp, batch.behavior_logp, cap=algo.args.behavior_cap, mask=batch.policy_mask
    )
    fresh = batch.policy_mask & (batch.versions == 1)
    stale = batch.policy_mask & (batch.versions == 0)
    torch.testing.assert_close(weights[fresh], torch.ones(int(fresh.sum())), atol=1e-3, rtol=1e-3)
    assert ((weights[stale] - 1.0).abs() > 1e-3).float().mean() > 0.9
    expected = torch.exp((batch.prox_logp - batch.behavior_logp).clamp(max=math.log(algo.args.behavior_cap)))
    torch.testing.assert_close(weights[stale], expected[stale])
    # staleness: with max_policy_lag=0 the version-0 actions leave the loss
    algo.args.max_policy_lag = 0
    try:
        strict = algo.prepare(rollout)
    finally:
        algo.args.max_policy_lag = Args.max_policy_lag
    assert not (strict.policy_mask & (strict.versions == 0)).any() and (strict.policy_mask == fresh).all()


# The learning test runs the executor on a simulated clock (Args.latency_ticks=2: each chunk arrives
# 2 ticks after its request, ticks unpaced) with a seeded policy that computes requests one at a
# time, so a run replays bit for bit at any machine load. On the wall clock (the test until
# 2026-12-01, 5 ms ticks) the data followed the load: beside 2 busy processes the policy answered
# in 220-350 ms (p50) against a 40 ms chunk, 64-71% of the ticks played the fallback, and no seed
# learned (-1.6, +2.1, -0.3): the mechanism behind seed 2's fall from 38.8 to 22.7 in a full make
# test (not replayed). On the simulated clock the last updates still decided too much at a
# constant learning rate: 20 iterations ended at +0.2 on seed 8 (seeds 1-9), 30 at +0.6 on seed 1
# (seeds 1-18). Annealed (Args.anneal_lr, as agents/ppo.py), 30 iterations, 64 episodes from reset
# before and after: margins +18.8 to +45.7 over seeds 1-18 (mean +28), trained on 95-97% of the
# executed actions; seeds 1, 2, 3: 47.5 -> 83.9, 39.6 -> 69.5, 41.4 -> 74.0, the same numbers
# beside 2 busy processes. Another CPU (other float kernels) draws other runs from the same
# distribution; the threshold sits far below the worst seed. Each seed passes or fails on its own
# (a run replays bit for bit), so the suite runs one: 39 s a seed in a full make test.
LEARNING_SEEDS = (1,)
MIN_MARGIN = 5.0


def test_returns_improve_over_a_warm_start() -> None:
    results = []
    for seed in LEARNING_SEEDS:
        args = Args(
            seed=seed,
            image_size=16,
            num_envs=8,
            ticks_per_rollout=64,
            iterations=30,
            update_epochs=10,
            num_minibatches=1,
            init_log_std=-0.5,
            eval_rounds=8,
            latency_ticks=2,
        )
        algo = PPOChunks(args)
        observations, chunks = demonstrations("cartpole", algo, 800, seed)  # a scripted controller, with noise
        algo.behavior_clone(observations, chunks, steps=150, batch_size=64)
        history = algo.train()
        results.append((seed, history["eval_start"], history["eval_end"], history["trained_fraction"]))
        assert 0.85 < history["trained_fraction"] < 1.0, history  # episode starts wait 2 ticks for a chunk
        assert history["stats"]["late_ticks"] == 0, history["stats"]  # the simulated clock is never late
    margins = [end - start for _, start, end, _ in results]
    print("seed, eval_start, eval_end, trained_fraction:", results, "margins:", margins)
    assert min(margins) > MIN_MARGIN, results


class CameraOnly(gym.Env):
    """An env whose observation is the image alone (no Dict, no instruction) and takes no size."""

    observation_space = gym.spaces.Box(0, 255, (20, 20, 3), np.uint8)
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), -float(np.abs(action).sum()), False, False, {}


gym.register("test/CameraOnly-v0", entry_point=CameraOnly, max_episode_steps=20)


def test_any_image_env_trains_resized_to_image_size() -> None:
    algo = PPOChunks(small_args(env="test/CameraOnly-v0", env_kwargs="{}", image_size=8, max_episode_steps=0))
    history = algo.train()
    assert history["trained_fraction"] > 0.5 and algo.version == 2
    with pytest.raises(ValueError, match=r"gym.make\('test/CameraOnly-v0', \*\*\{'size': 16\}\) failed"):
        PPOChunks(small_args(env="test/CameraOnly-v0"))
    with pytest.raises(ValueError, match="PPOChunks needs image observations"):
        PPOChunks(small_args(env="MountainCarContinuous-v0", env_kwargs="{}"))


@pytest.mark.parametrize("buckets", [64, 0])
def test_the_network_reads_the_instruction_unless_told_not_to(buckets: int) -> None:
    algo = PPOChunks(small_args(env="asyncvec/PixelReach-v0", instruction_buckets=buckets))
    obs, _ = gym.make("asyncvec/PixelReach-v0", size=16).reset(seed=0)
    with torch.no_grad():  # the same image, two instructions
        means = [algo.agent(algo.flatten({"image": obs["image"][None], **(
            {"instruction": hashed_words(text, buckets)[None]} if buckets else {})}))[0]
            for text in ("go to the red square", "go to the blue square")]  # fmt: skip
    assert (not torch.allclose(*means)) if buckets else torch.equal(*means)
