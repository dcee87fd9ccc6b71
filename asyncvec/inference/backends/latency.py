"""`LatencyModel`: a stand-in for a remote GPU server with a known cost per batch."""

from __future__ import annotations

import time
from typing import Any

from asyncvec.inference.base import BatchedPolicy
from asyncvec.inference.types import BackendResult


class LatencyModel(BatchedPolicy):
    """Wraps a batched backend and waits ``a_ms + b_ms * B`` before each batch of ``B``.

    The wait is ``time.sleep`` (no CPU), so a cheap local model behaves like a remote
    server whose calls cost a fixed ``a`` plus ``b`` per item; tests and benchmarks use it
    to measure batching. The wrapper has its own batcher, deadlines, cache and counters
    (``**kwargs`` as in `BatchedPolicy`; ``action_space`` defaults to the wrapped policy's);
    it calls the wrapped policy's `BatchedPolicy.forward_batch` directly, and
    `load_weights` updates the wrapped policy and this wrapper together.
    Closing the wrapper closes the wrapped policy unless ``close_inner=False``.

    Example:
        >>> import gymnasium as gym, torch
        >>> from asyncvec.inference import TorchPolicy
        >>> inner = TorchPolicy(torch.nn.Linear(3, 2), gym.spaces.Discrete(2))
        >>> with LatencyModel(inner, a_ms=20, b_ms=1, max_batch_size=8) as policy:
        ...     outs = policy.act([[0.0, 0.0, 0.0]] * 8, timeout=10)
        >>> min(out.latency_s for out in outs) >= 0.028
        True
    """

    def __init__(
        self, policy: BatchedPolicy, a_ms: float, b_ms: float, *, close_inner: bool = True, **kwargs: Any
    ) -> None:
        if not isinstance(policy, BatchedPolicy):
            raise TypeError(f"LatencyModel wraps a BatchedPolicy, got {type(policy).__name__}")
        for field, value in (("a_ms", a_ms), ("b_ms", b_ms)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"LatencyModel: {field} must be a number >= 0, got {value!r}")
        kwargs.setdefault("action_space", policy.action_space)
        kwargs.setdefault("version", policy.policy_version)
        super().__init__(**kwargs)
        self.policy = policy
        self.a_ms = float(a_ms)
        self.b_ms = float(b_ms)
        self._close_inner = close_inner

    def _check_obs(self, obs: Any, env_id: int | None) -> Any:
        return self.policy.check_observation(obs, env_id)

    def _forward_batch(self, obs_list: list[Any]) -> list[BackendResult]:
        time.sleep((self.a_ms + self.b_ms * len(obs_list)) / 1000.0)
        return self.policy.forward_batch(obs_list)  # results carry the wrapped policy's version

    def _apply_weights(self, weights: Any, version: int) -> None:
        self.policy.load_weights(weights, version)

    def _close_backend(self) -> None:
        if self._close_inner:
            self.policy.close()
