"""Example envs, registered under the ``asyncvec/`` namespace by ``import asyncvec``.

Example:
    >>> import gymnasium as gym
    >>> import asyncvec  # registers the ids
    >>> env = gym.make("asyncvec/Arithmetic-v0")
"""

from gymnasium.envs.registration import register, registry

_ENVS = {
    "asyncvec/SlowCartPole-v0": ("asyncvec.envs.slow:make_slow", {"env_id": "CartPole-v1", "latency_ms": 10.0}),
    "asyncvec/Arithmetic-v0": ("asyncvec.envs.text:ArithmeticEnv", {}),
    "asyncvec/SingleDigitSums-v0": ("asyncvec.envs.text:ArithmeticEnv", {"single_digit": True}),
    "asyncvec/GuessNumber-v0": ("asyncvec.envs.text:GuessNumberEnv", {}),
    "asyncvec/PixelPendulum-v0": ("asyncvec.envs.pixels:make_pixel_env", {"task": "pendulum"}),
    "asyncvec/PixelMountainCarContinuous-v0": ("asyncvec.envs.pixels:make_pixel_env", {"task": "mountain_car"}),
    "asyncvec/PixelCartPole-v0": ("asyncvec.envs.pixels:make_pixel_env", {"task": "cartpole"}),
    "asyncvec/PixelReach-v0": ("asyncvec.envs.pixels:PixelReachEnv", {}),
    "asyncvec/FrozenLakeText-v0": ("asyncvec.envs.text:make_frozen_lake_text", {}),
    "asyncvec/CalculatorTool-v0": ("asyncvec.envs.text:CalculatorToolEnv", {}),
}

for _env_id, (_entry_point, _kwargs) in _ENVS.items():
    if _env_id not in registry:
        register(id=_env_id, entry_point=_entry_point, kwargs=_kwargs)
