"""SlowEnv adds the asked-for latency and changes nothing else; example envs are registered."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
import pytest

import asyncvec.envs  # noqa: F401  (registers asyncvec/ ids)
from asyncvec.envs.slow import SlowEnv


def test_results_equal_the_wrapped_env():
    plain, slow = gym.make("CartPole-v1"), SlowEnv(gym.make("CartPole-v1"), latency_ms=1, distribution="lognormal")
    a, _ = plain.reset(seed=3)
    b, _ = slow.reset(seed=3)
    np.testing.assert_array_equal(a, b)
    for t in range(20):
        x, y = plain.step(t % 2), slow.step(t % 2)
        np.testing.assert_array_equal(x[0], y[0])
        assert x[1:4] == y[1:4]
        assert y[4]["latency_ms"] > 0


@pytest.mark.parametrize("busy", [False, True])
def test_fixed_latency_is_waited(busy):
    env = SlowEnv(gym.make("CartPole-v1"), latency_ms=20, busy=busy)
    env.reset(seed=0)
    start = time.perf_counter()
    for _ in range(5):
        env.step(0)
    assert time.perf_counter() - start >= 5 * 0.020


def test_lognormal_has_the_asked_mean_and_a_heavy_tail():
    env = SlowEnv(gym.make("CartPole-v1"), latency_ms=10, distribution="lognormal", sigma=1.0, seed=0)
    draws = np.array([env.sample_latency_ms() for _ in range(20000)])
    assert draws.mean() == pytest.approx(10, rel=0.1)
    assert np.percentile(draws, 99) > 4 * np.median(draws)


def test_uniform_jitter_stays_in_range():
    env = SlowEnv(gym.make("CartPole-v1"), latency_ms=10, distribution="uniform", jitter=0.3, seed=1)
    draws = np.array([env.sample_latency_ms() for _ in range(2000)])
    assert draws.min() >= 7 and draws.max() <= 13 and draws.std() > 1


@pytest.mark.parametrize(
    "kwargs, field",
    [({"latency_ms": -1}, "latencies"), ({"distribution": "pareto"}, "distribution"), ({"jitter": 2}, "jitter")],
)
def test_bad_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SlowEnv(gym.make("CartPole-v1"), **kwargs)


def test_registered_ids_make():
    env = gym.make("asyncvec/SlowCartPole-v0", latency_ms=1)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (4,)
    prompt, _ = gym.make("asyncvec/SingleDigitSums-v0").reset(seed=0)
    assert prompt.endswith("=")
