"""RLlib (new API stack) through asyncvec.integrations.rllib: PPO on a local Ray with VECTOR_ENTRY_POINT."""

from __future__ import annotations

import functools
import time

import gymnasium as gym
import pytest
from toy_envs import CounterEnv

from asyncvec import AsyncLLMVectorEnv
from asyncvec.integrations.rllib import make_creator, register


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module (2 CPUs, no dashboard), shut down after it."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_creator_builds_an_async_llm_vector_env_from_the_env_config(no_leftover_children):
    creator = make_creator("Pendulum-v1", max_restarts=2)
    envs = creator({"num_envs": 3, "g": 3.0})  # what RLlib passes: env_config | {"num_envs": n}
    try:
        assert isinstance(envs, AsyncLLMVectorEnv) and envs.num_envs == 3 and envs.restarts == [0, 0, 0]
        assert envs.get_attr("g") == (3.0, 3.0, 3.0)
    finally:
        envs.close()


def test_bad_input_names_rllib_and_the_fix(no_leftover_children):
    with pytest.raises(ValueError, match="gym_env_vectorize_mode=gymnasium.VectorizeMode.VECTOR_ENTRY_POINT"):
        make_creator("CartPole-v1")({})  # RLlib's single-env path
    with pytest.raises(ValueError, match="NEXT_STEP autoreset"):
        make_creator("CartPole-v1", autoreset_mode="SameStep")
    with pytest.raises(TypeError, match="RLlib cannot take the observation space Text"):
        make_creator(functools.partial(CounterEnv, obs_kind="text"))({"num_envs": 2})


def train_rllib_ppo(seed: int, iterations: int = 4) -> tuple[list[float], int]:
    """RLlib's PPO (new API stack) for ``iterations`` of 1000 steps: mean return by iteration, steps."""
    from ray.rllib.algorithms.ppo import PPOConfig

    name = register("asyncvec-test-cartpole", "CartPole-v1", max_restarts=1)
    config = (
        PPOConfig()
        .environment(name)
        .env_runners(
            num_env_runners=0, num_envs_per_env_runner=4, gym_env_vectorize_mode=gym.VectorizeMode.VECTOR_ENTRY_POINT
        )
        .training(train_batch_size_per_learner=1000, minibatch_size=125, num_epochs=8, lr=1e-3)
        .debugging(seed=seed)
    )
    algorithm = config.build_algo()
    try:
        env = algorithm.env_runner.env.unwrapped
        assert isinstance(env, AsyncLLMVectorEnv) and env.num_envs == 4
        returns = []
        for _ in range(iterations):
            metrics = algorithm.train()["env_runners"]
            returns.append(float(metrics["episode_return_mean"]))
        return returns, int(metrics["num_env_steps_sampled_lifetime"])
    finally:
        algorithm.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rllib_ppo_improves_the_return(local_ray, no_leftover_children, one_torch_thread):
    # 4 iterations of 1000 steps, no early stop. Measured (seeds 0-2): mean return by iteration 21->98, 23->85,
    # 26->97 (63-82 s, load 6-11); the test asks for 40 and 1.5x the first iteration, half of the worst seed's.
    start = time.monotonic()
    returns, steps = train_rllib_ppo(seed=0)
    print(f"RLlib PPO: mean return by iteration {[round(r, 1) for r in returns]} after {steps} steps, "
          f"{time.monotonic() - start:.0f} s")  # fmt: skip
    assert returns[-1] >= 1.5 * returns[0] and returns[-1] >= 40, f"mean return by iteration {returns}"
