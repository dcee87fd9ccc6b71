"""Normalization that stays honest when the policy acts asynchronously.

`RunningNorm` keeps observation statistics as module buffers, so they travel with ``state_dict``: with every published
version and checkpoint, the policy acting in the envs normalizes exactly as the learner did when it made that version.
`RewardScaler` scales rewards by the running std of each env's discounted return in the learner, on ``[T, N]``
segments, instead of in the env (where an async collector would scale with statistics the learner never saw).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from gymnasium.wrappers.utils import RunningMeanStd

__all__ = ["RewardScaler", "RunningNorm"]


class RunningNorm(nn.Module):
    """``(x - mean) / std`` by running statistics, clipped to ``+-clip``; an identity until ``update``.

    The statistics are buffers: they travel with ``state_dict`` (so with every published version and
    every checkpoint), and the policy acting in the envs normalizes as the learner does.

    Example:
        >>> norm = RunningNorm(1)
        >>> norm.update(torch.tensor([[1.0], [3.0]]))
        >>> norm(torch.tensor([[3.0]])).item()
        1.0
    """

    def __init__(self, dim: int, clip: float = 10.0, enabled: bool = True) -> None:
        super().__init__()
        self.clip, self.enabled = clip, enabled
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.tensor(0.0))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Merges the batch ``x`` ``[B, dim]`` into the statistics (parallel variance formula)."""
        if not self.enabled or x.shape[0] == 0:
            return
        n, mean, var = x.shape[0], x.mean(0), x.var(0, unbiased=False)
        total = self.count + n
        delta = mean - self.mean
        m2 = self.var * self.count + var * n + delta**2 * self.count * n / total
        self.mean.add_(delta * n / total)
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or self.count == 0:
            return x
        return ((x - self.mean) / torch.sqrt(self.var + 1e-8)).clamp(-self.clip, self.clip)


class RewardScaler:
    """Divides rewards by the running std of each env's discounted return, clipped to ``+-clip``
    (what gymnasium's NormalizeReward does in an env, done here in the learner on ``[T, N]`` segments,
    whose columns are each env's consecutive steps)."""

    def __init__(self, num_envs: int, gamma: float, clip: float = 10.0) -> None:
        self.gamma, self.clip = gamma, clip
        self.returns = np.zeros(num_envs)
        self.stats = RunningMeanStd(shape=())

    def __call__(self, rewards: np.ndarray, dones: np.ndarray) -> np.ndarray:
        discounted = np.empty_like(rewards, dtype=np.float64)
        for t in range(rewards.shape[0]):
            self.returns = self.returns * self.gamma + rewards[t]
            discounted[t] = self.returns
            self.returns[dones[t]] = 0.0
        self.stats.update(discounted.reshape(-1))
        return np.clip(rewards / np.sqrt(self.stats.var + 1e-8), -self.clip, self.clip).astype(np.float32)

    def state_dict(self) -> dict:
        return {"returns": self.returns, "mean": self.stats.mean, "var": self.stats.var, "count": self.stats.count}

    def load_state_dict(self, state: dict) -> None:
        self.returns = np.asarray(state["returns"], dtype=np.float64)
        self.stats.mean, self.stats.var, self.stats.count = state["mean"], state["var"], state["count"]
