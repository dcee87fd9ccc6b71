"""Stable-Baselines3: ``SB3VecEnv``, an SB3 ``VecEnv`` whose sub-envs run in asyncvec's workers.

It takes the place of SB3's ``SubprocVecEnv`` (same constructor shape, same results step for
step), and adds asyncvec's fault handling: ``max_restarts`` rebuilds a crashed or hung worker
(its episode ends truncated, ``infos[i]["env_restarted"] = True``), ``step_timeout`` bounds a
step. SB3's algorithms step all envs together, so there are no partial batches here.

Example:
    >>> from stable_baselines3 import PPO
    >>> from stable_baselines3.common.env_util import make_vec_env
    >>> from asyncvec.integrations.sb3 import SB3VecEnv
    >>> venv = make_vec_env("CartPole-v1", n_envs=4, seed=0, vec_env_cls=SB3VecEnv,
    ...                     vec_env_kwargs={"max_restarts": 2})
    >>> model = PPO("MlpPolicy", venv, n_steps=16, batch_size=32, n_epochs=1, device="cpu").learn(64)
    >>> venv.close()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from asyncvec.integrations._common import (
    ARRAY_SPACES,
    addressable,
    check_action_batch,
    check_space,
    info_rows,
    require,
)
from asyncvec.vector.async_llm_vector_env import AsyncLLMVectorEnv
from asyncvec.vector.errors import WorkerError

require("stable_baselines3", "stable-baselines3", "sb3")

from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn  # noqa: E402  (after require: a missing library names its extra)

__all__ = ["SB3VecEnv"]

_LIBRARY = "stable-baselines3"
# Keys asyncvec's SAME_STEP autoreset and restarts put in a step's info.
_RESTART_KEYS = ("env_restarted", "restart_reason")


class SB3VecEnv(VecEnv):
    """An SB3 ``VecEnv`` over an :class:`~asyncvec.AsyncLLMVectorEnv` (a drop-in for ``SubprocVecEnv``).

    ``step_wait`` returns the whole batch, resets finished envs in the same step and puts the
    final observation in ``infos[i]["terminal_observation"]`` (plus ``"TimeLimit.truncated"``),
    as SB3 expects. Seeds and options set with ``seed()``/``set_options()`` apply at the next
    ``reset()``.

    Args:
        env_fns: functions that create the sub-environments.
        start_method: multiprocessing start method, as in ``SubprocVecEnv``.
        **vector_kwargs: ``AsyncLLMVectorEnv`` arguments: ``max_restarts``, ``step_timeout``,
            ``shared_memory``, ``start_timeout``... (not ``batch_size`` or ``autoreset_mode``,
            which SB3 fixes).
    """

    def __init__(
        self, env_fns: Sequence[Callable[[], gym.Env]], start_method: str | None = None, **vector_kwargs: Any
    ) -> None:
        fixed = sorted({"batch_size", "autoreset_mode", "context"} & set(vector_kwargs))
        if fixed:
            raise TypeError(
                f"SB3VecEnv sets {fixed} itself: SB3 steps every env at once and expects them to reset in "
                f"the same step (pass start_method= for the multiprocessing context)"
            )
        self.vector_env = AsyncLLMVectorEnv(
            addressable(env_fns), autoreset_mode=AutoresetMode.SAME_STEP, context=start_method, **vector_kwargs
        )
        try:
            observation_space = self.vector_env.single_observation_space
            action_space = self.vector_env.single_action_space
            check_space(_LIBRARY, "observation", observation_space, (*ARRAY_SPACES, spaces.Dict))
            check_space(_LIBRARY, "action", action_space, ARRAY_SPACES)
            super().__init__(self.vector_env.num_envs, observation_space, action_space)
        except BaseException:
            self.vector_env.close()
            raise

    # ------------------------------------------------------------------ stepping

    def reset(self) -> VecEnvObs:
        """Resets every env with the seeds and options set since the last reset."""
        options = [option or {} for option in self._options]
        groups = [option for k, option in enumerate(options) if option not in options[:k]]
        self.reset_infos = [{} for _ in range(self.num_envs)]
        for group in groups:  # envs with different options reset in separate calls
            mask = np.array([option == group for option in options])
            reset_options = (group or None) if len(groups) == 1 else {**group, "reset_mask": mask}
            observations, infos = self.vector_env.reset(seed=list(self._seeds), options=reset_options)
            rows = info_rows(infos, self.num_envs)
            for i in np.flatnonzero(mask):
                self.reset_infos[i] = rows[i]
        self._reset_seeds()
        self._reset_options()
        return observations

    def step_async(self, actions: np.ndarray) -> None:
        actions = check_action_batch(_LIBRARY, actions, self.action_space, self.num_envs)
        self.vector_env.step_async(actions)

    def step_wait(self) -> VecEnvStepReturn:
        observations, rewards, terminations, truncations, infos = self.vector_env.step_wait()
        dones = terminations | truncations
        sb3_infos = []
        for i, row in enumerate(info_rows(infos, self.num_envs)):
            restart = {key: row.pop(key) for key in _RESTART_KEYS if key in row}
            if dones[i]:
                # SAME_STEP: the row holds the final step's info and obs, and the reset's info.
                info = dict(row.pop("final_info", None) or {})
                info["terminal_observation"] = row.pop("final_obs")
                self.reset_infos[i] = row
            else:
                info = row
            info["TimeLimit.truncated"] = bool(truncations[i] and not terminations[i])
            sb3_infos.append({**info, **restart})
        return observations, rewards, dones, sb3_infos

    def close(self) -> None:
        self.vector_env.close()

    # ------------------------------------------------------------------ attributes and methods

    def _indices(self, indices: VecEnvIndices) -> list[int]:
        return [int(i) for i in self._get_indices(indices)]

    def _call(self, method: str, indices: list[int], *args: Any) -> list[Any]:
        try:
            results = self.vector_env.call(method, set(indices), *args)
        except WorkerError as error:
            if error.exc_type == "AttributeError":
                raise AttributeError(str(error)) from error
            raise
        return [results[i] for i in indices]

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        return self._call("asyncvec_get", self._indices(indices), attr_name)

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        self._call("asyncvec_set", self._indices(indices), attr_name, value)

    def env_method(self, method_name: str, *method_args, indices: VecEnvIndices = None, **method_kwargs) -> list[Any]:
        return self._call("asyncvec_call", self._indices(indices), method_name, method_args, method_kwargs)

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        return self._call("asyncvec_is_wrapped", self._indices(indices), wrapper_class)

    def get_images(self) -> Sequence[np.ndarray | None]:
        if self.render_mode != "rgb_array":
            return [None] * self.num_envs
        return list(self.vector_env.call("render"))
