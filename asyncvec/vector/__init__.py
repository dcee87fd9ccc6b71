"""Vectorized envs: ``AsyncLLMVectorEnv`` and the conformance checker ``check_vector_env``."""

from asyncvec.vector.async_llm_vector_env import AsyncLLMVectorEnv
from asyncvec.vector.errors import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError, WorkerError

__all__ = [
    "AlreadyPendingCallError",
    "AsyncLLMVectorEnv",
    "ClosedEnvironmentError",
    "NoAsyncCallError",
    "WorkerError",
]
