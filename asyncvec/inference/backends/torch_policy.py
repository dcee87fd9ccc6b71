"""`TorchPolicy`: a local ``nn.Module`` answering batched requests on a worker thread."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch.distributions import Categorical, Distribution, Independent, Normal

from asyncvec.inference.base import BatchedPolicy
from asyncvec.inference.types import BackendResult
from asyncvec.inference.weights import WeightsSource, apply_state_dict, load_state_dict_source


class TorchPolicy(BatchedPolicy):
    """A local torch module behind a `DynamicBatcher`, for Discrete and Box action spaces.

    The module is called on a float32 tensor of stacked observations ``[B, *obs_shape]``
    and must return one of:

    * a ``torch.distributions.Distribution`` over the batch;
    * a logits tensor ``[B, n]`` (Discrete: Categorical);
    * a tuple ``(mean, log_std)`` with ``mean`` ``[B, d]`` and ``log_std`` ``[B, d]`` or
      ``[d]`` (Box with ``d`` = number of action elements: independent Normal, log-prob
      summed over dimensions).

    Actions are sampled (``deterministic=False``) or the distribution's mode. Box actions
    are returned unclipped, because ``behavior_logp`` belongs to the sampled value; clip
    in the env wrapper if the env needs it. With ``deterministic=True`` the log-prob is the
    mode's log-density under the distribution (an evaluation setting, not a behaviour policy
    for importance weighting).

    Observations: numeric arrays (checked against ``observation_space`` if given, else
    against the first observation's shape). Dict, Tuple and Discrete observation spaces are
    flattened with `gymnasium.spaces.flatten`; Box observations keep their shape.

    The module is put in eval mode and used from the batch worker; give the policy its own
    copy if a learner trains the original. ``**kwargs`` go to `BatchedPolicy`
    (``max_batch_size``, ``max_wait_ms``, ``deadline_ms``, ``fallback``, ``cache_size``...).

    Example:
        >>> import gymnasium as gym, torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
        >>> with TorchPolicy(net, gym.spaces.Discrete(2), max_wait_ms=2) as policy:
        ...     out = policy.submit([0.1, 0.0, -0.1, 0.2], env_id=0).result(timeout=10)
        ...     outs = policy.act([[0.0] * 4, [1.0] * 4], timeout=10)
        >>> out.action in (0, 1), out.behavior_logp <= 0.0, len(outs)
        (True, True, 2)
    """

    def __init__(
        self,
        module: torch.nn.Module,
        action_space: gym.Space,
        *,
        observation_space: gym.Space | None = None,
        deterministic: bool = False,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"TorchPolicy: module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(action_space, (gym.spaces.Discrete, gym.spaces.Box)):
            raise ValueError(f"TorchPolicy: action_space must be Discrete or Box, got {action_space!r}")
        if observation_space is not None and not isinstance(observation_space, gym.Space):
            raise TypeError(
                f"TorchPolicy: observation_space must be a gymnasium.Space, got {type(observation_space).__name__}"
            )
        super().__init__(action_space=action_space, **kwargs)
        self.module = module.eval()
        self.observation_space = observation_space
        self.deterministic = bool(deterministic)
        if device is None:
            first = next(module.parameters(), None)
            device = first.device if first is not None else "cpu"
        self.device = torch.device(device)
        self._action_size = int(np.prod(action_space.shape)) if isinstance(action_space, gym.spaces.Box) else 1
        self._obs_shape: tuple[int, ...] | None = None
        self._shape_lock = threading.Lock()

    # ------------------------------------------------------------------------ observations
    def _check_obs(self, obs: Any, env_id: int | None) -> np.ndarray:
        where = f"{self._label}: env_id={env_id}: " if env_id is not None else f"{self._label}: "
        space = self.observation_space
        if space is None:
            if isinstance(obs, Mapping):
                raise ValueError(f"{where}dict observations need observation_space=... (a Dict space) to be flattened")
            array = _numeric_array(obs, where, "a numeric array")
            with self._shape_lock:
                if self._obs_shape is None:
                    self._obs_shape = array.shape
            if array.shape != self._obs_shape:
                expected = f"expected {self._obs_shape} (the first observation's shape)"
                raise ValueError(f"{where}observation has shape {array.shape}, {expected}")
            return array
        if isinstance(space, gym.spaces.Box):
            array = _numeric_array(obs, where, f"an array for {space}")
            if array.shape != space.shape:
                raise ValueError(
                    f"{where}observation has shape {array.shape}, expected {space.shape} for observation_space {space}"
                )
            return array
        if isinstance(space, gym.spaces.Dict):
            if not isinstance(obs, Mapping):
                raise ValueError(
                    f"{where}expected a dict observation for observation_space {space}, got {type(obs).__name__}"
                )
            if set(obs) != set(space.spaces):
                raise ValueError(
                    f"{where}observation keys {sorted(obs)} do not match observation_space keys {sorted(space.spaces)}"
                )
            for key, sub in space.spaces.items():
                if isinstance(sub, gym.spaces.Box):
                    value = _numeric_array(obs[key], where, f"an array for key {key!r} of {sub}")
                    if value.shape != sub.shape:
                        raise ValueError(
                            f"{where}observation[{key!r}] has shape {value.shape}, expected {sub.shape} for {sub}"
                        )
        try:
            return np.asarray(gym.spaces.flatten(space, obs), dtype=np.float32)
        except Exception as exc:
            raise ValueError(f"{where}observation does not fit observation_space {space}: {exc}") from exc

    # ---------------------------------------------------------------------------- forward
    def _forward_batch(self, obs_list: list[np.ndarray]) -> list[BackendResult]:
        batch = torch.as_tensor(np.stack(obs_list), dtype=torch.float32, device=self.device)
        size = batch.shape[0]
        with torch.no_grad():
            dist = self._distribution(self.module(batch), size)
            action = _mode(dist) if self.deterministic else dist.sample()
            logp = dist.log_prob(action)
            while logp.dim() > 1:  # a user distribution without Independent: joint log-prob
                logp = logp.sum(-1)
        logps = logp.detach().cpu().numpy().astype(np.float64)
        actions = action.detach().cpu().numpy()
        if logps.shape != (size,):
            raise ValueError(f"{self._label}: log_prob has shape {logps.shape}, expected ({size},)")
        return [BackendResult(action=self._to_action(actions[i]), logp=float(logps[i])) for i in range(size)]

    def _distribution(self, out: Any, size: int) -> Distribution:
        space = self.action_space
        if isinstance(out, Distribution):
            return out
        if isinstance(space, gym.spaces.Discrete):
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (size, int(space.n)):
                return Categorical(logits=out.float())
            raise ValueError(
                f"{self._label}: for {space} the module must return logits of shape [{size}, {space.n}] "
                f"or a Distribution, got {_describe(out)}"
            )
        if isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out):
            mean, log_std = out
            dims = self._action_size
            if (
                mean.dim() >= 1
                and mean.shape[0] == size
                and mean.numel() == size * dims
                and log_std.numel() in (dims, size * dims)
            ):
                mean = mean.float().reshape(size, dims)
                std = log_std.float().reshape(-1, dims).exp().expand(size, dims)
                return Independent(Normal(mean, std), 1)
        raise ValueError(
            f"{self._label}: for {space} the module must return (mean [{size}, {self._action_size}], "
            f"log_std [{size}, {self._action_size}] or [{self._action_size}]) or a Distribution, got {_describe(out)}"
        )

    def _to_action(self, value: np.ndarray) -> Any:
        space = self.action_space
        if isinstance(space, gym.spaces.Discrete):
            if np.ndim(value) != 0:
                raise ValueError(
                    f"{self._label}: sampled action has shape {np.shape(value)}, expected a scalar for {space}"
                )
            return int(value) + int(space.start)
        if np.size(value) != self._action_size:
            raise ValueError(
                f"{self._label}: sampled action has {np.size(value)} elements, expected {self._action_size} for {space}"
            )
        return np.asarray(value, dtype=space.dtype).reshape(space.shape)

    # ---------------------------------------------------------------------------- weights
    def _apply_weights(self, weights: WeightsSource, version: int) -> None:
        apply_state_dict(self.module, load_state_dict_source(weights))


def _mode(dist: Distribution) -> torch.Tensor:
    if isinstance(dist, Categorical):
        return dist.probs.argmax(-1)
    try:
        return dist.mode
    except NotImplementedError:  # torch raises this for distributions without a closed-form mode
        return dist.mean


def _numeric_array(obs: Any, where: str, expected: str) -> np.ndarray:
    try:
        array = np.asarray(obs)
    except Exception as exc:
        raise ValueError(f"{where}expected {expected}, got {type(obs).__name__}") from exc
    if array.dtype.kind not in "biuf":
        raise ValueError(f"{where}expected {expected}, got {type(obs).__name__} with dtype {array.dtype}")
    return array.astype(np.float32, copy=False)


def _describe(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {list(out.shape)}"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of " + ", ".join(_describe(item) for item in out)
    return type(out).__name__
