"""asyncvec: online RL that keeps pace with slow, large-model policies.

Public names are imported lazily, so a worker process that only runs an env never pays for
importing torch.

Example:
    >>> import gymnasium as gym
    >>> import asyncvec
    >>> envs = asyncvec.AsyncLLMVectorEnv([lambda: gym.make("CartPole-v1")] * 2)
    >>> obs, info = envs.reset(seed=0)
    >>> envs.close()
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "AsyncLLMVectorEnv": "asyncvec.vector.async_llm_vector_env",
    "AlreadyPendingCallError": "asyncvec.vector.errors",
    "NoAsyncCallError": "asyncvec.vector.errors",
    "ClosedEnvironmentError": "asyncvec.vector.errors",
    "WorkerError": "asyncvec.vector.errors",
    "check_vector_env": "asyncvec.vector.checker",
    "VectorEnvCheckError": "asyncvec.vector.checker",
    "VersionManager": "asyncvec.versioning",
    "ReplayBuffer": "asyncvec.buffers",
    "RolloutStore": "asyncvec.buffers",
    "CompletionGroups": "asyncvec.buffers",
    "Collector": "asyncvec.collector",
    "CollectorError": "asyncvec.collector",
    "Transitions": "asyncvec.collector",
    "Policy": "asyncvec.inference",
    "PolicyOutput": "asyncvec.inference",
    "BatchedPolicy": "asyncvec.inference",
    "DynamicBatcher": "asyncvec.inference",
    "TorchPolicy": "asyncvec.inference",
    "HFTextPolicy": "asyncvec.inference",
    "OpenAIPolicy": "asyncvec.inference",
    "VLLMPolicy": "asyncvec.inference",
    "LatencyModel": "asyncvec.inference",
    "build_tiny_lm": "asyncvec.inference",
    "make_vec": "asyncvec.integrations.gymnasium",
    "ChunkExecutor": "asyncvec.control",
    "SafetyFilter": "asyncvec.control",
    "SafetyWrapper": "asyncvec.control",
    "RollbackGuard": "asyncvec.control",
}

# submodules reachable as attributes, e.g. ``@asyncvec.rewards.register("name")``
_SUBMODULES = (
    "buffers",
    "collector",
    "control",
    "inference",
    "integrations",
    "losses",
    "metrics",
    "rewards",
    "vector",
    "versioning",
)

__all__ = sorted(_LAZY) + ["__version__"]


def _register_with_gymnasium() -> None:
    """Lets ``gymnasium.make_vec("asyncvec/AsyncLLMVectorEnv-v0", ...)`` build an AsyncLLMVectorEnv.

    The entry point is a string, loaded only when that id is made (see asyncvec.integrations.gymnasium).
    """
    from gymnasium.envs.registration import register, registry

    if "asyncvec/AsyncLLMVectorEnv-v0" not in registry:
        register(
            id="asyncvec/AsyncLLMVectorEnv-v0", vector_entry_point="asyncvec.integrations.gymnasium:vector_entry_point"
        )


_register_with_gymnasium()


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"asyncvec.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncvec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
