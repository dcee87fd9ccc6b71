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
import os
from typing import Any

from asyncvec.lazy import lazy_package

__version__ = "0.1.0"

# The agents and the example envs sit at the top of the repository (agents/, envs/) and install as
# asyncvec.agents and asyncvec.envs (setup.py). Imported from a source tree instead (a clone's root first on
# sys.path, whatever the install), this package has no such folders: its subpackages are also looked for
# beside it.
_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(__path__[0], "agents")) and os.path.isfile(
    os.path.join(_SOURCE_ROOT, "agents", "ppo.py")
):
    __path__.append(_SOURCE_ROOT)

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
    "AdmissionControl": "asyncvec.versioning",
    "ReplayBuffer": "asyncvec.buffers",
    "RolloutStore": "asyncvec.buffers",
    "CompletionGroups": "asyncvec.buffers",
    "Collector": "asyncvec.collection",
    "CollectorError": "asyncvec.collection",
    "Transitions": "asyncvec.buffers",
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

# submodules reachable as attributes, e.g. ``asyncvec.losses.gae``
_SUBMODULES = (
    "buffers",
    "collection",
    "control",
    "inference",
    "integrations",
    "losses",
    "metrics",
    "vector",
    "versioning",
)

__all__ = sorted(_LAZY) + ["__version__"]


def _register_with_gymnasium() -> None:
    """Lets ``gymnasium.make_vec("asyncvec/AsyncLLMVectorEnv-v0", ...)`` build an AsyncLLMVectorEnv, and
    ``gymnasium.make`` the example envs of ``asyncvec.envs``.

    The entry point is a string, loaded only when that id is made (see asyncvec.integrations.gymnasium).
    """
    from gymnasium.envs.registration import register, registry

    if "asyncvec/AsyncLLMVectorEnv-v0" not in registry:
        register(
            id="asyncvec/AsyncLLMVectorEnv-v0", vector_entry_point="asyncvec.integrations.gymnasium:vector_entry_point"
        )
    # The example envs (asyncvec/GuessNumber-v0, asyncvec/PixelPendulum-v0, ...): only their ids and entry-point
    # strings, so their modules load when an id is made.
    importlib.import_module("asyncvec.envs")


_register_with_gymnasium()


_lazy_name = lazy_package(globals(), _LAZY)[0]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"asyncvec.{name}")
    return _lazy_name(name)


def __dir__() -> list[str]:
    return __all__
