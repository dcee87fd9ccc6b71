"""``AsyncLLMVectorEnv``: a Gymnasium vector env with EnvPool-style partial batches and restarts.

This module holds the split-phase state machine (the public API, its state enum and typed
errors) and Gymnasium's lockstep API; EnvPool's ``send``/``recv`` API over the same state is in
:mod:`~asyncvec.vector.envpool_api`. The rest lives beside it: placement (:mod:`~asyncvec.vector.placement`), messages to the
workers and their answers (:mod:`~asyncvec.vector.dispatch`), restarts after faults
(:mod:`~asyncvec.vector.faults`), action checks (:mod:`~asyncvec.vector.actions`), observation
buffers (:mod:`~asyncvec.vector.observations`), transports and the worker loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import numpy as np
from gymnasium import Env, Space
from gymnasium.vector.utils import batch_space, read_from_shared_memory
from gymnasium.vector.vector_env import AutoresetMode, VectorEnv

from asyncvec.vector.actions import ActionSplitter, reset_mask, seeds_for
from asyncvec.vector.advice import TIMED_STEPS, PlacementAdvisor, timed_for_advice
from asyncvec.vector.dispatch import CallFailure, Dispatcher
from asyncvec.vector.envpool_api import EnvPoolAPI
from asyncvec.vector.errors import (
    AlreadyPendingCallError,
    ClosedEnvironmentError,
    NoAsyncCallError,
    SpaceMismatchError,
    error_from_payload,
)
from asyncvec.vector.faults import FaultPolicy, MaxRestarts, check_fault_settings, describe_policy
from asyncvec.vector.observations import ObservationBuffers
from asyncvec.vector.placement import check_placement_arguments, initial_placement, resolve_backend
from asyncvec.vector.slots import OWES_RESTART_STEP, SlotState
from asyncvec.vector.split_obs import is_fixed_shape, shared_subspace
from asyncvec.vector.transport import (
    Backend,
    InProcessBackend,
    ProcessBackend,
    Transport,
    WorkerSpec,
    usable_cores,
)
from asyncvec.vector.worker import make_env

__all__ = ["AsyncLLMVectorEnv"]

logger = logging.getLogger("asyncvec.vector")


class _LockstepState(Enum):
    DEFAULT = "default"
    WAITING_RESET = "reset"
    WAITING_STEP = "step"
    WAITING_CALL = "call"


# A timed-out wait leaves its call pending (the answers are still coming): waiting again resumes it.
_PENDING = "not every env answered (the call stays pending: `{call}` again waits for the rest)"


class AsyncLLMVectorEnv(EnvPoolAPI, VectorEnv[Any, Any, Any]):
    """Runs sub-environments in workers; fast envs never wait for slow ones.

    Two APIs over the same workers:

    * Gymnasium's lockstep API (``reset``, ``step``, ``step_async``/``step_wait``, ``call``...),
      returning the same results as :class:`gymnasium.vector.SyncVectorEnv` in all three
      autoreset modes.
    * EnvPool's asynchronous API: ``async_reset()``, ``send(actions, env_ids)`` and ``recv()``,
      which returns the first ``batch_size`` envs to finish, their ids in ``info["env_id"]``.
      While the caller works on one group (e.g. waits for a slow policy), the others step.

    Workers are processes on this machine (``backend="process"``, the default) or Ray actors anywhere on a
    cluster (``backend="ray"`` or ``backend=RayBackend(...)`` from :mod:`asyncvec.distributed`); the semantics
    are the same. A worker hosts ``envs_per_worker`` envs and steps them one after another, so fast envs pay
    one round trip per worker instead of one per env; ``send``/``recv`` still take and return single env ids.
    Where the envs run is decided once, from your settings (one env per worker unless told), and never changes;
    your first steps are timed and ``envs.placement.advice`` names a faster setting (:mod:`~asyncvec.vector.advice`).

    Faults: an env that raises, a worker killed by a signal, or a step longer than ``step_timeout``
    raises :class:`WorkerError` naming the env index, the exception type and the worker's traceback,
    and the vector env closes itself. With ``max_restarts > 0`` (or a ``fault_policy`` that says so)
    the envs are rebuilt instead, each interrupted episode truncated with ``info["env_restarted"] =
    True``, the other envs running on, reseeded reproducibly (:mod:`~asyncvec.vector.faults`).

    A failed call never leaves the env pending: an env method that raises is a ``WorkerError``
    with the env idle after it; a payload that cannot be sent raises with nothing left in flight;
    any other error while waiting closes the env (the next call says why). Only a wait given a
    ``timeout`` that runs out leaves its call pending, to be waited for again.

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
        shared_memory: pass fixed-shape observations through shared memory (process backend).
            Observations of Text, Sequence, Graph or other variable-size spaces go through
            pipes; a Dict that mixes both (an image plus a Text instruction) is split: its
            fixed-shape entries through shared memory, the rest with the step's answer.
        context: multiprocessing start method (``"fork"``, ``"spawn"``, ``"forkserver"``).
        step_timeout: seconds a reset or step may take before its worker is treated as hung
            (killed, then restarted or reported); a message to a worker hosting ``k`` envs may
            take ``k * step_timeout``. ``None`` waits forever. Method calls and attributes
            (``call``, ``get_attr``, ``set_attr``, ``render``) have no such deadline.
        max_restarts: how many times each env may be rebuilt after a fault (``fault_policy``: a
            :class:`~asyncvec.vector.faults.FaultPolicy` of your own decides instead).
        copy: return copies of observations from ``reset``/``step`` (``recv`` always copies).
        validate_actions: check each action against ``single_action_space`` before sending.
        start_timeout: seconds a worker may take to build its envs.
        daemon: start workers as daemon processes.
        observation_mode: ``"same"`` (every env has the same observation space) or
            ``"different"`` (same dtype and shape suffice).
        envs_per_worker: how many envs each worker hosts (the last worker may host fewer).
            ``None`` (default): one, as gymnasium's ``AsyncVectorEnv`` (a crash or a slow step stays with
            its env). Cheap CPU-bound envs run faster shared; ``envs.placement.advice`` says so, with the gain.
        in_process: ``True``: every env in the calling process, stepped as ``SyncVectorEnv`` steps
            them (no workers, no crash isolation, no ``step_timeout``); ``None``/``False`` (default): workers.
        placement: ``"auto"`` (default: from your settings, as above) or ``"probe"``: step a
            throwaway copy of each distinct env function with random actions before anything
            runs, and place from that (an opt-in: those actions reach whatever the env drives).
        backend: ``"process"``, ``"ray"``, or a :class:`~asyncvec.vector.transport.Backend`
            such as ``RayBackend(address=..., num_cpus=..., resources=...)``.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Env[Any, Any]]],
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
        envs_per_worker: int | None = None,
        in_process: bool | None = None,
        backend: str | Backend = "process",
        placement: str = "auto",
        fault_policy: FaultPolicy | None = None,
    ) -> None:
        self.closed = True  # until the workers exist; makes __del__ safe on early errors
        self._closed_reason: str | None = None  # set when an error closed the env
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
        check_fault_settings(step_timeout, max_restarts, in_process, fault_policy)
        if observation_mode not in ("same", "different"):
            raise ValueError(f"observation_mode must be 'same' or 'different', got {observation_mode!r}")
        check_placement_arguments(envs_per_worker, in_process, backend, placement)
        self.copy = copy
        self.validate_actions = validate_actions
        self.context = context
        self.daemon = daemon
        self.observation_mode = observation_mode
        self.backend = resolve_backend(backend, context, daemon)
        self._state = _LockstepState.DEFAULT
        self._lockstep_ids: list[int] = []
        self._transport: Transport = None  # type: ignore[assignment]  # None until the workers exist; close() checks
        self._dispatch: Dispatcher = None  # type: ignore[assignment]  # made with the transport
        self._shm: Any = None
        self._observations = ObservationBuffers(self.num_envs)
        self._action_rows: Any = None  # shared views of one action per env, when actions travel that way
        self._in_process_steps: bool | None = None  # placement and buffers allow the in-process fast path
        self._advisor: PlacementAdvisor | None = None  # times the first steps and advises a setting (advice.py)

        spaces = None
        if self.backend.local:  # read the spaces from one throwaway env (shared memory must exist before the workers)
            dummy = make_env(self.env_fns[0], 0)
            self._set_spaces(dummy.observation_space, dummy.action_space, dummy.metadata, dummy.render_mode)
            dummy.close()
            del dummy
            spaces = (self.single_observation_space, self.single_action_space, self.render_mode, self.metadata)
        self.placement, blockers = initial_placement(
            self.env_fns,
            self.backend,
            placement=placement,
            envs_per_worker=envs_per_worker,
            in_process=in_process,
            max_restarts=max_restarts,
            step_timeout=step_timeout,
            batch_size=self.batch_size,
            spaces=spaces,
            context=context,
            start_timeout=start_timeout,
            daemon=daemon,
            fault_policy=fault_policy,
        )
        logger.info("AsyncLLMVectorEnv(num_envs=%d) places its envs %s", self.num_envs, self.placement)
        if self.placement.in_process:
            self.backend = InProcessBackend()
        self.envs_per_worker = self.placement.envs_per_worker
        groups = [list(group) for group in self.placement.groups]

        if self.backend.local:
            shared_space = shared_subspace(self.single_observation_space) if shared_memory else None
            if shared_space is not None:  # the whole observation, or a Dict's fixed-shape entries (images)
                self._shm = self.backend.create_shared_memory(shared_space, self.num_envs)
                self._observations.build(self.single_observation_space, self._shm)
        self.shared_memory = self._shm is not None
        action_memory = None
        if shared_memory and isinstance(self.backend, ProcessBackend) and is_fixed_shape(self.single_action_space):
            action_memory = self.backend.create_shared_memory(self.single_action_space, self.num_envs)
            self._action_rows = read_from_shared_memory(self.single_action_space, action_memory, n=self.num_envs)
        self._action_memory = action_memory
        timed = TIMED_STEPS if isinstance(self.backend, ProcessBackend) and self.placement.profiles is None else 0
        spec = WorkerSpec(self.env_fns, groups, self.autoreset_mode, self._shm, action_memory, timed, start_timeout)
        self._transport = self.backend.create(spec)
        self._dispatch = Dispatcher(
            self._transport,
            groups,
            self._observations,
            autoreset_mode=self.autoreset_mode,
            step_timeout=step_timeout,
            start_timeout=start_timeout,
            fault_policy=MaxRestarts(int(max_restarts)) if fault_policy is None else fault_policy,
            action_rows=self._action_rows,
            close_for=self._close_for,
        )
        self._slots = self._dispatch.slots
        if timed:  # the envs' own steps are timed for the advice
            self._advisor = PlacementAdvisor(self, blockers, self.batch_size < self.num_envs, usable_cores())
        self.closed = False
        try:
            for worker in range(len(groups)):
                self._dispatch.await_ready(worker)
            if not self.backend.local:
                # Remote workers may build envs the driver cannot: ask env 0 for the spaces.
                self._dispatch.send(0, "spaces", None)
                self._set_spaces(*self._finish_calls("spaces", self.start_timeout, ids=[0])[0])
            self._check_spaces()
        except BaseException:
            self.close(terminate=True)
            raise

    def _set_spaces(
        self, observation_space: Space[Any], action_space: Space[Any], metadata: dict[Any, Any], render_mode: Any
    ) -> None:
        self.metadata = dict(metadata)
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = render_mode
        self.single_observation_space = observation_space
        self.single_action_space = action_space
        self.observation_space = batch_space(observation_space, self.num_envs)
        self._actions = ActionSplitter(action_space, self.num_envs)
        self.action_space = self._actions.batched_space(self.num_envs)
        self._observations.build(observation_space, self._shm)

    def _close_for(self, reason: str) -> None:
        """Closes the env after an error while waiting or a fault past restarting; the next call says ``reason``."""
        if not self.closed:
            self._closed_reason = reason
            self.close(terminate=True)

    # ------------------------------------------------------------------ lockstep API

    def _assert_is_running(self) -> None:
        if self.closed:
            why = f" (it closed itself after {self._closed_reason})" if self._closed_reason else ""
            raise ClosedEnvironmentError(f"Trying to operate on {type(self).__name__} after close(){why}.")

    def _assert_idle(self, call: str) -> None:
        self._assert_is_running()
        if self._state != _LockstepState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{call}` while waiting for a pending call to `{self._state.value}` to complete.",
                self._state.value,
            )
        dispatch = self._dispatch  # an env is busy only while its message or its undelivered answer is there
        idle = SlotState.IDLE
        if (dispatch.arrivals or any(dispatch.queues)) and any(slot.state is not idle for slot in self._slots):
            raise AlreadyPendingCallError(
                f"Calling `{call}` while envs {self.in_flight} have sends in flight or answers not yet received "
                "with recv().",
                "send",
            )

    def _assert_not_waiting(self, call: str) -> None:
        """``send``/``send_reset``: open, and no lockstep call pending (sends to other envs may be)."""
        self._assert_is_running()
        if self._state != _LockstepState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{call}` while waiting for `{self._state.value}`.", self._state.value
            )

    def _assert_waiting_for(self, state: _LockstepState) -> None:
        """``reset_wait``/``step_wait``/``call_wait``: open, with ``state``'s ``*_async`` call pending."""
        self._assert_is_running()
        if self._state != state:
            call = state.value
            raise NoAsyncCallError(f"Calling `{call}_wait` without any prior call to `{call}_async`.", call)

    def reset(
        self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Resets the sub-environments (those in ``options["reset_mask"]`` if given)."""
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(
        self, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> None:
        """Sends ``reset`` to the sub-environments; :meth:`reset_wait` collects the results."""
        self._assert_idle("reset_async")
        options = None if options is None else dict(options)
        seeds = seeds_for(seed, self.num_envs)
        mask = reset_mask(options, self.num_envs)
        ids = [i for i in range(self.num_envs) if mask is None or mask[i]]
        for i in ids:
            self._dispatch.send(i, "reset", {"seed": seeds[i], "options": options})
        self._dispatch.flush_or_discard(ids)
        self._lockstep_ids = ids
        self._state = _LockstepState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Waits for :meth:`reset_async`; returns the batched observations and infos.

        Raises:
            multiprocessing.TimeoutError: not every env answered within ``timeout`` seconds; the
                reset stays pending (call ``reset_wait`` again).
        """
        self._assert_waiting_for(_LockstepState.WAITING_RESET)
        self._dispatch.collect(self._lockstep_ids, timeout, _PENDING.format(call="reset_wait"))
        infos: dict[str, Any] = {}
        for index, (observation, info) in zip(self._lockstep_ids, self._dispatch.deliver(self._lockstep_ids)):
            infos = self._add_info(infos, self._dispatch.with_extra(index, info), index)
        self._state = _LockstepState.DEFAULT
        return self._observations.batch(self.copy), infos

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Steps every sub-environment; returns batched (obs, rewards, terminations, truncations, infos)."""
        self.step_async(actions)
        return self.step_wait()

    @timed_for_advice(lambda envs, result: 0)
    def step_async(self, actions: Any) -> None:
        """Sends one action to every sub-environment; :meth:`step_wait` collects the results."""
        self._assert_idle("step_async")
        ids = list(range(self.num_envs))
        rows, validate = self._action_rows, self.validate_actions
        whole = self._dispatch.can_step_workers and self._actions.fits_rows(actions, rows, validate)
        items = [] if whole else self._actions.split(actions, ids, validate)
        if self._advisor is not None:
            self._advisor.before_send(ids)
        if whole:
            self._dispatch.step_workers(rows, actions)  # one array to shared memory, a byte a worker
        elif self._can_step_in_process():
            self._dispatch.step_all(items)
        else:
            for i, action in zip(ids, items):
                self._dispatch.send(i, "step", action)
            self._dispatch.flush_or_discard(ids)
        self._lockstep_ids = ids
        self._state = _LockstepState.WAITING_STEP

    def _can_step_in_process(self) -> bool:
        """Lockstep steps of in-process envs take :meth:`Dispatcher.step_all` (whole observations in shared memory, no env owing a restart's truncation or info)."""
        if self._in_process_steps is None:
            self._in_process_steps = (
                self.placement.in_process and self._shm is not None and self._observations.per_env is None
            )
        if not self._in_process_steps or not self._dispatch.faults.rebuilds:
            return bool(self._in_process_steps)
        return not any(slot.episode in OWES_RESTART_STEP or slot.info_extra for slot in self._slots)

    def _step_batch(
        self, ids: Sequence[int], rewards: Any, terminations: Any, truncations: Any, env_infos: Sequence[Any]
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Ends a lockstep step: the batch of envs ``ids``' results (each env's info, with what a restart added)."""
        infos: dict[str, Any] = {}
        for index, info in zip(ids, env_infos):
            if info:
                infos = self._add_info(infos, info, index)
        self._state = _LockstepState.DEFAULT
        return (
            self._observations.batch(self.copy),
            np.array(rewards, dtype=np.float64),
            np.array(terminations, dtype=np.bool_),
            np.array(truncations, dtype=np.bool_),
            infos,
        )

    @timed_for_advice(lambda envs, result: envs.num_envs)
    def step_wait(self, timeout: float | None = None) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Waits for :meth:`step_async` (at most ``timeout`` seconds) and returns the batch.

        Raises:
            multiprocessing.TimeoutError: not every env answered within ``timeout`` seconds; the
                step stays pending (call ``step_wait`` again).
        """
        self._assert_waiting_for(_LockstepState.WAITING_STEP)
        dispatch = self._dispatch
        if dispatch.compact_step_waits(timeout):  # step_async: can_step_workers
            return self._step_batch(range(self.num_envs), *dispatch.finish_step_workers())
        if dispatch.stepped is not None:  # the in-process fast path (step_async: _can_step_in_process)
            return self._step_batch(range(self.num_envs), *dispatch.finish_step_all())
        ids = self._lockstep_ids
        dispatch.collect(ids, timeout, _PENDING.format(call="step_wait"))
        results = dispatch.deliver(ids)
        env_infos = [dispatch.with_extra(index, result[4]) for index, result in zip(ids, results)]
        rewards, terminations, truncations = ([result[k] for result in results] for k in (1, 2, 3))
        return self._step_batch(ids, rewards, terminations, truncations, env_infos)

    # ------------------------------------------------------------------ calls

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Calls a method (or reads an attribute) of every sub-environment."""
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Sends a method call to every sub-environment; :meth:`call_wait` collects the results."""
        self._assert_idle("call_async")
        for i in range(self.num_envs):
            self._dispatch.send(i, "call", (name, args, kwargs))
        self._dispatch.flush_or_discard(range(self.num_envs))
        self._state = _LockstepState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """Waits for :meth:`call_async` and returns one result per sub-environment.

        Raises:
            WorkerError: the method raised in an env (the env is idle again).
            multiprocessing.TimeoutError: not every env answered within ``timeout`` seconds; the
                call stays pending (call ``call_wait`` again).
        """
        self._assert_waiting_for(_LockstepState.WAITING_CALL)
        return self._finish_calls("call", timeout)

    def _finish_calls(self, command: str, timeout: float | None, ids: list[int] | None = None) -> tuple[Any, ...]:
        ids = list(range(self.num_envs)) if ids is None else ids
        self._dispatch.flush_or_discard(ids)
        self._dispatch.collect(ids, timeout, _PENDING.format(call="call_wait"))  # a timeout leaves the call pending
        results = self._dispatch.deliver(ids)
        self._state = _LockstepState.DEFAULT
        for index, result in zip(ids, results):
            if isinstance(result, CallFailure):
                raise error_from_payload(index, command, result.payload)
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
            self._dispatch.send(i, "setattr", (name, value))
        self._finish_calls("setattr", None)

    # The fault settings live in the dispatcher; set after construction, they apply from the next step on.
    @property
    def step_timeout(self) -> float | None:
        """Seconds a reset or step may take before its worker counts as hung (``None``: no limit)."""
        return self._dispatch.step_timeout

    @step_timeout.setter
    def step_timeout(self, seconds: float | None) -> None:
        if seconds is not None and self._advisor is not None:  # the calling process is no longer advised
            self._advisor.block(f"step_timeout={seconds} (a step in this process cannot be interrupted)")
        check_fault_settings(seconds, 0, self.placement.in_process)
        self._dispatch.step_timeout = seconds

    @property
    def fault_policy(self) -> FaultPolicy:
        """Decides whether a fault's envs are rebuilt (default: :class:`~asyncvec.vector.faults.MaxRestarts`)."""
        return self._dispatch.faults.policy

    @fault_policy.setter
    def fault_policy(self, policy: FaultPolicy) -> None:
        check_fault_settings(self.step_timeout, 0, self.placement.in_process, policy)
        if self._advisor is not None and policy != MaxRestarts(0):
            self._advisor.block(f"{describe_policy(policy)} (a crash in this process could not be restarted)")
        self._dispatch.faults.policy = policy

    @property
    def max_restarts(self) -> int | None:
        """How many times each env may be rebuilt after a fault (``None``: a ``fault_policy`` of your own decides)."""
        policy = self.fault_policy
        return policy.max_restarts if isinstance(policy, MaxRestarts) else None

    @max_restarts.setter
    def max_restarts(self, count: int) -> None:
        check_fault_settings(self.step_timeout, count, self.placement.in_process)
        self.fault_policy = MaxRestarts(int(count))

    @property
    def start_timeout(self) -> float:
        """Seconds a worker may take to build its envs."""
        return self._dispatch.start_timeout

    def _check_spaces(self) -> None:
        expected = (self.observation_mode, self.single_observation_space, self.single_action_space)
        for i in range(self.num_envs):
            self._dispatch.send(i, "check_spaces", expected)
        for index, same in enumerate(self._finish_calls("check_spaces", self.start_timeout)):
            for kind, space, ok in zip(("observation", "action"), expected[1:], same):
                if not ok:
                    raise SpaceMismatchError(f"env {index} has an {kind} space different from {space}")

    # ------------------------------------------------------------------ closing

    @property
    def in_flight(self) -> list[int]:
        """Ids of the envs that were sent a command whose answer ``recv`` has not returned yet."""
        return [i for i, slot in enumerate(self._slots) if slot.state is not SlotState.IDLE]

    @property
    def restarts(self) -> list[int]:
        """How many times each env was rebuilt after a fault."""
        return [slot.restarts for slot in self._slots]

    @property
    def worker_pids(self) -> list[int | None]:
        """Process id of each env's worker (envs of one worker share it), for monitoring and fault tests."""
        return [self._transport.pid(slot.worker) for slot in self._slots]

    @property
    def worker_nodes(self) -> list[str | None]:
        """The cluster node of each env's worker (``None`` for worker processes on this machine)."""
        return [self._transport.node(slot.worker) for slot in self._slots]

    def close_extras(self, timeout: float | None = 5.0, terminate: bool = False) -> None:  # type: ignore[override]  # as gymnasium's AsyncVectorEnv
        """Stops every worker; kills any that does not stop within ``timeout`` seconds."""
        if self._transport is not None:
            self._transport.close(timeout, terminate)
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
