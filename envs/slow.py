"""``SlowEnv``: adds step latency to any env, to play a remote simulator, a robot or a heavy simulator."""

from __future__ import annotations

import math
import time
from typing import Any

import gymnasium as gym
import numpy as np

DISTRIBUTIONS = ("fixed", "uniform", "lognormal")


class SlowEnv(gym.Wrapper):
    """Makes each ``step`` (and optionally ``reset``) take extra time.

    Latency per call, in milliseconds, with mean ``latency_ms``:

    * ``"fixed"``: always ``latency_ms``.
    * ``"uniform"``: uniform in ``latency_ms * [1 - jitter, 1 + jitter]``.
    * ``"lognormal"``: heavy-tailed, ``exp(N(mu, sigma^2))`` with ``mu`` chosen so that the mean
      is ``latency_ms`` (sigma=1 gives a p99 of about 6x the median).

    With ``busy=False`` the wrapper sleeps (a remote simulator or a robot: the core is free);
    with ``busy=True`` it spins the CPU (a heavy local simulator). The latency draws use their
    own generator, so the wrapped env's results are the same as without the wrapper.

    Example:
        >>> import gymnasium as gym
        >>> from asyncvec.envs.slow import SlowEnv
        >>> env = SlowEnv(gym.make("CartPole-v1"), latency_ms=10, distribution="lognormal")
        >>> obs, info = env.reset(seed=0)
        >>> obs, reward, terminated, truncated, info = env.step(0)
        >>> info["latency_ms"] > 0
        True
    """

    def __init__(
        self,
        env: gym.Env,
        latency_ms: float = 10.0,
        distribution: str = "fixed",
        jitter: float = 0.5,
        sigma: float = 1.0,
        busy: bool = False,
        reset_latency_ms: float = 0.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(env)
        if latency_ms < 0 or reset_latency_ms < 0:
            raise ValueError(
                f"latencies must be >= 0 ms, got latency_ms={latency_ms}, reset_latency_ms={reset_latency_ms}"
            )
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        if not 0 <= jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {jitter}")
        if sigma <= 0:
            raise ValueError(f"sigma must be > 0, got {sigma}")
        self.latency_ms = float(latency_ms)
        self.distribution = distribution
        self.jitter = float(jitter)
        self.sigma = float(sigma)
        self.busy = bool(busy)
        self.reset_latency_ms = float(reset_latency_ms)
        self._latency_rng = np.random.default_rng(seed)

    def sample_latency_ms(self) -> float:
        """Draws one step latency in milliseconds."""
        if self.latency_ms == 0 or self.distribution == "fixed":
            return self.latency_ms
        if self.distribution == "uniform":
            return self.latency_ms * self._latency_rng.uniform(1 - self.jitter, 1 + self.jitter)
        mu = math.log(self.latency_ms) - self.sigma**2 / 2
        return float(self._latency_rng.lognormal(mu, self.sigma))

    def _wait(self, milliseconds: float) -> None:
        if milliseconds <= 0:
            return
        if not self.busy:
            time.sleep(milliseconds / 1000)
            return
        end = time.perf_counter() + milliseconds / 1000
        while time.perf_counter() < end:
            pass

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if seed is not None:
            self._latency_rng = np.random.default_rng([seed, 0x5105])
        self._wait(self.reset_latency_ms)
        return self.env.reset(seed=seed, options=options)

    def step(self, action: Any):
        latency = self.sample_latency_ms()
        self._wait(latency)
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, {**info, "latency_ms": latency}


def make_slow(env_id: str = "CartPole-v1", **slow_kwargs: Any) -> SlowEnv:
    """``gym.make(env_id)`` wrapped in a :class:`SlowEnv` (the entry point of ``asyncvec/SlowCartPole-v0``)."""
    return SlowEnv(gym.make(env_id), **slow_kwargs)
