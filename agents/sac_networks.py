"""SAC's networks (CleanRL's sac_continuous_action shapes, two ReLU layers): a tanh-squashed Gaussian actor scaled to
the action bounds, and a soft Q-function.

Example:
    >>> import gymnasium as gym, torch
    >>> actor = Actor(3, gym.spaces.Box(-2.0, 2.0, (1,)), hidden=8)
    >>> action, logp = actor.sample(torch.zeros(4, 3))
    >>> tuple(action.shape), tuple(logp.shape), tuple(SoftQ(3, 1, hidden=8)(torch.zeros(4, 3), action).shape)
    ((4, 1), (4,), (4,))
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
from torch.distributions import AffineTransform, Independent, Normal, TanhTransform, TransformedDistribution

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class Actor(nn.Module):
    """Tanh-squashed Gaussian scaled to the action bounds; ``forward`` returns the distribution."""

    def __init__(self, obs_dim: int, action_space: gym.spaces.Box, hidden: int) -> None:
        super().__init__()
        act_dim = int(np.prod(action_space.shape))
        self.body = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.mean = nn.Linear(hidden, act_dim)
        self.log_std = nn.Linear(hidden, act_dim)
        self.register_buffer("scale", torch.as_tensor((action_space.high - action_space.low) / 2, dtype=torch.float32))
        self.register_buffer("bias", torch.as_tensor((action_space.high + action_space.low) / 2, dtype=torch.float32))

    def forward(self, obs: torch.Tensor) -> Independent:
        h = self.body(obs)
        log_std = torch.tanh(self.log_std(h))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        base = Normal(self.mean(h), log_std.exp())
        squash = [TanhTransform(cache_size=1), AffineTransform(self.bias, self.scale, cache_size=1)]
        return Independent(TransformedDistribution(base, squash), 1)

    def sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterized action and its log-prob (tanh correction included)."""
        dist = self(obs)
        action = dist.rsample()
        return action, dist.log_prob(action)

    def log_prob(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """Log-prob of a stored action (clamped inside the bounds so atanh stays finite)."""
        inner = ((action - self.bias) / self.scale).clamp(-1 + 1e-6, 1 - 1e-6)
        return self(obs).log_prob(inner * self.scale + self.bias)


class SoftQ(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim + act_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([obs, action], -1)).squeeze(-1)
