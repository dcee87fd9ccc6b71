"""Vectorized envs: ``AsyncLLMVectorEnv`` and the conformance checker ``check_vector_env``."""

from asyncvec.vector.async_llm_vector_env import AsyncLLMVectorEnv
from asyncvec.vector.checker import VectorEnvCheckError, check_vector_env
from asyncvec.vector.errors import (
    AlreadyPendingCallError,
    ClosedEnvironmentError,
    NoAsyncCallError,
    PlacementError,
    SpaceMismatchError,
    WorkerError,
)
from asyncvec.vector.faults import Fault, FaultKind, FaultPolicy, MaxRestarts, restart_seed
from asyncvec.vector.placement import Placement, StepProfile
from asyncvec.vector.transport import Backend, ProcessBackend, Transport

__all__ = [
    "AlreadyPendingCallError",
    "AsyncLLMVectorEnv",
    "Backend",
    "ClosedEnvironmentError",
    "Fault",
    "FaultKind",
    "FaultPolicy",
    "MaxRestarts",
    "NoAsyncCallError",
    "Placement",
    "PlacementError",
    "ProcessBackend",
    "SpaceMismatchError",
    "StepProfile",
    "Transport",
    "VectorEnvCheckError",
    "WorkerError",
    "check_vector_env",
    "restart_seed",
]
