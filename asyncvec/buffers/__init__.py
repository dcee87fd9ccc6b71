"""Version-aware storage for transitions: one transition record (`Transitions`), a replay
buffer (with a sum-tree for prioritized sampling) and an on-policy rollout store that both take
it through one ``add`` signature, and groups of completions per prompt. numpy only: buffers
never import torch.

Example:
    >>> import numpy as np
    >>> from gymnasium import spaces
    >>> from asyncvec.buffers import ReplayBuffer
    >>> buffer = ReplayBuffer(10, spaces.Discrete(3), spaces.Discrete(2))
    >>> _ = buffer.add(np.array([0, 1]), np.array([1, 0]), [1.0, 0.0], np.array([1, 2]),
    ...                [False, True], [False, False], policy_version=0)
    >>> len(buffer)
    2
"""

from asyncvec.buffers._images import ImageCompression, is_image_space
from asyncvec.buffers.errors import BufferClosedError, NotPrioritizedError, StorageDirInUseError
from asyncvec.buffers.groups import CompletionGroups, GroupBatch
from asyncvec.buffers.replay import ReplayBatch, ReplayBuffer
from asyncvec.buffers.rollout import RolloutStore, Segment
from asyncvec.buffers.sum_tree import SumTree
from asyncvec.buffers.transitions import Transitions, policy_columns

__all__ = [
    "BufferClosedError",
    "CompletionGroups",
    "GroupBatch",
    "ImageCompression",
    "NotPrioritizedError",
    "ReplayBatch",
    "ReplayBuffer",
    "RolloutStore",
    "Segment",
    "StorageDirInUseError",
    "SumTree",
    "Transitions",
    "is_image_space",
    "policy_columns",
]
