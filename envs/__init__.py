"""Example envs, registered under the ``asyncvec/`` namespace on import.

Example:
    >>> import gymnasium as gym
    >>> import envs  # registers the ids
    >>> env = gym.make("asyncvec/Arithmetic-v0")
"""

from gymnasium.envs.registration import register, registry

_ENVS = {
    "asyncvec/SlowCartPole-v0": ("envs.slow:make_slow", {"env_id": "CartPole-v1", "latency_ms": 10.0}),
    "asyncvec/Arithmetic-v0": ("envs.text:ArithmeticEnv", {}),
    "asyncvec/SingleDigitSums-v0": ("envs.text:ArithmeticEnv", {"single_digit": True}),
    "asyncvec/GuessNumber-v0": ("envs.text:GuessNumberEnv", {}),
    "asyncvec/PixelPendulum-v0": ("envs.pixels:make_pixel_env", {"task": "pendulum"}),
    "asyncvec/PixelMountainCarContinuous-v0": ("envs.pixels:make_pixel_env", {"task": "mountain_car"}),
    "asyncvec/PixelCartPole-v0": ("envs.pixels:make_pixel_env", {"task": "cartpole"}),
    "asyncvec/FrozenLakeText-v0": ("envs.text:make_frozen_lake_text", {}),
    "asyncvec/CalculatorTool-v0": ("envs.text:CalculatorToolEnv", {}),
}

for _env_id, (_entry_point, _kwargs) in _ENVS.items():
    if _env_id not in registry:
        register(id=_env_id, entry_point=_entry_point, kwargs=_kwargs)
