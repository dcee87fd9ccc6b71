"""`GaussianChunkPolicy`: a torch module's factorized Gaussian over a chunk of ``H`` actions.

A learner that trains on executed actions needs the log-prob of each action of a chunk on its
own (the overlap rule may play only the first few). With a factorized Gaussian,
``log p(chunk) = sum_j log p(a_j)``, and each ``log p(a_j)`` is reported in
``PolicyOutput.token_logps`` (``H`` entries), which `ChunkExecutor` records per executed action
(``ChunkRollout.action_logp``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch.distributions import Normal

from asyncvec.inference.backends.torch_policy import TorchPolicy
from asyncvec.inference.types import BackendResult

__all__ = ["GaussianChunkPolicy"]


class GaussianChunkPolicy(TorchPolicy):
    """A `TorchPolicy` over chunks ``Box((H, *action_shape))`` that reports per-action log-probs.

    The module maps a float32 batch ``[B, *obs_shape]`` to ``(mean, log_std)`` with ``mean``
    ``[B, H, d]`` (or ``[B, H * d]``) and ``log_std`` broadcastable to it (``[H, d]`` or
    ``[B, H, d]``). The chunk is sampled unclipped; ``behavior_logp`` is the chunk's joint
    log-prob and ``token_logps`` the ``H`` per-action ones (each summed over the action's ``d``
    dimensions).

    Args:
        module: the network (put in eval mode; give the policy its own copy).
        chunk_space: ``Box`` of shape ``(H, *action_shape)``.
        obs_key: with dict observations, the module sees only ``obs[obs_key]`` (e.g.
            ``"image"``: the instruction is not read); None flattens the whole observation as
            `TorchPolicy` does.
        squash: tanh-squash the sample into ``chunk_space``'s bounds, as SAC's actor does: the
            module's ``(mean, log_std)`` are the Gaussian's before the squash, the action is
            ``center + half_range * tanh(u)`` for the Gaussian sample ``u`` (the mode: of the mean),
            and the log-probs have the change of variables (agents/sac_chunks.py). Needs finite bounds.
        seed: replay exactly: draw the sampling noise from the policy's own generator and
            compute the requests one at a time, in the order they were submitted, so an answer
            depends only on its observation, the weights and its place in that order, neither on
            how requests were batched nor on other threads' use of torch's global RNG (with
            `ChunkExecutor`'s ``latency_ticks`` a whole run replays). It gives up batching: for
            small networks and tests. None: batched, torch's global RNG.
        **kwargs: as `TorchPolicy` (``observation_space``, ``deterministic``,
            ``max_batch_size``, ``max_wait_ms``...).

    Example:
        >>> import gymnasium as gym, torch
        >>> class Net(torch.nn.Module):
        ...     def forward(self, obs):
        ...         return torch.zeros(obs.shape[0], 4, 1), torch.zeros(4, 1)
        >>> with GaussianChunkPolicy(Net(), gym.spaces.Box(-1, 1, (4, 1)), obs_key="image") as policy:
        ...     out = policy.submit({"image": [[0.0]], "instruction": "go"}, env_id=0).result(timeout=10)
        >>> out.action.shape, len(out.token_logps), abs(sum(out.token_logps) - out.behavior_logp) < 1e-9
        ((4, 1), 4, True)
    """

    def __init__(
        self,
        module: torch.nn.Module,
        chunk_space: gym.spaces.Box,
        *,
        obs_key: str | None = None,
        seed: int | None = None,
        squash: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(chunk_space, gym.spaces.Box) or len(chunk_space.shape) < 1:
            raise ValueError(
                f"GaussianChunkPolicy: chunk_space must be a Box of shape (H, *action_shape), got {chunk_space!r}"
            )
        if squash and not (np.isfinite(chunk_space.low).all() and np.isfinite(chunk_space.high).all()):
            raise ValueError(f"GaussianChunkPolicy: squash=True needs finite bounds, got {chunk_space!r}")
        super().__init__(module, chunk_space, **kwargs)
        self.squash = bool(squash)
        horizon = int(chunk_space.shape[0])
        low, high = (
            torch.as_tensor(b, dtype=torch.float32).reshape(horizon, -1) for b in (chunk_space.low, chunk_space.high)
        )
        self._center, self._half_range = (high + low) / 2, (high - low) / 2
        self.obs_key = obs_key
        self.horizon = int(chunk_space.shape[0])
        self._generator = None if seed is None else torch.Generator().manual_seed(int(seed))

    def _check_obs(self, obs: Any, env_id: int | None) -> np.ndarray:
        if self.obs_key is not None and isinstance(obs, Mapping):
            if self.obs_key not in obs:
                raise ValueError(f"{self._label}: env_id={env_id}: observation has no key {self.obs_key!r} (obs_key)")
            obs = obs[self.obs_key]
        return super()._check_obs(obs, env_id)

    def _forward_batch(self, obs_list: list[np.ndarray]) -> list[BackendResult]:
        batch = torch.as_tensor(np.stack(obs_list), dtype=torch.float32, device=self.device)
        if self._generator is None:
            return self._sample(batch)
        # seeded: one request at a time, so its floats do not depend on the batch it came in either
        return [result for i in range(len(obs_list)) for result in self._sample(batch[i : i + 1])]

    def _sample(self, batch: torch.Tensor) -> list[BackendResult]:
        size = batch.shape[0]
        with torch.no_grad():
            mean, log_std = self.module(batch)
            mean = mean.float().reshape(size, self.horizon, -1)
            dist = Normal(mean, log_std.float().reshape(-1, *mean.shape[1:]).exp().expand_as(mean))
            if self.deterministic:
                action = mean
            elif self._generator is None:
                action = dist.sample()
            else:
                action = mean + dist.stddev * torch.randn(mean.shape, generator=self._generator).to(mean.device)
            per_action = dist.log_prob(action).sum(-1)  # [B, H]
            if (
                self.squash
            ):  # a = center + half_range * tanh(u): log p(a) = log N(u) - log(half_range * (1 - tanh(u)^2))
                center, half_range = self._center.to(action.device), self._half_range.to(action.device)
                log_1m_tanh2 = 2.0 * (np.log(2.0) - action - torch.nn.functional.softplus(-2.0 * action))
                per_action = per_action - (half_range.log() + log_1m_tanh2).sum(-1)
                action = center + half_range * torch.tanh(action)
        actions = action.cpu().numpy()
        logps = per_action.cpu().numpy().astype(np.float64)
        return [
            BackendResult(
                action=self._to_action(actions[i]), logp=float(logps[i].sum()), token_logps=tuple(logps[i].tolist())
            )
            for i in range(size)
        ]
