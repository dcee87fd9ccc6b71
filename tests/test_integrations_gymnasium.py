"""The gymnasium way in: asyncvec.make_vec, gymnasium.make_vec, gymnasium's vector wrappers (lockstep and
partial batches), a CleanRL-style PPO loop, and gymnasium 1.4 next to the 1.2.2 that ray[rllib] pins."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.wrappers import vector as gym_wrappers
from toy_envs import CounterEnv

import asyncvec
from asyncvec import AsyncLLMVectorEnv
from asyncvec.integrations.gymnasium import VECTOR_ENV_ID
from asyncvec.vector import wrappers

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- make_vec


def test_make_vec_mirrors_gymnasium_make_vec(no_leftover_children):
    envs = asyncvec.make_vec(
        "Pendulum-v1",
        num_envs=3,
        vector_kwargs={"batch_size": 2, "max_restarts": 1},
        g=2.0,
        wrappers=[gym.wrappers.TimeAwareObservation],
    )
    reference = gym.make_vec(
        "Pendulum-v1", num_envs=3, vectorization_mode="sync", g=2.0, wrappers=[gym.wrappers.TimeAwareObservation]
    )
    try:
        assert isinstance(envs, AsyncLLMVectorEnv) and (envs.num_envs, envs.batch_size) == (3, 2)
        assert envs.single_observation_space == reference.single_observation_space  # the wrapper ran in each worker
        assert envs.get_attr("g") == (2.0, 2.0, 2.0)
        assert envs.spec.id == "Pendulum-v1" and envs.spec.max_episode_steps == 200
        assert envs.spec.kwargs["g"] == 2.0 and envs.spec.kwargs["num_envs"] == 3
        obs, _ = envs.reset(seed=5)
        obs_ref, _ = reference.reset(seed=5)
        np.testing.assert_array_equal(obs, obs_ref)
    finally:
        envs.close()
        reference.close()


def test_gymnasium_make_vec_builds_one_through_the_registered_id(no_leftover_children):
    assert VECTOR_ENV_ID in gym.registry, "import asyncvec registers it"
    envs = gym.make_vec(VECTOR_ENV_ID, num_envs=2, env_id="CartPole-v1", batch_size=1, max_restarts=2)
    try:
        assert isinstance(envs, AsyncLLMVectorEnv) and envs.batch_size == 1 and envs.restarts == [0, 0]
        envs.async_reset(seed=0)
        obs, *_, info = envs.recv()
        assert obs.shape == (1, 4) and len(info["env_id"]) == 1
    finally:
        envs.close()


def test_make_vec_bad_input_names_the_fix():
    with pytest.raises(TypeError, match=r"AsyncLLMVectorEnv has no argument\(s\) \['batchsize'\]"):
        asyncvec.make_vec("CartPole-v1", 2, vector_kwargs={"batchsize": 1})
    with pytest.raises(gym.error.Error, match="CartPole"):
        asyncvec.make_vec("CartPol-v1", 2)
    with pytest.raises(ValueError, match="num_envs must be a positive int"):
        asyncvec.make_vec("CartPole-v1", 0)
    with pytest.raises(TypeError, match="needs env_id="):
        gym.make_vec(VECTOR_ENV_ID, num_envs=2)


# ------------------------------------------------------------------------- gymnasium's wrappers, lockstep


def _wrapped(envs, clip=True):
    envs = gym_wrappers.RecordEpisodeStatistics(envs)
    envs = gym_wrappers.NormalizeObservation(envs)
    envs = gym_wrappers.TransformObservation(envs, lambda obs: np.clip(obs, -5, 5), envs.observation_space)
    envs = gym_wrappers.NormalizeReward(envs)
    return gym_wrappers.ClipAction(envs) if clip else envs


def _without_wall_time(result: tuple) -> tuple:
    """A step's results with the episodes' wall-clock durations (``info["episode"]["t"]``) left out."""
    info = dict(result[-1])
    if "episode" in info:
        info["episode"] = {key: value for key, value in info["episode"].items() if key != "t"}
    return (*result[:-1], info)


def test_gymnasium_vector_wrappers_on_top_give_the_same_results_as_sync_vector_env(no_leftover_children):
    make = functools.partial(gym.make, "MountainCarContinuous-v0", max_episode_steps=60)
    ours = _wrapped(AsyncLLMVectorEnv([make] * 3))
    theirs = _wrapped(gym.vector.SyncVectorEnv([make] * 3))
    try:
        for a, b in zip(ours.reset(seed=3), theirs.reset(seed=3)):
            np.testing.assert_equal(a, b)
        rng = np.random.default_rng(0)
        for _ in range(130):
            actions = rng.uniform(-3, 3, size=(3, 1)).astype(np.float32)  # outside [-1, 1]: ClipAction clips
            for a, b in zip(_without_wall_time(ours.step(actions)), _without_wall_time(theirs.step(actions))):
                np.testing.assert_equal(a, b)
        stats = ours.env.env.env.env
        assert stats.episode_count == 6 and list(stats.length_queue) == [60] * 6
    finally:
        ours.close()
        theirs.close()


# ---------------------------------------------------------------------- the same wrappers, partial batches


def _partial(envs):
    envs = wrappers.RecordEpisodeStatistics(envs)
    envs = wrappers.NormalizeObservation(envs)
    envs = wrappers.TransformObservation(envs, lambda obs: np.clip(obs, -5, 5), envs.observation_space)
    envs = wrappers.NormalizeReward(envs)
    return wrappers.ClipAction(envs)


def test_partial_batch_wrappers_equal_gymnasiums_in_lockstep(no_leftover_children):
    make = functools.partial(gym.make, "MountainCarContinuous-v0", max_episode_steps=60)
    lockstep = _wrapped(AsyncLLMVectorEnv([make] * 3))
    partial = _partial(AsyncLLMVectorEnv([make] * 3))
    try:
        obs, info = lockstep.reset(seed=3)
        partial.async_reset(seed=3)
        batch = partial.recv()
        order = np.argsort(batch[4]["env_id"])  # rows arrive in any order: float sums differ in the last bits
        np.testing.assert_allclose(obs, batch[0][order], rtol=1e-5, atol=1e-6)
        rng = np.random.default_rng(0)
        for _ in range(130):
            actions = rng.uniform(-3, 3, size=(3, 1)).astype(np.float32)
            expected = lockstep.step(actions)
            partial.send(actions)
            batch = partial.recv()
            order = np.argsort(batch[4]["env_id"])
            for a, b in zip(expected[:4], batch[:4]):
                np.testing.assert_allclose(a, np.asarray(b)[order], rtol=1e-5, atol=1e-6)
            if "episode" in expected[4]:
                np.testing.assert_allclose(expected[4]["episode"]["r"], batch[4]["episode"]["r"][order])
    finally:
        lockstep.close()
        partial.close()


def test_partial_batches_keep_per_env_statistics(no_leftover_children):
    # 6 envs, batches of 2: every env's return and length are its own, whatever the arrival order.
    envs = AsyncLLMVectorEnv([functools.partial(CounterEnv, max_len=6)] * 6, batch_size=2)
    stats = wrappers.RecordEpisodeStatistics(envs)
    outer = wrappers.TransformReward(stats, lambda reward: 2 * reward)
    running = np.zeros(6)
    ended = np.zeros(6, dtype=bool)
    finished: list[tuple[int, float]] = []
    try:
        outer.async_reset(seed=0)
        rng = np.random.default_rng(1)
        for _ in range(150):
            obs, rewards, terminated, truncated, info = outer.recv()
            ids = info["env_id"]
            assert obs.shape == (len(ids), 3)
            for k, env_id in enumerate(ids):
                if not ended[env_id]:  # NEXT_STEP: the row after an env's last step is its reset
                    running[env_id] += rewards[k] / 2  # TransformReward doubled what RecordEpisodeStatistics saw
                ended[env_id] = terminated[k] or truncated[k]
                if ended[env_id]:
                    assert info["_episode"][k]
                    np.testing.assert_allclose(info["episode"]["r"][k], running[env_id])
                    finished.append((int(env_id), running[env_id]))
                    running[env_id] = 0.0
            outer.send(rng.integers(0, 3, size=len(ids)), ids)
        assert len({env_id for env_id, _ in finished}) == 6, "every env finished episodes"
        assert list(stats.return_queue)[-len(finished) :] == pytest.approx([r for _, r in finished][-100:])
    finally:
        outer.close()


def test_partial_batch_errors_say_what_to_use(no_leftover_children):
    envs = AsyncLLMVectorEnv([lambda: gym.make("CartPole-v1")] * 2)
    try:
        mixed = wrappers.RecordEpisodeStatistics(gym_wrappers.NormalizeObservation(envs))
        with pytest.raises(
            AttributeError, match=r"NormalizeObservation has no async_reset\(\).*asyncvec.vector.wrappers"
        ):
            mixed.async_reset(seed=0)
    finally:
        envs.close()
    same_step = AsyncLLMVectorEnv([lambda: gym.make("CartPole-v1")] * 2, autoreset_mode="SameStep")
    try:
        with pytest.raises(ValueError, match="partial batches need NEXT_STEP or DISABLED autoreset"):
            wrappers.TransformReward(same_step, lambda r: r).async_reset()
    finally:
        same_step.close()


# --------------------------------------------------------------------------- a CleanRL-style PPO loop


def make_env(env_id: str):
    def thunk():
        return gym.wrappers.RecordEpisodeStatistics(gym.make(env_id))

    return thunk


class Agent(torch.nn.Module):
    def __init__(self, envs):
        super().__init__()
        obs_dim = int(np.prod(envs.single_observation_space.shape))

        def mlp(out: int, std: float) -> torch.nn.Sequential:
            layers = [
                torch.nn.Linear(obs_dim, 64),
                torch.nn.Tanh(),
                torch.nn.Linear(64, 64),
                torch.nn.Tanh(),
                torch.nn.Linear(64, out),
            ]
            for layer, gain in zip(layers[::2], (np.sqrt(2), np.sqrt(2), std)):
                torch.nn.init.orthogonal_(layer.weight, gain)
                torch.nn.init.constant_(layer.bias, 0.0)
            return torch.nn.Sequential(*layers)

        self.critic = mlp(1, 1.0)
        self.actor = mlp(envs.single_action_space.n, 0.01)

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        probs = torch.distributions.Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def cleanrl_ppo(
    envs,
    *,
    total_timesteps: int,
    seed: int = 1,
    target_return: float | None = None,
    num_steps: int = 128,
    learning_rate: float = 2.5e-3,
    num_minibatches: int = 4,
    update_epochs: int = 4,
    gamma: float = 0.99,
    gae_lambda: float = 0.95,
    clip_coef: float = 0.2,
    ent_coef: float = 0.01,
    vf_coef: float = 0.5,
    max_grad_norm: float = 0.5,
):
    """CleanRL's ppo.py loop (the classic shape, our own code): returns (episode returns, global steps)."""
    torch.manual_seed(seed)
    num_envs = envs.num_envs
    batch_size = num_envs * num_steps
    minibatch_size = batch_size // num_minibatches
    num_iterations = total_timesteps // batch_size
    agent = Agent(envs)
    optimizer = torch.optim.Adam(agent.parameters(), lr=learning_rate, eps=1e-5)

    obs = torch.zeros((num_steps, num_envs) + envs.single_observation_space.shape)
    actions = torch.zeros((num_steps, num_envs) + envs.single_action_space.shape)
    logprobs = torch.zeros((num_steps, num_envs))
    rewards = torch.zeros((num_steps, num_envs))
    dones = torch.zeros((num_steps, num_envs))
    values = torch.zeros((num_steps, num_envs))

    global_step = 0
    episode_returns: list[float] = []
    next_obs, _ = envs.reset(seed=seed)
    next_obs = torch.Tensor(next_obs)
    next_done = torch.zeros(num_envs)
    for iteration in range(1, num_iterations + 1):
        optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * learning_rate
        for step in range(num_steps):
            global_step += num_envs
            obs[step] = next_obs
            dones[step] = next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob
            next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
            next_done = np.logical_or(terminations, truncations)
            rewards[step] = torch.tensor(reward).view(-1)
            next_obs, next_done = torch.Tensor(next_obs), torch.Tensor(next_done)
            if "episode" in infos:
                episode_returns += [float(r) for r in infos["episode"]["r"][infos["_episode"]]]

        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(num_steps)):
                if t == num_steps - 1:
                    nextnonterminal, nextvalues = 1.0 - next_done, next_value
                else:
                    nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
                delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
            returns = advantages + values

        b_obs = obs.reshape((-1,) + envs.single_observation_space.shape)
        b_logprobs, b_actions = logprobs.reshape(-1), actions.reshape((-1,) + envs.single_action_space.shape)
        b_advantages, b_returns = advantages.reshape(-1), returns.reshape(-1)
        b_inds = np.arange(batch_size)
        for _ in range(update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                mb_inds = b_inds[start : start + minibatch_size]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])
                ratio = (newlogprob - b_logprobs[mb_inds]).exp()
                mb_advantages = b_advantages[mb_inds]
                mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
                pg_loss = torch.max(
                    -mb_advantages * ratio, -mb_advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
                ).mean()
                v_loss = 0.5 * ((newvalue.view(-1) - b_returns[mb_inds]) ** 2).mean()
                loss = pg_loss - ent_coef * entropy.mean() + v_loss * vf_coef
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(agent.parameters(), max_grad_norm)
                optimizer.step()
        if target_return is not None and len(episode_returns) >= 20 and np.mean(episode_returns[-20:]) >= target_return:
            break
    return episode_returns, global_step


def test_cleanrl_loop_sees_the_same_data_with_either_vector_env(no_leftover_children, one_torch_thread):
    # One iteration (4 envs x 64 steps, then the update) with gymnasium's SyncVectorEnv and with
    # asyncvec: same seeds, so the same episodes.
    sync = gym.vector.SyncVectorEnv([make_env("CartPole-v1") for _ in range(4)])
    ours = AsyncLLMVectorEnv([make_env("CartPole-v1") for _ in range(4)])
    try:
        assert cleanrl_ppo(sync, total_timesteps=256, num_steps=64) == cleanrl_ppo(
            ours, total_timesteps=256, num_steps=64
        )
    finally:
        sync.close()
        ours.close()


def train_cleanrl_ppo(seed: int, target: float = 150, budget: int = 40_960) -> tuple[float, int]:
    """The CleanRL-style loop on asyncvec's env until the 20-episode mean return reaches ``target``."""
    envs = AsyncLLMVectorEnv([make_env("CartPole-v1") for _ in range(4)])  # was gym.vector.SyncVectorEnv(...)
    try:
        episode_returns, steps = cleanrl_ppo(envs, total_timesteps=budget, seed=seed, target_return=target)
    finally:
        envs.close()
    return float(np.mean(episode_returns[-20:])), steps


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cleanrl_style_ppo_learns_cartpole_with_only_the_env_line_changed(no_leftover_children, one_torch_thread):
    # Measured (seeds 0-2): 20-episode mean 162/158/163 at 7.2k/7.7k/7.7k steps (36-46 s, load 9-13); target 150
    # within 40,960 steps, 5x the steps used.
    start = time.monotonic()
    mean, steps = train_cleanrl_ppo(seed=1)
    print(f"CleanRL-style PPO: 20-episode mean return {mean:.1f} after {steps} steps, {time.monotonic() - start:.0f} s")
    assert mean >= 150, f"20-episode mean return {mean:.1f} after {steps} steps (budget 40,960)"


# ------------------------------------------------------------------------------- gymnasium 1.4 as well

GYMNASIUM_1_4 = ROOT / ".venv" / "gymnasium-1.4"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_gymnasium_tests_pass_on_gymnasium_1_4_too():
    """ray[rllib] pins gymnasium 1.2.2 in the test venv; users without RLlib get 1.4 (the Makefile
    installs it next to the venv, in .venv/gymnasium-1.4). The vector-env and gymnasium tests run on it."""
    if os.environ.get("ASYNCVEC_GYMNASIUM_OVERLAY") == "1":
        pytest.skip("already running inside the gymnasium 1.4 run")
    assert (GYMNASIUM_1_4 / "gymnasium").is_dir(), (
        f"{GYMNASIUM_1_4} is missing: `make test` installs it "
        f"(pip install --no-deps --target {GYMNASIUM_1_4} gymnasium==1.4.0)"
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{GYMNASIUM_1_4}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "ASYNCVEC_GYMNASIUM_OVERLAY": "1",
    }
    version = subprocess.run(
        [sys.executable, "-c", "import gymnasium; print(gymnasium.__version__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version == "1.4.0"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not slow",
            "tests/test_integrations_gymnasium.py",
            "tests/test_integrations_common.py",
            "tests/test_vector_env.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
