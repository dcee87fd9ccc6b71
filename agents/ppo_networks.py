"""PPO's networks: the actor (a Categorical or a Gaussian head, chosen by the action space's type) and the critic,
both reading observations through the actor's running normalization (CleanRL's shapes, two tanh layers).

Example:
    >>> import gymnasium as gym, torch
    >>> actor = Actor(4, gym.spaces.Discrete(2), hidden=8)
    >>> logp, entropy = actor.log_prob_entropy(torch.zeros(3, 4), torch.tensor([0, 1, 1]))
    >>> tuple(logp.shape), tuple(Critic(4, 8, obs_norm=actor.obs_norm)(torch.zeros(3, 4)).shape)
    ((3,), (3,))
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
from torch.distributions import Categorical, Normal

from asyncvec.agents.common import layer_init
from asyncvec.normalization import RunningNorm


class Actor(nn.Module):
    """Logits (Discrete: Categorical) or (mean, log_std) (Box: a Gaussian with a state-independent
    log_std, as CleanRL's continuous PPO): what TorchPolicy samples from. The choice follows the
    action space's type, never the env id. Observations pass through ``obs_norm`` first."""

    def __init__(self, obs_dim: int, action_space: gym.Space, hidden: int, normalize_obs: bool = True) -> None:
        super().__init__()
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        out = action_space.n if self.discrete else int(np.prod(action_space.shape))
        self.obs_norm = RunningNorm(obs_dim, enabled=normalize_obs)
        self.body = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, out), std=0.01),
        )
        if not self.discrete:
            self.log_std = nn.Parameter(torch.zeros(out))

    def forward(self, obs: torch.Tensor):
        out = self.body(self.obs_norm(obs))
        return out if self.discrete else (out, self.log_std.expand_as(out))

    def distribution(self, obs: torch.Tensor):
        out = self(obs)
        return Categorical(logits=out) if self.discrete else Normal(out[0], out[1].exp())

    def log_prob_entropy(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = self.distribution(obs)
        if self.discrete:
            return dist.log_prob(actions.long()), dist.entropy()
        return dist.log_prob(actions).sum(-1), dist.entropy().sum(-1)


class Critic(nn.Module):
    """State value; it normalizes observations with the actor's statistics (``obs_norm``, shared)."""

    def __init__(self, obs_dim: int, hidden: int, obs_norm: RunningNorm | None = None) -> None:
        super().__init__()
        self.obs_norm = obs_norm if obs_norm is not None else RunningNorm(obs_dim, enabled=False)
        self.body = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, 1), std=1.0),
        )

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.body(self.obs_norm(obs)).squeeze(-1)
