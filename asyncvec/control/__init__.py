"""Acting at a control rate: action chunks played while the next is computed, and a safety layer.

* `ChunkExecutor`: plays ``H``-action chunks from any `Policy` at the env's control period,
  asks for the next chunk ``k`` ticks before the current one runs out (``k`` from the measured
  latency), resolves overlapping chunks (newest wins, or ACT's temporal ensembling), falls back
  safely when a chunk runs out, and records the version and log-prob of every executed action.
* `SafetyFilter` / `SafetyWrapper`: bounds, a rate limit and a user predicate between policy
  and env; violating actions are replaced, counted, logged and marked.
* `RollbackGuard`: checkpoints keyed by version, periodic evaluation, and a rollback to the
  best version (re-published under a new version) when an update makes the policy worse.

See docs/robots.md.

Example:
    >>> import gymnasium as gym, numpy as np
    >>> from asyncvec.control import SafetyFilter, ticks_met_bound
    >>> ticks_met_bound([0.3], period_s=0.02, horizon=1) < 0.1
    True
    >>> SafetyFilter(gym.spaces.Box(-1, 1, (1,)))(None, np.array([2.0]))[1]
    'bounds'
"""

from asyncvec.control.chunks import (
    SOURCES,
    Chunk,
    ChunkExecutor,
    ChunkRollout,
    ChunkStream,
    action_logps_from_tokens,
    request_threshold,
    ticks_met_bound,
)
from asyncvec.control.instructions import HashedInstruction, hashed_words
from asyncvec.control.rollback import RollbackEvent, RollbackGuard
from asyncvec.control.safety import SAFETY_REASONS, SafetyFilter, SafetyWrapper

__all__ = [
    "SAFETY_REASONS",
    "SOURCES",
    "Chunk",
    "ChunkExecutor",
    "ChunkRollout",
    "ChunkStream",
    "RollbackEvent",
    "RollbackGuard",
    "SafetyFilter",
    "SafetyWrapper",
    "GaussianChunkPolicy",
    "HashedInstruction",
    "action_logps_from_tokens",
    "hashed_words",
    "request_threshold",
    "ticks_met_bound",
]


def __getattr__(name: str):
    """`GaussianChunkPolicy` imports torch: loaded on first use."""
    if name == "GaussianChunkPolicy":
        from asyncvec.control.chunk_policy import GaussianChunkPolicy

        return GaussianChunkPolicy
    raise AttributeError(f"module 'asyncvec.control' has no attribute {name!r}")
