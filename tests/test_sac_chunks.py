"""agents/sac_chunks.py: SAC on action chunks, after behaviour cloning (issue 50).

* Cloning the squashed actor on a scripted expert's demonstrations reaches the expert's order of return.
* The critic warm-up trains the critics and leaves the actor and alpha bit-identical.
* The KL anchor is zero at the cloned reference and grows as the actor moves away; filtered, it lets go only where
  both critics prefer the actor's chunk.
* The critic's windows: H executed actions, their discounted rewards, the next observation L ticks before the next
  window; whole chunks play (nothing dropped).
* The acting policy's log-prob of a squashed chunk is the actor's.
* Bad settings fail at once, naming the option.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode

import asyncvec.envs  # noqa: F401  (registers the pixel envs)
from asyncvec.agents.sac_chunks import Args, SACChunks, WindowReplay, rollout_windows
from asyncvec.benchmarks.chunk_suite import demonstrations, expert_return
from asyncvec.control import ChunkExecutor

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


def small_args(**overrides) -> Args:
    settings = dict(image_size=16, num_envs=4, horizon=4, ticks_per_rollout=32, iterations=1, eval_rounds=0,
                    gradient_steps=4, batch_size=32, hidden=32, track=False, progress=False)  # fmt: skip
    return Args(**{**settings, **overrides})


def cloned(args: Args, task: str = "cartpole", samples: int = 200, steps: int = 30) -> SACChunks:
    algo = SACChunks(args)
    observations, chunks = demonstrations(task, algo, samples, args.seed)
    algo.behavior_clone(observations, chunks, steps=steps, batch_size=32)
    return algo


def test_cloning_reaches_the_experts_order_of_return() -> None:
    settings = dict(env="asyncvec/PixelMountainCarContinuous-v0", horizon=8, num_envs=8, max_episode_steps=200,
                    iterations=0, critic_warmup_iterations=0, eval_rounds=1, hidden=256)  # fmt: skip
    untrained = SACChunks(small_args(**settings)).train()["eval_start"]
    start = cloned(small_args(**settings), task="mountain_car", samples=800, steps=150).train()["eval_start"]
    expert = expert_return("mountain_car", 1, 8)
    assert untrained < 0.0 < 0.5 * expert < start, (untrained, start, expert)


def test_warm_up_trains_the_critics_and_leaves_the_actor_and_alpha_bit_identical() -> None:
    algo = cloned(small_args(critic_warmup_iterations=2, iterations=0))
    actor_before = {name: p.detach().clone() for name, p in algo.actor.named_parameters()}
    critic_before = [p.detach().clone() for p in algo.critic.parameters()]
    alpha_before = algo.log_alpha.detach().clone()
    history = algo.train()
    assert np.isfinite(history["warmup_q_loss"]) and history["windows"] > 0
    for name, value in algo.actor.named_parameters():
        torch.testing.assert_close(value.detach(), actor_before[name], rtol=0, atol=0, msg=name)
    assert torch.equal(algo.log_alpha.detach(), alpha_before)
    assert any(not torch.equal(p, before) for p, before in zip(algo.critic.parameters(), critic_before, strict=True))


def test_the_anchor_is_zero_at_the_cloned_reference_and_grows_away_from_it() -> None:
    algo = cloned(small_args())
    observations, _ = demonstrations("cartpole", algo, 64, 2)
    probe = algo.flatten(observations)
    with torch.no_grad():
        assert float(algo.anchor_kl(probe)) == 0.0
        algo.actor.head.mean.bias.add_(0.3)
        assert float(algo.anchor_kl(probe)) > 0.01
        assert float(SACChunks(small_args()).anchor_kl(probe)) == 0.0  # no cloning, no reference: no anchor


class ScoresChunks(torch.nn.Module):
    """A critic head that scores a chunk by its closeness to a chosen chunk per observation, plus an offset."""

    def __init__(self, favoured: torch.Tensor, offset: float = 0.0) -> None:
        super().__init__()
        self.favoured, self.offset = favoured, offset

    def forward(self, features: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        return self.offset - ((chunks - self.favoured) ** 2).sum(-1)


def test_the_filtered_anchor_lets_go_only_where_both_critics_prefer_the_actors_chunk() -> None:
    algo = cloned(small_args(anchor_filter="q-pessimistic"))
    observations, _ = demonstrations("cartpole", algo, 64, 2)
    probe = algo.flatten(observations)
    with torch.no_grad():
        algo.actor.head.mean.bias.add_(0.3)
        features = algo.critic.encoder(probe)
        actor_chunks, cloned_chunks = algo.actor.squashed_mean(probe), algo.reference.squashed_mean(probe)
        unfiltered = float(algo.anchor_kl(probe))  # without the critics' features: the whole anchor
        assert unfiltered > 0.01
        algo.critic.q1, algo.critic.q2 = ScoresChunks(cloned_chunks), ScoresChunks(cloned_chunks, 1.0)
        assert float(algo.anchor_kl(probe, features)) == pytest.approx(unfiltered)  # both prefer the clone: held
        algo.critic.q1, algo.critic.q2 = ScoresChunks(actor_chunks), ScoresChunks(actor_chunks)
        assert float(algo.anchor_kl(probe, features)) == 0.0  # both prefer the actor's chunk: let go
        algo.critic.q1 = ScoresChunks(cloned_chunks)  # the critics disagree: pessimistic holds
        assert float(algo.anchor_kl(probe, features)) == pytest.approx(unfiltered)
        half = torch.arange(len(probe)) < len(probe) // 2  # the actor's chunk preferred on the first half only
        favoured = torch.where(half[:, None], actor_chunks, cloned_chunks)
        algo.critic.q1, algo.critic.q2 = ScoresChunks(favoured), ScoresChunks(favoured)
        assert 0.0 < float(algo.anchor_kl(probe, features)) < unfiltered
        assert algo.anchor_held.tolist() == (~half).float().tolist()


def test_windows_hold_h_executed_actions_their_rewards_and_whole_chunks_play() -> None:
    args = small_args(max_episode_steps=20, horizon=4, latency_ticks=2, gamma=0.9)
    algo = SACChunks(args)
    envs = gym.vector.SyncVectorEnv([algo.make_env] * 2, autoreset_mode=AutoresetMode.NEXT_STEP)
    policy = algo.make_policy(max_batch_size=2, max_wait_ms=1.0, seed=1)
    executor = ChunkExecutor(envs, policy, period_s=0.005, horizon=4, request_at=1, record_obs=True, latency_ticks=2)
    try:
        executor.reset(seed=3)
        rollout = executor.run(60)  # episodes of 20 ticks: three per env, two autoresets
    finally:
        policy.close()
        envs.close()
    assert executor.stats()["overlap_dropped"] == 0  # request_at = L - 1: the next chunk arrives as the last plays
    windows = rollout_windows(rollout, horizon=4, latency=2, gamma=0.9)
    assert len(windows["env"]) > 40
    ended = rollout.terminated | rollout.truncated
    for obs_tick, next_tick, env, chunk, reward, discount in zip(*windows.values(), strict=True):
        start = obs_tick + 2
        played = next((k + 1 for k in range(4) if ended[start + k, env]), 4)
        np.testing.assert_array_equal(chunk.reshape(4, -1)[:played], rollout.actions[start : start + played, env])
        expected = sum(0.9**k * rollout.rewards[start + k, env] for k in range(played))
        assert reward == pytest.approx(expected)
        if played == 4 and not ended[start + 3, env]:
            assert (next_tick, discount) == (start + 4 - 2, pytest.approx(0.9**4))
        elif rollout.terminated[start + played - 1, env]:
            assert discount == 0.0
        else:  # truncated: bootstrap from the final observation, on the reset tick
            assert next_tick == start + played and rollout.source[next_tick, env] == 3
    # a window that starts where a chunk arrived holds that chunk, as the policy sampled it (squashed)
    first_actions = rollout.policy_choice & (rollout.chunk_index == 0)
    starts = {(int(t) - 2, int(e)) for t, e in zip(*np.nonzero(first_actions), strict=True)}
    matched = [
        (t, e) for t, e, c in zip(windows["obs_tick"], windows["env"], rollout.chunk_id[windows["obs_tick"] + 2, windows["env"]], strict=True)
        if (int(t), int(e)) in starts and c >= 0
    ]  # fmt: skip
    assert matched


def test_the_replay_drops_the_oldest_windows_and_keeps_each_windows_observations() -> None:
    replay = WindowReplay(capacity=3)
    for first in (0.0, 10.0):  # two rollouts of 3 observation rows (the row's number is its value) and 2 windows
        rows = torch.arange(first, first + 3).unsqueeze(1)
        replay.add(rows, np.array([0, 1]), np.array([1, 2]), np.zeros((2, 4)), np.array([first, first + 1]), np.ones(2))
    assert len(replay) == 3 and replay.rewards.tolist() == [1.0, 10.0, 11.0]
    observations, _, rewards, _, next_observations = replay.sample(64)
    expected = {1.0: (1.0, 2.0), 10.0: (10.0, 11.0), 11.0: (11.0, 12.0)}
    for obs, reward, next_obs in zip(observations[:, 0], rewards, next_observations[:, 0], strict=True):
        assert (float(obs), float(next_obs)) == expected[float(reward)]


def test_the_policy_reports_the_actors_log_prob_of_a_squashed_chunk() -> None:
    algo = SACChunks(small_args())
    observations, _ = demonstrations("cartpole", algo, 16, 1)
    flat = algo.flatten(observations)
    policy = algo.make_policy(max_batch_size=1, seed=0)
    try:
        single = {key: value[0] for key, value in observations.items()}
        out = policy.submit(single, env_id=0).result(timeout=30)
    finally:
        policy.close()
    chunk = torch.as_tensor(out.action, dtype=torch.float32).reshape(1, -1)
    assert np.all(np.abs(out.action) <= 1.0)  # inside the bounds without clipping
    with torch.no_grad():
        logp = algo.actor.distribution(flat[:1]).log_prob(chunk)
    assert out.behavior_logp == pytest.approx(float(logp), rel=1e-4, abs=1e-3)
    assert sum(out.token_logps) == pytest.approx(out.behavior_logp)


def test_without_cloning_there_is_no_warm_up_and_training_runs() -> None:
    algo = SACChunks(small_args(iterations=2))
    history = algo.train()
    assert algo.reference is None and "warmup_q_loss" not in history
    assert history["last_update"]["anchor_kl"] == 0.0 and history["windows"] > 0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"horizon": 0}, "--horizon"),
        ({"latency_ticks": 6, "horizon": 4}, "--latency-ticks"),
        ({"gradient_steps": -1}, "--gradient-steps"),
        ({"alpha": 0.0}, "--alpha"),
        ({"gamma": 1.5}, "--gamma"),
        ({"anchor_filter": "Q"}, "--anchor-filter"),
    ],
)
def test_bad_settings_name_the_option(overrides, field) -> None:
    with pytest.raises(ValueError, match=field):
        small_args(**overrides)


def test_bad_env_and_bad_demonstrations_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="SACChunks needs a Box action space"):
        SACChunks(small_args(env="CartPole-v1", env_kwargs="{}"))
    with pytest.raises(ValueError, match="--env-kwargs"):
        SACChunks(small_args(env_kwargs="[1]"))
    algo = SACChunks(small_args())
    observations, chunks = demonstrations("cartpole", algo, 16, 1)
    with pytest.raises(ValueError, match=r"chunks must be \[N, H=4"):
        algo.behavior_clone(observations, chunks[:, :2], steps=1)


def test_the_command_line_help() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "agents" / "sac_chunks.py"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "--anchor-coef" in result.stdout and "--critic-warmup-iterations" in result.stdout
