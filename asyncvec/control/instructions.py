"""An instruction a small network can read: words hashed into a fixed number of buckets.

A vision-language-action policy reads its instruction with a language model; a small CNN policy
(`agents/ppo_chunks.py`) reads it as a bag of hashed words next to the image.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["HashedInstruction", "hashed_words"]


def hashed_words(text: str, buckets: int) -> np.ndarray:
    """A bag of words as ``buckets`` numbers: 1 where a word of ``text`` (lower case, letters and
    digits) hashes (CRC-32, the same in every process) to that bucket, else 0.

    Example:
        >>> hashed_words("Go to the RED square", 16).sum()  # 5 words, 2 of which share a bucket
        np.float32(4.0)
        >>> bool((hashed_words("red", 16) == hashed_words("Red!", 16)).all())
        True
    """
    features = np.zeros(buckets, dtype=np.float32)
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        features[zlib.crc32(word.encode()) % buckets] = 1.0
    return features


class HashedInstruction(gym.ObservationWrapper):
    """Turns a ``Dict`` observation's ``Text`` instruction into :func:`hashed_words` numbers, so a
    network can read it next to the image (``Box(0, 1, (buckets,))`` under the same key).

    Example:
        >>> import asyncvec
        >>> env = HashedInstruction(gym.make("asyncvec/PixelReach-v0", size=16), buckets=32)
        >>> obs, _ = env.reset(seed=0)
        >>> obs["image"].shape, obs["instruction"].shape, float(obs["instruction"].max())
        ((16, 16, 3), (32,), 1.0)
    """

    def __init__(self, env: gym.Env, buckets: int = 64, key: str = "instruction") -> None:
        super().__init__(env)
        space = env.observation_space
        if not isinstance(space, gym.spaces.Dict) or not isinstance(space.spaces.get(key), gym.spaces.Text):
            raise ValueError(f"HashedInstruction: expected a Dict observation space with a Text {key!r}, got {space}")
        self.buckets, self.key = int(buckets), key
        self.observation_space = gym.spaces.Dict(
            {**space.spaces, key: gym.spaces.Box(0.0, 1.0, (self.buckets,), np.float32)}
        )

    def observation(self, observation: dict[str, Any]) -> dict[str, Any]:
        return {**observation, self.key: hashed_words(observation[self.key], self.buckets)}
