"""Inference layer: batched, deadline-safe, versioned policies over local and remote models.

Names are imported lazily: ``import asyncvec.inference`` loads nothing heavy, and torch,
transformers, httpx or vllm are imported only by the backend that needs them.

Layout: the core here (`types`: the `Policy` protocol and its outputs; `batcher`: `DynamicBatcher`;
`base`: `BatchedPolicy`, built from the pieces in `requests`; `text`: what text backends share;
`weights`, `tiny_models`, `action_tokens`); `backends/` (torch, HF, vLLM, OpenAI HTTP, the tiny VLA,
a latency stand-in); `serving/` (the ``asyncvec serve`` app, servers as child processes). The
checks tests run against a backend are in `asyncvec.testing`.

Example:
    >>> import gymnasium as gym, torch
    >>> from asyncvec.inference import TorchPolicy
    >>> with TorchPolicy(torch.nn.Linear(4, 3), gym.spaces.Discrete(3), max_wait_ms=2) as policy:
    ...     answer = policy.submit([0.0, 1.0, 0.0, 1.0], env_id=0).result(timeout=10)
    >>> answer.policy_version, answer.fallback
    (0, False)
"""

from __future__ import annotations

import importlib
from typing import Any

from asyncvec.extras import check_installed, check_torch_libraries

# public name -> module that defines it
_LAZY = {
    "Policy": "asyncvec.inference.types",
    "PolicyOutput": "asyncvec.inference.types",
    "BackendResult": "asyncvec.inference.types",
    "TextPrompt": "asyncvec.inference.types",
    "PolicyError": "asyncvec.inference.types",
    "PolicyClosedError": "asyncvec.inference.types",
    "ReentrantCallError": "asyncvec.inference.types",
    "BackendError": "asyncvec.inference.types",
    "BackendRejectedError": "asyncvec.inference.types",
    "TransientBackendError": "asyncvec.inference.types",
    "PartialBatchError": "asyncvec.inference.types",
    "GeneratedPrefix": "asyncvec.inference.types",
    "DynamicBatcher": "asyncvec.inference.batcher",
    "adaptive_threshold": "asyncvec.inference.batcher",
    "fit_batch_cost": "asyncvec.inference.batcher",
    "BatchedPolicy": "asyncvec.inference.base",
    "split_batch": "asyncvec.inference.requests",
    "zero_action": "asyncvec.inference.requests",
    "observation_key": "asyncvec.inference.requests",
    "TorchPolicy": "asyncvec.inference.backends.torch_policy",
    "LatencyModel": "asyncvec.inference.backends.latency",
    "HFTextPolicy": "asyncvec.inference.backends.hf_policy",
    "OpenAIPolicy": "asyncvec.inference.backends.openai_policy",
    "VLLMPolicy": "asyncvec.inference.backends.vllm_policy",
    "ServerProcess": "asyncvec.inference.serving.server_process",
    "VLLMServer": "asyncvec.inference.serving.server_process",
    "AsyncvecServer": "asyncvec.inference.serving.server_process",
    "ServerStartError": "asyncvec.inference.serving.server_process",
    "free_port": "asyncvec.inference.serving.server_process",
    "wait_until_ready": "asyncvec.inference.serving.server_process",
    "EngineSupervisor": "asyncvec.inference.serving.supervisor",
    "ParameterSpec": "asyncvec.inference.weights",
    "write_checkpoint": "asyncvec.inference.weights",
    "checkpoint_shapes": "asyncvec.inference.weights",
    "build_tiny_lm": "asyncvec.inference.tiny_models",
    "DEFAULT_VOCAB": "asyncvec.inference.tiny_models",
    "ActionTokenizer": "asyncvec.inference.action_tokens",
    "TinyVLAConfig": "asyncvec.inference.backends.vla",
    "TinyVLAModel": "asyncvec.inference.backends.vla",
    "TinyVLAPolicy": "asyncvec.inference.backends.vla",
    "build_tiny_vla": "asyncvec.inference.backends.vla",
    "load_tiny_vla": "asyncvec.inference.backends.vla",
    "per_action_logps": "asyncvec.inference.backends.vla",
    "VLLMVLAPolicy": "asyncvec.inference.backends.vla_vllm",
}

__all__ = sorted(_LAZY)

# public name -> (library it needs, extra installing it): checked on first access (asyncvec.extras)
_NEEDS = {
    "HFTextPolicy": ("transformers", "hf"),
    "build_tiny_lm": ("transformers", "hf"),
    "write_checkpoint": ("safetensors", "hf"),
    "OpenAIPolicy": ("httpx", "serve"),
    "ServerProcess": ("httpx", "serve"),
    "VLLMServer": ("httpx", "serve"),
    "AsyncvecServer": ("httpx", "serve"),
    "wait_until_ready": ("httpx", "serve"),
    "EngineSupervisor": ("httpx", "serve"),
    "VLLMPolicy": ("vllm", "vllm"),
    "VLLMVLAPolicy": ("vllm", "vllm"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncvec.inference' has no attribute {name!r}")
    if name in _NEEDS:
        library, extra = _NEEDS[name]
        check_installed(library, extra=extra, feature=f"asyncvec.inference.{name}")
    if name in ("VLLMPolicy", "VLLMServer", "VLLMVLAPolicy"):
        check_torch_libraries(f"asyncvec.inference.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
