"""``AsyncLLMVectorEnv``: a Gymnasium vector env with EnvPool-style partial batches and restarts."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from collections import deque
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from enum import Enum
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
from gymnasium import Env, Space, spaces
from gymnasium.vector.utils import (
    CloudpickleWrapper,
    batch_space,
    clear_mpi_env_vars,
    concatenate,
    create_empty_array,
    create_shared_memory,
    iterate,
    read_from_shared_memory,
)
from gymnasium.vector.vector_env import AutoresetMode, VectorEnv

from asyncvec.vector.errors import (
    AlreadyPendingCallError,
    ClosedEnvironmentError,
    NoAsyncCallError,
    WorkerError,
)
from asyncvec.vector.worker import run_worker

__all__ = ["AsyncLLMVectorEnv"]

_FIXED_SHAPE_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


class _LockstepState(Enum):
    DEFAULT = "default"
    WAITING_RESET = "reset"
    WAITING_STEP = "step"
    WAITING_CALL = "call"


@dataclass
class _Pending:
    """A command sent to one worker and not yet answered."""

    command: str
    payload: Any
    sent_at: float


_NO_RESULT = object()  # a worker's answer can be None, so "no answer yet" needs its own marker


@dataclass(frozen=True)
class _CallFailure:
    """An env method raised inside a call; the worker itself is fine."""

    payload: tuple


@dataclass
class _Worker:
    process: Any
    pipe: Connection
    restarts: int = 0
    pending: _Pending | None = None
    result: Any = _NO_RESULT  # answer received, not yet delivered
    info_extra: dict = field(default_factory=dict)


def _is_fixed_shape(space: Space) -> bool:
    if isinstance(space, spaces.Dict):
        return all(_is_fixed_shape(s) for s in space.spaces.values())
    if isinstance(space, spaces.Tuple):
        return all(_is_fixed_shape(s) for s in space.spaces)
    return isinstance(space, _FIXED_SHAPE_SPACES)


def _take(batch: Any, rows: np.ndarray | int) -> Any:
    """Rows (or one row) of a batched observation (nested dicts/tuples of arrays), as a copy."""
    if isinstance(batch, dict):
        return {key: _take(value, rows) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_take(value, rows) for value in batch)
    return np.take(batch, rows, axis=0)


def _take_info(infos: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
    """Rows of a gymnasium vector info dict (arrays and ``_key`` masks sized ``num_envs``)."""
    return {
        key: _take_info(value, rows) if isinstance(value, dict) else value[rows]
        for key, value in infos.items()
    }


class AsyncLLMVectorEnv(VectorEnv):
    """Runs sub-environments in worker processes; fast envs never wait for slow ones.

    Two APIs over the same workers:

    * Gymnasium's lockstep API (``reset``, ``step``, ``step_async``/``step_wait``, ``call``...),
      returning the same results as :class:`gymnasium.vector.SyncVectorEnv` in all three
      autoreset modes.
    * EnvPool's asynchronous API: ``async_reset()``, ``send(actions, env_ids)`` and ``recv()``,
      which returns the first ``batch_size`` envs to finish, their ids in ``info["env_id"]``.
      While the caller works on one group (e.g. waits for a slow policy), the others step.

    Faults: an env that raises, a worker killed by a signal, or a step longer than
    ``step_timeout`` raises :class:`WorkerError` naming the env index, the exception type and the
    worker's traceback; the vector env then closes itself. With ``max_restarts > 0`` the worker
    is rebuilt in place instead: the interrupted episode comes back truncated with
    ``info["env_restarted"] = True`` and every other env keeps running.

    Example:
        >>> import gymnasium as gym
        >>> from asyncvec import AsyncLLMVectorEnv
        >>> envs = AsyncLLMVectorEnv([lambda: gym.make("CartPole-v1")] * 4, batch_size=2)
        >>> envs.async_reset(seed=0)
        >>> obs, rew, term, trunc, info = envs.recv()
        >>> obs.shape, len(info["env_id"])
        ((2, 4), 2)
        >>> envs.send(np.zeros(2, dtype=np.int64), info["env_id"])
        >>> envs.close()

    Args:
        env_fns: functions that create the sub-environments; they travel with cloudpickle.
        batch_size: how many envs ``recv`` returns (default: ``num_envs``).
        autoreset_mode: NEXT_STEP (default), SAME_STEP or DISABLED, as in Gymnasium.
        shared_memory: pass fixed-shape observations through shared memory. Observations of
            Text, Sequence, Graph or other variable-size spaces always go through pipes.
        context: multiprocessing start method (``"fork"``, ``"spawn"``, ``"forkserver"``).
        step_timeout: seconds a reset or step may take before its worker is treated as hung
            (killed, then restarted or reported). ``None`` waits forever.
        max_restarts: how many times each worker may be rebuilt after a fault.
        copy: return copies of observations from ``reset``/``step`` (``recv`` always copies).
        validate_actions: check each action against ``single_action_space`` before sending.
        start_timeout: seconds a worker may take to build its env.
        daemon: start workers as daemon processes.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Env]],
        *,
        batch_size: int | None = None,
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        shared_memory: bool = True,
        context: str | None = None,
        step_timeout: float | None = None,
        max_restarts: int = 0,
        copy: bool = True,
        validate_actions: bool = True,
        start_timeout: float = 60.0,
        daemon: bool = True,
        observation_mode: str = "same",
    ) -> None:
        self.closed = True  # until the workers exist; makes __del__ safe on early errors
        self.env_fns = list(env_fns)
        if not self.env_fns:
            raise ValueError("env_fns is empty: AsyncLLMVectorEnv needs at least one env function")
        for i, fn in enumerate(self.env_fns):
            if not callable(fn):
                raise TypeError(f"env_fns[{i}] must be a callable returning an env, got {type(fn).__name__}")
        self.num_envs = len(self.env_fns)
        self.batch_size = self.num_envs if batch_size is None else int(batch_size)
        if not 1 <= self.batch_size <= self.num_envs:
            raise ValueError(f"batch_size must be in [1, num_envs={self.num_envs}], got {batch_size}")
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        if step_timeout is not None and step_timeout <= 0:
            raise ValueError(f"step_timeout must be positive seconds or None, got {step_timeout}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        if observation_mode not in ("same", "different"):
            raise ValueError(f"observation_mode must be 'same' or 'different', got {observation_mode!r}")
        self.step_timeout = step_timeout
        self.max_restarts = int(max_restarts)
        self.copy = copy
        self.validate_actions = validate_actions
        self.start_timeout = start_timeout
        self.context = context
        self.daemon = daemon
        self.observation_mode = observation_mode

        # Spaces come from one throwaway env, as in gymnasium: shared memory must exist before
        # the workers start.
        dummy = self.env_fns[0]()
        self.metadata = dict(dummy.metadata)
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = dummy.render_mode
        self.single_observation_space = dummy.observation_space
        self.single_action_space = dummy.action_space
        dummy.close()
        del dummy
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)

        self._ctx = multiprocessing.get_context(context)
        self.shared_memory = bool(shared_memory) and _is_fixed_shape(self.single_observation_space)
        if self.shared_memory:
            self._shm = create_shared_memory(self.single_observation_space, n=self.num_envs, ctx=self._ctx)
            self._observations = read_from_shared_memory(self.single_observation_space, self._shm, n=self.num_envs)
            self._env_obs: list[Any] | None = None
        else:
            self._shm = None
            self._observations = create_empty_array(self.single_observation_space, n=self.num_envs, fn=np.zeros)
            self._env_obs = [None] * self.num_envs  # latest observation per env (pipe mode)

        self._state = _LockstepState.DEFAULT
        self._lockstep_ids: list[int] = []
        self._action_spaces: dict[int, Space] = {self.num_envs: self.action_space}
        self._arrivals: deque[int] = deque()  # env ids with an undelivered answer, in arrival order
        self._workers: list[_Worker] = []
        self.closed = False
        try:
            with clear_mpi_env_vars():
                for index in range(self.num_envs):
                    self._workers.append(self._start_worker(index, needs_reset=False))
            for index in range(self.num_envs):
                self._await_ready(index)
            self._check_spaces()
        except BaseException:
            self.close(terminate=True)
            raise

    # ------------------------------------------------------------------ workers

    def _start_worker(self, index: int, needs_reset: bool) -> _Worker:
        parent_pipe, child_pipe = self._ctx.Pipe()
        process = self._ctx.Process(
            target=run_worker,
            name=f"Worker<AsyncLLMVectorEnv>-{index}",
            args=(
                index,
                CloudpickleWrapper(self.env_fns[index]),
                child_pipe,
                parent_pipe,
                self._shm,
                self.autoreset_mode,
                needs_reset,
                os.getpid(),
            ),
            daemon=self.daemon,
        )
        process.start()
        child_pipe.close()
        return _Worker(process=process, pipe=parent_pipe)

    def _await_ready(self, index: int) -> None:
        worker = self._workers[index]
        if not worker.pipe.poll(self.start_timeout):
            raise WorkerError(index, "make", "StartTimeout", f"env did not start within {self.start_timeout} s")
        ok, payload = self._read(index)
        if not ok:
            raise self._error_from_payload(index, "make", payload)

    def _read(self, index: int) -> tuple[bool, Any]:
        """One answer from a worker; a dead worker reads as a failure, never as a hang."""
        worker = self._workers[index]
        try:
            return worker.pipe.recv()
        except (EOFError, OSError, ConnectionResetError):
            worker.process.join(timeout=1.0)
            code = worker.process.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return False, ("WorkerDied", f"worker process died ({how})", "", None)

    def _error_from_payload(self, index: int, command: str, payload: Any) -> WorkerError:
        exc_type, message, trace, pickled = payload
        error = WorkerError(index, command, exc_type, message, trace)
        if pickled is not None:
            try:
                error.__cause__ = pickle.loads(pickled)
            except Exception:
                pass
        return error

    def _kill(self, index: int) -> None:
        worker = self._workers[index]
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5.0)
        worker.pipe.close()

    def _send(self, index: int, command: str, payload: Any) -> None:
        worker = self._workers[index]
        worker.pending = _Pending(command, payload, time.monotonic())
        try:
            worker.pipe.send((command, payload))
        except (BrokenPipeError, OSError):
            pass  # the next poll reads EOF and handles the dead worker

    # ------------------------------------------------------------------ core loop

    def _outstanding(self) -> list[int]:
        return [i for i, w in enumerate(self._workers) if w.pending is not None and w.result is _NO_RESULT]

    def _poll(self, deadline: float | None) -> None:
        """Receive the answers that arrive before ``deadline`` (or the next hang deadline)."""
        outstanding = self._outstanding()
        if not outstanding:
            return
        now = time.monotonic()
        wait_until = deadline
        if self.step_timeout is not None:
            hang_at = min(self._workers[i].pending.sent_at for i in outstanding) + self.step_timeout
            wait_until = hang_at if wait_until is None else min(wait_until, hang_at)
        by_pipe = {self._workers[i].pipe: i for i in outstanding}
        for pipe in wait(list(by_pipe), timeout=None if wait_until is None else max(0.0, wait_until - now)):
            index = by_pipe[pipe]
            ok, payload = self._read(index)
            if ok:
                self._accept(index, payload)
            else:
                self._fail(index, payload)
        if self.step_timeout is not None:
            now = time.monotonic()
            for index in self._outstanding():
                pending = self._workers[index].pending
                if pending.command in ("step", "reset") and now - pending.sent_at > self.step_timeout:
                    self._kill(index)
                    self._fail(index, ("StepTimeout", f"no answer within step_timeout={self.step_timeout} s", "", None))

    def _wait_until(self, done: Callable[[], bool], timeout: float | None, what: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            if deadline is not None and time.monotonic() >= deadline:
                raise multiprocessing.TimeoutError(f"{what} within {timeout} s")
            self._poll(deadline)

    def _accept(self, index: int, payload: Any) -> None:
        worker = self._workers[index]
        if worker.pending.command in ("step", "reset") and self._env_obs is not None:
            self._env_obs[index] = payload[0]
        worker.result = payload
        self._arrivals.append(index)

    def _fail(self, index: int, payload: Any) -> None:
        """A worker raised, died or hung: rebuild it in place, or close and raise."""
        worker = self._workers[index]
        pending = worker.pending
        if pending.command in ("call", "setattr") and payload[0] not in ("WorkerDied", "StepTimeout"):
            # The env survived a failing method call: report it, keep the workers.
            worker.result = _CallFailure(payload)
            self._arrivals.append(index)
            return
        if pending.command not in ("step", "reset") or worker.restarts >= self.max_restarts:
            error = self._error_from_payload(index, pending.command, payload)
            if worker.restarts:
                error.args = (f"{error.args[0]}\n(after {worker.restarts} restart(s); max_restarts={self.max_restarts})",)
            self.close(terminate=True)
            raise error
        try:
            self._restart(index, pending, payload)
        except BaseException:
            self.close(terminate=True)
            raise

    def _restart(self, index: int, pending: _Pending, payload: Any) -> None:
        worker = self._workers[index]
        self._kill(index)
        worker.restarts += 1
        restart_info = {"env_restarted": True, "restart_reason": f"{payload[0]}: {payload[1]}"}
        if pending.command == "reset":
            self._workers[index] = self._start_worker(index, needs_reset=False)
            self._workers[index].restarts = worker.restarts
            self._await_ready(index)
            self._send(index, "reset", pending.payload)
            self._workers[index].info_extra = restart_info
            return
        # An interrupted step ends its episode as truncated at the last observation seen.
        last_obs = self._single_obs(index)
        new = self._start_worker(index, needs_reset=self.autoreset_mode == AutoresetMode.NEXT_STEP)
        new.restarts = worker.restarts
        self._workers[index] = new
        self._await_ready(index)
        info: dict[str, Any] = dict(restart_info)
        observation = None if self.shared_memory else last_obs
        if self.autoreset_mode == AutoresetMode.SAME_STEP:
            new.pipe.send(("reset", {}))
            if not new.pipe.poll(self.step_timeout or self.start_timeout):
                raise WorkerError(index, "reset", "StepTimeout", "the restarted env did not reset in time")
            ok, reset_payload = self._read(index)
            if not ok:
                raise self._error_from_payload(index, "reset", reset_payload)
            observation, reset_info = reset_payload
            info = {"final_obs": last_obs, "final_info": {}, **reset_info, **restart_info}
            if self._env_obs is not None:
                self._env_obs[index] = observation
        new.pending = pending
        new.result = (observation, 0.0, False, True, info)
        self._arrivals.append(index)

    def _single_obs(self, index: int) -> Any:
        if self._env_obs is not None:
            return self._env_obs[index]
        return _take(self._observations, index)

    def _collect(self, indices: list[int], timeout: float | None) -> None:
        """Wait until every env in ``indices`` has answered."""
        if timeout is None and self.step_timeout is None:
            # Nothing to time out: read each pipe in turn, as gymnasium does (no selector per call).
            # A dead worker reads as EOF, so this never blocks on a dead env.
            for index in indices:
                while self._workers[index].result is _NO_RESULT:
                    ok, payload = self._read(index)
                    if ok:
                        self._accept(index, payload)
                    else:
                        self._fail(index, payload)
            return
        self._wait_until(
            lambda: all(self._workers[i].result is not _NO_RESULT for i in indices), timeout, "not every env answered"
        )

    def _deliver(self, indices: Sequence[int]) -> list[Any]:
        """Pop the answers of ``indices``; the envs become free for the next command."""
        results = []
        taken = set(indices)
        self._arrivals = deque(i for i in self._arrivals if i not in taken)
        for index in indices:
            worker = self._workers[index]
            results.append(worker.result)
            worker.result = _NO_RESULT
            worker.pending = None
        return results

    # ------------------------------------------------------------------ actions

    def _check_action(self, action: Any, env_id: int) -> Any:
        space = self.single_action_space
        if isinstance(space, spaces.Box):
            action = np.asarray(action)
            if action.shape != space.shape:
                raise ValueError(
                    f"action for env {env_id} has shape {action.shape}, expected {space.shape} of {space}"
                )
            if np.issubdtype(action.dtype, np.number) and action.dtype != space.dtype:
                action = action.astype(space.dtype)
        if not space.contains(action):
            raise ValueError(f"action {action} for env {env_id} is not in the action space {space}")
        return action

    def _split_actions(self, actions: Any, env_ids: Sequence[int]) -> list[Any]:
        count = len(env_ids)
        if count not in self._action_spaces:
            self._action_spaces[count] = batch_space(self.single_action_space, count)
        try:
            items = list(iterate(self._action_spaces[count], actions))
        except Exception as exc:
            raise ValueError(
                f"actions do not fit a batch of {count} from single_action_space {self.single_action_space}: {exc}"
            ) from exc
        if len(items) != count:
            raise ValueError(
                f"got {len(items)} actions for {count} envs (env_ids={list(env_ids)}); "
                f"expected one action per env from {self.single_action_space}"
            )
        if self.validate_actions and not self._action_spaces[count].contains(actions):
            items = [self._check_action(a, i) for a, i in zip(items, env_ids)]  # finds the bad one, casts Box dtypes
        return items

    # ------------------------------------------------------------------ lockstep API

    def _assert_is_running(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError(f"Trying to operate on {type(self).__name__} after close().")

    def _assert_idle(self, call: str) -> None:
        self._assert_is_running()
        if self._state != _LockstepState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{call}` while waiting for a pending call to `{self._state.value}` to complete.",
                self._state.value,
            )
        busy = self.in_flight
        if busy:
            raise AlreadyPendingCallError(
                f"Calling `{call}` while envs {busy} have sends in flight or answers not yet received with recv().",
                "send",
            )

    def _seeds(self, seed: int | Sequence[int | None] | None) -> list[int | None]:
        if seed is None:
            return [None] * self.num_envs
        if isinstance(seed, (int, np.integer)):
            return [int(seed) + i for i in range(self.num_envs)]
        seeds = list(seed)
        if len(seeds) != self.num_envs:
            raise ValueError(
                f"If seeds are passed as a list the length must match num_envs={self.num_envs} but got length={len(seeds)}."
            )
        return seeds

    def _reset_mask(self, options: dict[str, Any] | None) -> np.ndarray | None:
        if options is None or "reset_mask" not in options:
            return None
        mask = options.pop("reset_mask")
        if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.shape != (self.num_envs,):
            raise ValueError(
                f"options['reset_mask'] must be a numpy bool array of shape ({self.num_envs},), got {mask!r}"
            )
        if not mask.any():
            raise ValueError("options['reset_mask'] must contain at least one True value")
        return mask

    def reset(self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None):
        """Resets the sub-environments (those in ``options["reset_mask"]`` if given)."""
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(self, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None) -> None:
        """Sends ``reset`` to the sub-environments; :meth:`reset_wait` collects the results."""
        self._assert_idle("reset_async")
        options = None if options is None else dict(options)
        seeds = self._seeds(seed)
        mask = self._reset_mask(options)
        self._lockstep_ids = [i for i in range(self.num_envs) if mask is None or mask[i]]
        for i in self._lockstep_ids:
            self._send(i, "reset", {"seed": seeds[i], "options": options})
        self._state = _LockstepState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None):
        """Waits for :meth:`reset_async`; returns the batched observations and infos."""
        self._assert_is_running()
        if self._state != _LockstepState.WAITING_RESET:
            raise NoAsyncCallError("Calling `reset_wait` without any prior call to `reset_async`.", "reset")
        self._collect(self._lockstep_ids, timeout)
        infos: dict[str, Any] = {}
        for index, (observation, info) in zip(self._lockstep_ids, self._deliver(self._lockstep_ids)):
            infos = self._add_info(infos, self._with_extra(index, info), index)
        self._state = _LockstepState.DEFAULT
        return self._batched_observations(), infos

    def step(self, actions: Any):
        """Steps every sub-environment; returns batched (obs, rewards, terminations, truncations, infos)."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Sends one action to every sub-environment; :meth:`step_wait` collects the results."""
        self._assert_idle("step_async")
        ids = list(range(self.num_envs))
        for i, action in zip(ids, self._split_actions(actions, ids)):
            self._send(i, "step", action)
        self._lockstep_ids = ids
        self._state = _LockstepState.WAITING_STEP

    def step_wait(self, timeout: float | None = None):
        """Waits for :meth:`step_async` (at most ``timeout`` seconds) and returns the batch."""
        self._assert_is_running()
        if self._state != _LockstepState.WAITING_STEP:
            raise NoAsyncCallError("Calling `step_wait` without any prior call to `step_async`.", "step")
        ids = self._lockstep_ids
        self._collect(ids, timeout)
        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminations = np.zeros(self.num_envs, dtype=np.bool_)
        truncations = np.zeros(self.num_envs, dtype=np.bool_)
        infos: dict[str, Any] = {}
        for index, (observation, reward, terminated, truncated, info) in zip(ids, self._deliver(ids)):
            rewards[index], terminations[index], truncations[index] = reward, terminated, truncated
            infos = self._add_info(infos, self._with_extra(index, info), index)
        self._state = _LockstepState.DEFAULT
        return self._batched_observations(), rewards, terminations, truncations, infos

    def _with_extra(self, index: int, info: dict[str, Any]) -> dict[str, Any]:
        extra = self._workers[index].info_extra
        if extra:
            self._workers[index].info_extra = {}
            return {**info, **extra}
        return info

    def _batched_observations(self) -> Any:
        if self._env_obs is not None:
            self._observations = concatenate(self.single_observation_space, self._env_obs, self._observations)
        return deepcopy(self._observations) if self.copy else self._observations

    # ------------------------------------------------------------------ EnvPool API

    def async_reset(self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None) -> None:
        """Resets every env without waiting; the reset observations come out of :meth:`recv`.

        Reset results carry reward 0 and ``terminated = truncated = False``.
        """
        self._assert_idle("async_reset")
        seeds = self._seeds(seed)
        for i in range(self.num_envs):
            self._send(i, "reset", {"seed": seeds[i], "options": options})

    def send(self, actions: Any, env_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Sends one action to each env in ``env_ids`` (default: all) and returns at once.

        Raises:
            ValueError: an env id is out of range, repeated, or still busy; or an action does
                not belong to ``single_action_space`` (nothing is sent then).
        """
        self._assert_is_running()
        if self._state != _LockstepState.DEFAULT:
            raise AlreadyPendingCallError(f"Calling `send` while waiting for `{self._state.value}`.", self._state.value)
        ids = list(range(self.num_envs)) if env_ids is None else [int(i) for i in np.asarray(env_ids).reshape(-1)]
        if len(set(ids)) != len(ids):
            raise ValueError(f"env_ids has repeated ids: {ids}")
        for i in ids:
            if not 0 <= i < self.num_envs:
                raise ValueError(f"env id {i} is out of range [0, {self.num_envs})")
            if self._workers[i].pending is not None:
                raise ValueError(
                    f"env {i} is still busy with its previous send (or its answer was not received with recv() yet)"
                )
        for i, action in zip(ids, self._split_actions(actions, ids)):
            self._send(i, "step", action)

    def recv(self, timeout: float | None = None):
        """Returns the first ``batch_size`` envs to finish, in arrival order.

        If fewer than ``batch_size`` envs are in flight, returns all of them once they finish.
        ``info["env_id"]`` holds the env ids of the rows; other info keys follow gymnasium's
        ``key``/``_key`` convention, sized to the batch.

        Raises:
            NoAsyncCallError: nothing was sent.
            multiprocessing.TimeoutError: the batch was not complete within ``timeout``
                seconds; answers already received stay buffered for the next ``recv``.
        """
        self._assert_is_running()
        in_flight = self.in_flight
        if not in_flight:
            raise NoAsyncCallError("Calling `recv` with no env in flight: call `async_reset` or `send` first.", "recv")
        target = min(self.batch_size, len(in_flight))
        self._wait_until(lambda: len(self._arrivals) >= target, timeout, f"recv: fewer than {target} envs answered")
        ids = [self._arrivals[k] for k in range(target)]
        rows = np.asarray(ids, dtype=np.int64)
        commands = [self._workers[i].pending.command for i in ids]
        results = self._deliver(ids)
        rewards = np.zeros(target, dtype=np.float64)
        terminations = np.zeros(target, dtype=np.bool_)
        truncations = np.zeros(target, dtype=np.bool_)
        infos: dict[str, Any] = {}
        for k, (index, command, result) in enumerate(zip(ids, commands, results)):
            if command == "reset":
                info = result[1]
            else:
                _, rewards[k], terminations[k], truncations[k], info = result
            infos = self._add_info(infos, self._with_extra(index, info), index)
        infos = _take_info(infos, rows)
        infos["env_id"] = rows
        if self.shared_memory:
            observations = _take(self._observations, rows)
        else:
            empty = create_empty_array(self.single_observation_space, n=target, fn=np.zeros)
            observations = concatenate(self.single_observation_space, [self._env_obs[i] for i in ids], empty)
        return observations, rewards, terminations, truncations, infos

    # ------------------------------------------------------------------ calls

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Calls a method (or reads an attribute) of every sub-environment."""
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Sends a method call to every sub-environment; :meth:`call_wait` collects the results."""
        self._assert_idle("call_async")
        for i in range(self.num_envs):
            self._send(i, "call", (name, args, kwargs))
        self._state = _LockstepState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """Waits for :meth:`call_async` and returns one result per sub-environment."""
        self._assert_is_running()
        if self._state != _LockstepState.WAITING_CALL:
            raise NoAsyncCallError("Calling `call_wait` without any prior call to `call_async`.", "call")
        return self._finish_calls("call", timeout)

    def _finish_calls(self, command: str, timeout: float | None) -> tuple[Any, ...]:
        ids = list(range(self.num_envs))
        self._collect(ids, timeout)  # on timeout the call stays pending: call_wait again
        results = self._deliver(ids)
        self._state = _LockstepState.DEFAULT
        for index, result in enumerate(results):
            if isinstance(result, _CallFailure):
                raise self._error_from_payload(index, command, result.payload)
        return tuple(results)

    def render(self) -> tuple[Any, ...] | None:
        """Returns the rendered frames of the sub-environments."""
        return self.call("render")

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Reads an attribute from every sub-environment."""
        return self.call(name)

    def set_attr(self, name: str, values: Any) -> None:
        """Sets an attribute on every sub-environment (one value each if a list or tuple)."""
        self._assert_idle("set_attr")
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(
                f"Values must be a list or tuple with length equal to the number of environments. "
                f"Got `{len(values)}` values for {self.num_envs} environments."
            )
        for i, value in enumerate(values):
            self._send(i, "setattr", (name, value))
        self._finish_calls("setattr", None)

    def _check_spaces(self) -> None:
        for i in range(self.num_envs):
            self._send(i, "check_spaces", (self.observation_mode, self.single_observation_space, self.single_action_space))
        for index, (same_obs, same_action) in enumerate(self._finish_calls("check_spaces", self.start_timeout)):
            if not same_obs:
                raise RuntimeError(
                    f"env {index} has an observation space different from {self.single_observation_space}"
                )
            if not same_action:
                raise RuntimeError(f"env {index} has an action space different from {self.single_action_space}")

    # ------------------------------------------------------------------ closing

    @property
    def in_flight(self) -> list[int]:
        """Ids of the envs that were sent a command whose answer ``recv`` has not returned yet."""
        return [i for i, w in enumerate(self._workers) if w.pending is not None]

    @property
    def restarts(self) -> list[int]:
        """How many times each worker was rebuilt after a fault."""
        return [w.restarts for w in self._workers]

    @property
    def worker_pids(self) -> list[int | None]:
        """Process ids of the live workers (for monitoring and fault tests)."""
        return [w.process.pid for w in self._workers]

    def close_extras(self, timeout: float | None = 5.0, terminate: bool = False) -> None:
        """Stops every worker; kills any that does not stop within ``timeout`` seconds."""
        workers = getattr(self, "_workers", [])
        if not terminate:
            for worker in workers:
                if worker.process.is_alive() and not worker.pipe.closed:
                    try:
                        worker.pipe.send(("close", None))
                    except (BrokenPipeError, OSError):
                        pass
        deadline = None if timeout is None and not terminate else time.monotonic() + (0.0 if terminate else timeout)
        for worker in workers:
            worker.process.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5.0)
            worker.pipe.close()
        self._state = _LockstepState.DEFAULT

    def close(self, **kwargs: Any) -> None:
        """Closes the workers; safe to call twice, after errors, and from ``__del__``."""
        if self.closed:
            return
        self.closed = True
        self.close_extras(**kwargs)

    def __enter__(self) -> AsyncLLMVectorEnv:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(terminate=exc[0] is not None)

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self.close(terminate=True)

    def __repr__(self) -> str:
        return f"AsyncLLMVectorEnv(num_envs={self.num_envs}, batch_size={self.batch_size})"
