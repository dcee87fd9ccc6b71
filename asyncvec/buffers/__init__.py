"""Version-aware storage for transitions: a replay buffer (with a sum-tree for prioritized
sampling), an on-policy rollout store and groups of completions per prompt. numpy only:
buffers never import torch.

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
from asyncvec.buffers.groups import CompletionGroups, GroupBatch
from asyncvec.buffers.replay import ReplayBatch, ReplayBuffer
from asyncvec.buffers.rollout import RolloutStore, Segment
from asyncvec.buffers.sum_tree import SumTree

__all__ = [
    "CompletionGroups",
    "GroupBatch",
    "ImageCompression",
    "ReplayBatch",
    "ReplayBuffer",
    "RolloutStore",
    "Segment",
    "SumTree",
    "is_image_space",
]
