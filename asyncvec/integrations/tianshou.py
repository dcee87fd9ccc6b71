"""Tianshou: ``TianshouVectorEnv``, a Tianshou ``BaseVectorEnv`` backed by asyncvec's workers.

Tianshou's own vector-env logic runs unchanged on top: with ``wait_num`` < number of envs (or a
``timeout``) ``step`` returns only the envs that are ready, tagged with ``info["env_id"]``, and
Tianshou's ``AsyncCollector`` keeps the others stepping. Tianshou resets finished envs itself
(no autoreset). asyncvec adds ``max_restarts`` (a crashed or hung env comes back truncated with
``info["env_restarted"] = True``) and ``step_timeout``.

Example:
    >>> import gymnasium as gym
    >>> import numpy as np
    >>> from asyncvec.integrations.tianshou import TianshouVectorEnv
    >>> envs = TianshouVectorEnv([lambda: gym.make("CartPole-v1")] * 4, wait_num=2)
    >>> obs, info = envs.reset()
    >>> obs, rew, term, trunc, info = envs.step(np.zeros(4, dtype=np.int64))
    >>> len(obs), sorted(i["env_id"] for i in info) != []
    (2, True)
    >>> envs.close()
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from asyncvec.integrations._common import ARRAY_SPACES, addressable, check_action_batch, check_space, info_rows, require
from asyncvec.vector.async_llm_vector_env import AsyncLLMVectorEnv
from asyncvec.vector.errors import WorkerError

require("tianshou", "tianshou", "tianshou")

import tianshou.data  # noqa: E402  (after require: a missing library names its extra)
from tianshou.data import Batch  # noqa: E402  (after require: a missing library names its extra)
from tianshou.env import BaseVectorEnv  # noqa: E402  (after require: a missing library names its extra)
from tianshou.env.worker import EnvWorker  # noqa: E402  (after require: a missing library names its extra)

__all__ = ["AsyncCollector", "AsyncvecEnvWorker", "TianshouVectorEnv"]

_LIBRARY = "Tianshou"
_SPACE_ATTRIBUTES = {"observation_space": "single_observation_space", "action_space": "single_action_space"}


class _Pool:
    """One AsyncLLMVectorEnv shared by the per-env workers Tianshou expects.

    Tianshou talks to one env at a time (``send``/``recv``/``wait``); the pool turns that into
    asyncvec's ``send(actions, env_ids)``/``recv()`` and keeps answers that arrived for an env
    until Tianshou asks for them.
    """

    def __init__(self, venv: AsyncLLMVectorEnv) -> None:
        self.venv = venv
        self.results: dict[int, tuple] = {}  # env id -> answer not yet handed to Tianshou
        self.needs_reset = np.zeros(venv.num_envs, dtype=bool)  # episode over: the next step resets (NEXT_STEP)
        self.last_action: dict[int, Any] = {}
        self.resets: dict[int, dict[str, Any]] = {}  # env id -> reset kwargs, sent with send(None)
        self.seeds: dict[int, int | None] = {}  # from seed(): used by the env's next reset

    def step(self, index: int, action: Any) -> None:
        self.venv.send(
            check_action_batch(_LIBRARY, np.asarray(action)[None], self.venv.single_action_space, 1), [index]
        )
        self.last_action[index] = action

    def receive_one(self, timeout: float | None) -> bool:
        """Moves one finished env's answer into ``results``; False if none came within ``timeout``."""
        try:
            obs, reward, terminated, truncated, info = self.venv.recv(timeout=timeout)
        except multiprocessing.TimeoutError:
            return False
        for row, (index, row_info) in enumerate(zip(info["env_id"], info_rows(info, len(info["env_id"])))):
            index = int(index)
            row_info.pop("env_id", None)
            done = bool(terminated[row] or truncated[row])
            self.needs_reset[index] = done
            self.results[index] = (
                _row(obs, row),
                float(reward[row]),
                bool(terminated[row]),
                bool(truncated[row]),
                row_info,
            )
        return True

    def drain(self) -> None:
        """Receives every env in flight, so that lockstep calls (reset, call) can run."""
        while self.venv.in_flight:
            self.receive_one(None)

    def wait(self, indices: list[int], wait_num: int, timeout: float | None) -> list[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ready = [i for i in indices if i in self.results]
            if len(ready) >= wait_num or len(ready) == len(indices):
                return ready
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return ready
            if not self.receive_one(remaining):
                return [i for i in indices if i in self.results]

    def flush_resets(self) -> None:
        """Runs the resets Tianshou asked for with ``send(None)``."""
        requests, self.resets = self.resets, {}
        ids = sorted(requests)
        plain = all(not kwargs for kwargs in requests.values()) and not any(i in self.seeds for i in ids)
        if plain and all(self.needs_reset[i] and i in self.last_action for i in ids):
            # NEXT_STEP autoreset: the next step of a finished env is its reset (the action is not used),
            # so the other envs keep stepping meanwhile.
            self.venv.send(np.stack([np.asarray(self.last_action[i]) for i in ids]), ids)
            while any(i not in self.results for i in ids):
                self.receive_one(None)
            for i in ids:
                obs, _, _, _, info = self.results.pop(i)
                self.results[i] = (obs, info)
            return
        self.drain()
        mask = np.zeros(self.venv.num_envs, dtype=bool)
        mask[ids] = True
        seeds = [self.seeds.pop(i, requests.get(i, {}).get("seed")) if mask[i] else None for i in range(len(mask))]
        options = next((kw["options"] for kw in requests.values() if kw.get("options")), None)
        observations, infos = self.venv.reset(seed=seeds, options={**(options or {}), "reset_mask": mask})
        rows = info_rows(infos, self.venv.num_envs)
        for i in ids:
            self.needs_reset[i] = False
            self.results[i] = (_row(observations, i), rows[i])

    def call(self, method: str, index: int, *args: Any) -> Any:
        self.drain()
        return self.venv.call(method, {index}, *args)[index]


def _row(batch: Any, row: int) -> Any:
    if isinstance(batch, dict):
        return {key: _row(value, row) for key, value in batch.items()}
    return batch[row]


class AsyncvecEnvWorker(EnvWorker):
    """Tianshou's per-env worker, served by a shared asyncvec vector env (see :class:`TianshouVectorEnv`)."""

    def __init__(self, pool: _Pool, index: int) -> None:
        self.pool = pool
        self.index = index
        super().__init__(pool.venv.env_fns[index])

    def get_env_attr(self, key: str) -> Any:
        if key in _SPACE_ATTRIBUTES:
            return getattr(self.pool.venv, _SPACE_ATTRIBUTES[key])
        try:
            return self.pool.call("asyncvec_get", self.index, key)
        except WorkerError as error:
            if error.exc_type == "AttributeError":
                return None  # as Tianshou's subprocess worker answers for a missing attribute
            raise

    def set_env_attr(self, key: str, value: Any) -> None:
        self.pool.call("asyncvec_set", self.index, key, value)

    def send(self, action: np.ndarray | None, **kwargs: Any) -> None:
        if action is None:
            if "seed" in kwargs:
                super().seed(kwargs["seed"])
            self.pool.resets[self.index] = kwargs
        else:
            self.pool.step(self.index, action)

    def recv(self) -> Any:
        if self.pool.resets:
            self.pool.flush_resets()
        while self.index not in self.pool.results:
            self.pool.receive_one(None)
        return self.pool.results.pop(self.index)

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict]:
        self.send(None, **kwargs)
        return self.recv()

    @staticmethod
    def wait(workers: list[AsyncvecEnvWorker], wait_num: int, timeout: float | None = None) -> list[AsyncvecEnvWorker]:
        if not workers:
            return []
        by_index = {worker.index: worker for worker in workers}
        ready = workers[0].pool.wait(list(by_index), wait_num, timeout)
        return [by_index[i] for i in ready]

    def seed(self, seed: int | None = None) -> list[int] | None:
        self.pool.seeds[self.index] = seed  # applied at this env's next reset
        return super().seed(seed)

    def render(self, **kwargs: Any) -> Any:
        return self.pool.call("asyncvec_call", self.index, "render", (), kwargs)

    def close_env(self) -> None:
        self.pool.venv.close()


class TianshouVectorEnv(BaseVectorEnv):
    """A Tianshou vector env whose sub-envs run in one :class:`~asyncvec.AsyncLLMVectorEnv`.

    Args:
        env_fns: functions that create the sub-environments.
        wait_num: return from ``step`` once this many envs are ready (Tianshou's meaning);
            ``None`` waits for all.
        timeout: return from ``step`` after this many seconds with the envs ready by then.
        **vector_kwargs: ``AsyncLLMVectorEnv`` arguments (``max_restarts``, ``step_timeout``,
            ``shared_memory``, ``context``...), not ``batch_size`` or ``autoreset_mode``.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]],
        wait_num: int | None = None,
        timeout: float | None = None,
        **vector_kwargs: Any,
    ) -> None:
        fixed = sorted({"batch_size", "autoreset_mode"} & set(vector_kwargs))
        if fixed:
            raise TypeError(f"TianshouVectorEnv sets {fixed} itself (use wait_num/timeout for partial batches)")
        venv = AsyncLLMVectorEnv(
            addressable(env_fns), batch_size=1, autoreset_mode=AutoresetMode.NEXT_STEP, **vector_kwargs
        )
        try:
            check_space(_LIBRARY, "observation", venv.single_observation_space, (*ARRAY_SPACES, spaces.Dict))
            check_space(_LIBRARY, "action", venv.single_action_space, ARRAY_SPACES)
            pool = _Pool(venv)
            indices = iter(range(venv.num_envs))
            super().__init__(env_fns, lambda _fn: AsyncvecEnvWorker(pool, next(indices)), wait_num, timeout)
        except BaseException:
            venv.close()
            raise
        self.vector_env = venv

    def close(self) -> None:
        if not self.is_closed:
            super().close()


class _NoHiddenState(np.ndarray):
    """Placeholder hidden state of a policy without one (see :class:`AsyncCollector`)."""


class AsyncCollector(tianshou.data.AsyncCollector):
    """Tianshou's ``AsyncCollector``, working with policies that have no hidden state.

    Tianshou 2.0.1's ``AsyncCollector`` fails with any vector env for policies whose output has
    no ``policy`` entry and no ``state`` (DQN, PPO, SAC...): ``IndexError: Cannot access item
    from empty Batch object``, then ``TypeError: 'NoneType' object is not subscriptable``. This
    subclass gives it a one-column ``policy`` entry and a placeholder hidden state that never
    reaches the policy, so partial batches (``wait_num``, ``timeout``) work with those algorithms.
    """

    def _compute_action_policy_hidden(
        self,
        random: bool,
        ready_env_ids_R: np.ndarray,
        last_obs_RO: np.ndarray,
        last_info_R: np.ndarray,
        last_hidden_state_RH: Any = None,
    ) -> Any:
        if isinstance(last_hidden_state_RH, _NoHiddenState):
            last_hidden_state_RH = None
        result = super()._compute_action_policy_hidden(
            random, ready_env_ids_R, last_obs_RO, last_info_R, last_hidden_state_RH
        )
        if not result.policy_entry.get_keys():
            result.policy_entry = Batch(asyncvec_ready=np.ones(len(ready_env_ids_R), dtype=bool))
        if result.hidden_state is None:
            result.hidden_state = np.zeros(len(ready_env_ids_R), dtype=bool).view(_NoHiddenState)
        return result
