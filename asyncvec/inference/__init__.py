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

from asyncvec.inference.engines import ENGINES
from asyncvec.lazy import LazyName, lazy_package

_HF = "hf"  # the extras installing the optional libraries (setup.py)
_SERVE = "serve"
_SERVER_PROCESS = "asyncvec.inference.serving.server_process"

# public name -> where it lives: its module, or a LazyName naming also the optional library it needs (checked on
# first access, the error naming the extra that installs it: asyncvec.extras). The LM agents' engines (HFTextPolicy,
# OpenAIPolicy, VLLMPolicy) are not listed here: each comes from its row of asyncvec.inference.engines.ENGINES.
_LAZY: dict[str, str | LazyName] = {
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
    "ServerProcess": LazyName(_SERVER_PROCESS, "httpx", _SERVE),
    "VLLMServer": LazyName(_SERVER_PROCESS, "httpx", _SERVE, needs_loadable_torch_libraries=True),
    "AsyncvecServer": LazyName(_SERVER_PROCESS, "httpx", _SERVE),
    "ServerStartError": _SERVER_PROCESS,
    "free_port": _SERVER_PROCESS,
    "wait_until_ready": LazyName(_SERVER_PROCESS, "httpx", _SERVE),
    "EngineSupervisor": LazyName("asyncvec.inference.serving.supervisor", "httpx", _SERVE),
    "ParameterSpec": "asyncvec.inference.weights",
    "write_checkpoint": LazyName("asyncvec.inference.weights", "safetensors", _HF),
    "checkpoint_shapes": "asyncvec.inference.weights",
    "build_tiny_lm": LazyName("asyncvec.inference.tiny_models", "transformers", _HF),
    "DEFAULT_VOCAB": "asyncvec.inference.tiny_models",
    "ActionTokenizer": "asyncvec.inference.action_tokens",
    "TinyVLAConfig": "asyncvec.inference.backends.vla",
    "TinyVLAModel": "asyncvec.inference.backends.vla",
    "TinyVLAPolicy": "asyncvec.inference.backends.vla",
    "build_tiny_vla": "asyncvec.inference.backends.vla",
    "load_tiny_vla": "asyncvec.inference.backends.vla",
    "per_action_logps": "asyncvec.inference.backends.vla",
    "VLLMVLAPolicy": LazyName(
        "asyncvec.inference.backends.vla_vllm", "vllm", "vllm", needs_loadable_torch_libraries=True
    ),
    **{engine.policy: engine.policy_from for engine in ENGINES.values()},
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_package(globals(), _LAZY)
