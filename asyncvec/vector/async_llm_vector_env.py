"""``AsyncLLMVectorEnv``: a Gymnasium vector env with EnvPool-style partial batches and restarts."""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
from gymnasium import Env, Space, spaces
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate, read_from_shared_memory
from gymnasium.vector.vector_env import AutoresetMode, VectorEnv

from asyncvec.vector.errors import (
    AlreadyPendingCallError,
    ClosedEnvironmentError,
    NoAsyncCallError,
    WorkerError,
)
from asyncvec.vector.placement import (
    Placement,
    choose_placement,
    given_placement,
    in_process_placement,
    probe_skip_reason,
    profile_env,
)
from asyncvec.vector.split_obs import check_row, is_fixed_shape, merge_row, row_templates, shared_subspace, write_row
from asyncvec.vector.transport import (
    Backend,
    InProcessBackend,
    InProcessTransport,
    ProcessBackend,
    Transport,
    WorkerSpec,
)
from asyncvec.vector.worker import BuildFailure, EnvFailure, make_env

__all__ = ["AsyncLLMVectorEnv", "restart_seed"]

logger = logging.getLogger("asyncvec.vector")

_ENV_COMMANDS = ("step", "reset")  # commands that run an env forward: they time out, fail over and restart
_TIMED_COMMANDS = ("step", "step_shared", "reset", "restart")  # a message holding one is subject to step_timeout


class _LockstepState(Enum):
    DEFAULT = "default"
    WAITING_RESET = "reset"
    WAITING_STEP = "step"
    WAITING_CALL = "call"


# A timed-out wait leaves its call pending (the answers are still coming): waiting again resumes it.
_PENDING = "not every env answered (the call stays pending: `{call}` again waits for the rest)"

_NO_RESULT = object()  # a worker's answer can be None, so "no answer yet" needs its own marker


@dataclass(frozen=True)
class _CallFailure:
    """An env method raised inside a call; the worker itself is fine."""

    payload: tuple[Any, ...]


@dataclass
class _Message:
    """A message sent to one worker and not yet answered."""

    env_ids: list[int]
    timed: bool  # holds a step or reset: subject to step_timeout
    started_at: float | None  # when the worker began it (None while an earlier message is still running)


@dataclass
class _Slot:
    """The vector env's view of one sub-environment."""

    worker: int
    position: int  # index among its worker's envs
    command: str | None = None  # what the user asked of it and ``recv`` has not returned yet
    payload: Any = None  # kept to repeat a reset after a restart
    result: Any = _NO_RESULT  # answer received, not yet delivered
    info_extra: dict[Any, Any] = field(default_factory=dict)
    restarts: int = 0
    seed: int | None = None  # the last seed the caller gave this env's reset
    reseed: int | None = None  # a rebuilt env's restart_seed, until a message hands it to the worker
    episode: str = "none"  # "none" (never reset), "live", or "ended" (its last step ended it)
    after_restart: tuple[str, str] | None = None  # ("truncate" | "autoreset", reason): its next step after a rebuild


def restart_seed(seed: int, restarts: int) -> int:
    """The seed of an env rebuilt for the ``restarts``-th time, whose last reset had ``seed``.

    A rebuilt env starts with a fresh random generator; its next reset that has no seed of its
    own (the autoreset after the truncated episode, or a ``reset()`` without a seed) uses this
    seed, so a run with restarts is reproducible. It is the first 32-bit word of
    ``numpy.random.SeedSequence(seed, spawn_key=(restarts,))``: distinct for every restart and
    unrelated to the seeds ``seed + i`` of the other envs.

    Example:
        >>> restart_seed(0, 1) == restart_seed(0, 1) != restart_seed(0, 2)
        True
    """
    return int(np.random.SeedSequence(int(seed), spawn_key=(int(restarts),)).generate_state(1, np.uint32)[0])


def _take(batch: Any, rows: np.ndarray | int) -> Any:
    """Rows (or one row) of a batched observation (nested dicts/tuples of arrays), as a copy."""
    if isinstance(batch, dict):
        return {key: _take(value, rows) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_take(value, rows) for value in batch)
    return np.take(batch, rows, axis=0)


def _copy_batch(batch: Any) -> Any:
    """A copy of a batched observation: arrays copied with numpy, anything else deep-copied."""
    if type(batch) is np.ndarray and batch.dtype != object:
        return batch.copy()
    if isinstance(batch, dict):
        return {key: _copy_batch(value) for key, value in batch.items()}
    if type(batch) is tuple:
        return tuple(_copy_batch(value) for value in batch)
    return deepcopy(batch)


def _take_info(infos: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
    """Rows of a gymnasium vector info dict (arrays and ``_key`` masks sized ``num_envs``)."""
    return {key: _take_info(value, rows) if isinstance(value, dict) else value[rows] for key, value in infos.items()}


def _resolve_backend(backend: str | Backend, context: str | None, daemon: bool) -> Backend:
    if isinstance(backend, Backend):
        return backend
    if backend == "process":
        return ProcessBackend(context=context, daemon=daemon)
    if backend == "ray":
        from asyncvec.distributed.ray_env import RayBackend  # imported only when asked: Ray is an extra

        return RayBackend()
    raise ValueError(f"backend must be 'process', 'ray' or a Backend instance, got {backend!r}")


class AsyncLLMVectorEnv(VectorEnv[Any, Any, Any]):
    """Runs sub-environments in workers; fast envs never wait for slow ones.

    Two APIs over the same workers:

    * Gymnasium's lockstep API (``reset``, ``step``, ``step_async``/``step_wait``, ``call``...),
      returning the same results as :class:`gymnasium.vector.SyncVectorEnv` in all three
      autoreset modes.
    * EnvPool's asynchronous API: ``async_reset()``, ``send(actions, env_ids)`` and ``recv()``,
      which returns the first ``batch_size`` envs to finish, their ids in ``info["env_id"]``.
      While the caller works on one group (e.g. waits for a slow policy), the others step.

    Workers are processes on this machine (``backend="process"``, the default) or Ray actors
    anywhere on a cluster (``backend="ray"`` or ``backend=RayBackend(...)`` from
    :mod:`asyncvec.distributed`); the semantics are the same. A worker hosts
    ``envs_per_worker`` envs and steps them one after another, so fast envs pay one round trip
    per worker instead of one per env; ``send``/``recv`` still take and return single env ids.
    Envs far cheaper than a round trip run in the calling process instead. Unless told, the
    vector env measures one env and chooses (``envs.placement``).

    Faults: an env that raises, a worker killed by a signal, or a step longer than
    ``step_timeout`` raises :class:`WorkerError` naming the env index, the exception type and the
    worker's traceback; the vector env then closes itself. With ``max_restarts > 0`` the env is
    rebuilt in place instead: the interrupted episode comes back truncated with
    ``info["env_restarted"] = True`` and every other env keeps running. (When a worker hosting
    several envs dies, all its envs are rebuilt: those with an episode running come back
    truncated on their next step.) A rebuilt env's next reset without a seed of its own is
    seeded with :func:`restart_seed` of its last seed and its restart count, so runs with
    restarts are reproducible.

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
        max_restarts: how many times each env may be rebuilt after a fault.
        copy: return copies of observations from ``reset``/``step`` (``recv`` always copies).
        validate_actions: check each action against ``single_action_space`` before sending.
        start_timeout: seconds a worker may take to build its envs.
        daemon: start workers as daemon processes.
        observation_mode: ``"same"`` (every env has the same observation space) or
            ``"different"`` (same dtype and shape suffice).
        envs_per_worker: how many envs each worker hosts (the last worker may host fewer).
            ``None`` (default): chosen by measuring one env (:mod:`asyncvec.vector.placement`):
            in this process for envs far cheaper than a round trip to a worker, one busy worker
            per core for CPU-bound envs, a worker per env for envs that wait. Given, it always
            wins. ``envs.placement`` says what was chosen and why.
        in_process: ``True``: every env in the calling process (no workers, no crash isolation,
            no ``step_timeout``); ``False``: never; ``None`` (default): as measured.
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
        self._same_step = self.autoreset_mode == AutoresetMode.SAME_STEP
        if step_timeout is not None and step_timeout <= 0:
            raise ValueError(f"step_timeout must be positive seconds or None, got {step_timeout}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        if observation_mode not in ("same", "different"):
            raise ValueError(f"observation_mode must be 'same' or 'different', got {observation_mode!r}")
        if envs_per_worker is not None and (
            isinstance(envs_per_worker, bool)
            or not isinstance(envs_per_worker, (int, np.integer))
            or envs_per_worker < 1
        ):
            raise ValueError(
                f"envs_per_worker must be an int >= 1 or None (chosen by measuring the env), got {envs_per_worker!r}"
            )
        if in_process and envs_per_worker is not None:
            raise ValueError("in_process=True runs every env in this process: do not also give envs_per_worker")
        if in_process and step_timeout is not None:
            raise ValueError("in_process=True cannot enforce step_timeout (an in-process step cannot be interrupted)")
        if in_process and backend != "process":
            raise ValueError(f"in_process=True needs the default backend='process', got backend={backend!r}")
        self.step_timeout = step_timeout
        self.max_restarts = int(max_restarts)
        self.copy = copy
        self.validate_actions = validate_actions
        self.start_timeout = start_timeout
        self.context = context
        self.daemon = daemon
        self.observation_mode = observation_mode
        self.backend = _resolve_backend(backend, context, daemon)
        self._outbox: dict[int, tuple[list[int], list[tuple[int, str, Any]]]] = {}
        self._state = _LockstepState.DEFAULT
        self._lockstep_ids: list[int] = []
        self._action_spaces: dict[int, Space[Any]] = {}
        self._arrivals: deque[int] = deque()  # env ids with an undelivered answer, in arrival order
        self._woken = threading.Event()  # wake(): the next recv that would wait returns at once
        # send/send_reset from another thread while recv waits in this one (see send): recv holds the
        # lock except while it waits for the workers, and such a send wakes that wait to watch its env too
        self._lock = threading.Lock()
        self._recv_waiting = False
        self._transport: Transport = None  # type: ignore[assignment]  # None until the workers exist; close() checks
        self._shm: Any = None
        self._shared_rows: Any = None  # shared views of a Dict's fixed-shape entries when the rest goes by pipe
        self._row_templates = None  # what the parent checks observations against without shared memory
        self._action_rows = None  # shared views of one action per env, when actions travel that way
        self._in_process_steps: bool | None = None  # placement and buffers allow the in-process fast path
        self._stepped: Any = None  # a lockstep step's results, taken by the in-process fast path
        self._box_bounds: tuple[Any, ...] | None = (
            None  # a Box action space's (low, high) if each is one number, else ()
        )

        self.placement = self._place(envs_per_worker, in_process)
        logger.info("AsyncLLMVectorEnv(num_envs=%d) places its envs %s", self.num_envs, self.placement)
        if self.placement.in_process:
            self.backend = InProcessBackend()
        self.envs_per_worker = self.placement.envs_per_worker
        groups = [
            list(range(start, min(start + self.envs_per_worker, self.num_envs)))
            for start in range(0, self.num_envs, self.envs_per_worker)
        ]
        self._slots = [_Slot(worker=w, position=p) for w, group in enumerate(groups) for p in range(len(group))]
        self._groups = groups
        self._queues: list[deque[_Message]] = [deque() for _ in groups]

        if self.backend.local:
            shared_space = shared_subspace(self.single_observation_space) if shared_memory else None
            if shared_space is not None:  # the whole observation, or a Dict's fixed-shape entries (images)
                self._shm = self.backend.create_shared_memory(shared_space, self.num_envs)
                self._make_observation_buffers()
        self.shared_memory = self._shm is not None
        action_memory = None
        if shared_memory and isinstance(self.backend, ProcessBackend) and is_fixed_shape(self.single_action_space):
            action_memory = self.backend.create_shared_memory(self.single_action_space, self.num_envs)
            self._action_rows = read_from_shared_memory(self.single_action_space, action_memory, n=self.num_envs)
        spec = WorkerSpec(self.env_fns, groups, self.autoreset_mode, self._shm, action_memory)
        self._transport = self.backend.create(spec)
        self.closed = False
        try:
            for worker in range(len(groups)):
                self._await_ready(worker)
            if not self.backend.local:
                # Remote workers may build envs the driver cannot: ask env 0 for the spaces.
                self._send(0, "spaces", None)
                self._set_spaces(*self._finish_calls("spaces", self.start_timeout, ids=[0])[0])
            self._check_spaces()
        except BaseException:
            self.close(terminate=True)
            raise

    def _place(self, envs_per_worker: int | None, in_process: bool | None) -> Placement:
        """How the envs are placed: as given, or by :mod:`asyncvec.vector.placement`'s rule.

        On this machine's backends, reads the spaces from one throwaway env first (as gymnasium
        does: shared memory must exist before the workers start)."""
        render_mode = None
        if self.backend.local:
            dummy = make_env(self.env_fns[0], 0)
            self._set_spaces(dummy.observation_space, dummy.action_space, dummy.metadata, dummy.render_mode)
            render_mode = dummy.render_mode
            dummy.close()
            del dummy
        if in_process:
            return in_process_placement(self.num_envs, "in_process=True")
        if envs_per_worker is not None:
            return given_placement(self.num_envs, int(envs_per_worker), "envs_per_worker given")
        if self.backend.local:
            skip = probe_skip_reason(
                self.single_observation_space, self.single_action_space, render_mode, self.metadata
            )
            if skip is not None:
                return given_placement(self.num_envs, 1, f"one env per worker: not measured: {skip}")
        try:
            profile = profile_env(self.env_fns[0], self.context, self.start_timeout, self.daemon)
        except Exception as exc:  # the env, not the vector env, failed: fall back to gymnasium's placement
            return given_placement(self.num_envs, 1, f"one env per worker: {exc}")
        can_run_in_process = (
            in_process is None and self.step_timeout is None and isinstance(self.backend, ProcessBackend)
        )
        return choose_placement(self.num_envs, profile, self.backend.parallelism(), can_run_in_process)

    def _set_spaces(
        self, observation_space: Space[Any], action_space: Space[Any], metadata: dict[Any, Any], render_mode: Any
    ) -> None:
        self.metadata = dict(metadata)
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = render_mode
        self.single_observation_space = observation_space
        self.single_action_space = action_space
        self.observation_space = batch_space(observation_space, self.num_envs)
        self.action_space = batch_space(action_space, self.num_envs)
        self._action_spaces = {self.num_envs: self.action_space}
        self._make_observation_buffers()

    def _make_observation_buffers(self) -> None:
        observation_space = self.single_observation_space
        shared_space = None if self._shm is None else shared_subspace(observation_space)
        self._shared_rows = None
        self._env_obs: list[Any] | None = None
        # without shared memory the parent checks what the workers' write_row would have (check_row)
        self._row_templates = row_templates(observation_space) if self._shm is None else None
        if shared_space is not None and shared_space is not observation_space:
            # Split Dict: fixed-shape entries in shared memory, the rest (e.g. Text) by pipe, merged on arrival.
            self._shared_rows = read_from_shared_memory(shared_space, self._shm, n=self.num_envs)
            self._observations = create_empty_array(observation_space, n=self.num_envs, fn=np.zeros)
            self._env_obs = [None] * self.num_envs
        elif self._shm is not None:
            self._observations = read_from_shared_memory(observation_space, self._shm, n=self.num_envs)
        else:
            self._observations = create_empty_array(observation_space, n=self.num_envs, fn=np.zeros)
            self._env_obs = [None] * self.num_envs  # latest observation per env (no shared memory)

    # ------------------------------------------------------------------ workers

    def _await_ready(self, worker: int) -> None:
        ok, payload = self._transport.await_ready(worker, self.start_timeout)
        if ok:
            return
        if isinstance(payload, BuildFailure):
            raise self._error_from_payload(self._groups[worker][payload.position], "make", payload.payload)
        raise self._error_from_payload(self._groups[worker][0], "make", payload)

    def _error_from_payload(self, index: int, command: str | None, payload: Any) -> WorkerError:
        exc_type, message, trace, pickled = payload
        error = WorkerError(index, str(command), exc_type, message, trace)
        if pickled is not None:
            try:
                error.__cause__ = pickle.loads(pickled)
            except Exception:
                pass
        return error

    def _send(self, index: int, command: str, payload: Any) -> None:
        """Queues one command for one env; :meth:`_flush` sends each worker its share as one message."""
        slot = self._slots[index]
        slot.command, slot.payload = command, payload
        if command == "step" and slot.after_restart is None:  # the hot path: straight to the worker's message
            entry = self._outbox.get(slot.worker)
            if entry is None:
                entry = self._outbox[slot.worker] = ([], [])
            entry[0].append(index)
            entry[1].append(self._step_item(index, slot.position, payload))
            return
        item_command = command
        if command == "reset":
            slot.after_restart = None  # a reset starts afresh anyway
            payload = self._reset_payload(index, payload)
        if command == "step" and slot.after_restart is not None:
            # Its worker was rebuilt while it waited: this step ends the lost episode instead
            # (or, if that episode had ended, is the reset step NEXT_STEP owes it).
            then, reason = slot.after_restart
            if then == "truncate":
                slot.info_extra = {"env_restarted": True, "restart_reason": reason}
            payload = {"rebuild": False, "then": then, "arg": self._single_obs(index), "seed": slot.reseed}
            item_command, slot.after_restart, slot.reseed = "restart", None, None
        self._queue(index, item_command, payload)

    def _step_item(self, index: int, position: int, action: Any) -> tuple[int, str, Any]:
        """A step's item: the action written to the env's shared row (worker processes, fixed-shape
        action spaces: nothing to pickle), else the action itself in the message."""
        if self._action_rows is not None:
            try:
                write_row(self._action_rows, index, action, field="action")
            except ValueError:
                pass  # not checked (validate_actions=False) and not a row: the env itself gets it and says why
            else:
                return position, "step_shared", None
        return position, "step", action

    def _reset_payload(self, index: int, payload: dict[str, Any]) -> dict[str, Any]:
        """A reset with a seed makes it the env's seed; one without takes a rebuilt env's restart seed."""
        slot = self._slots[index]
        if payload["seed"] is not None:
            slot.seed, slot.reseed = payload["seed"], None
        elif slot.reseed is not None:
            payload, slot.reseed = {**payload, "seed": slot.reseed}, None
        return payload

    def _rebuilt(self, index: int) -> None:
        """Counts a rebuild of env ``index`` and derives the seed of its next reset (:func:`restart_seed`)."""
        slot = self._slots[index]
        slot.restarts += 1
        slot.reseed = None if slot.seed is None else restart_seed(slot.seed, slot.restarts)

    def _queue(self, index: int, command: str, payload: Any) -> None:
        slot = self._slots[index]
        ids, items = self._outbox.setdefault(slot.worker, ([], []))
        ids.append(index)
        items.append((slot.position, command, payload))

    def _flush(self) -> None:
        """Sends each worker its queued items as one message.

        A message that cannot be sent (a payload that does not pickle) raises; its envs and
        those of the messages after it go back to idle, as if never asked. Earlier messages
        stay sent: lockstep calls take their answers back with :meth:`_flush_or_discard`.
        """
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        now = time.monotonic()
        messages = list(outbox.items())
        for k, (worker, (ids, items)) in enumerate(messages):
            try:
                self._transport.send(worker, items)
            except BaseException:
                for _, (unsent, _) in messages[k:]:
                    for index in unsent:
                        self._slots[index].command = self._slots[index].payload = None
                raise
            queue = self._queues[worker]
            timed = items[0][1] in _TIMED_COMMANDS or any(command in _TIMED_COMMANDS for _, command, _ in items)
            queue.append(_Message(ids, timed, None if queue else now))

    def _flush_or_discard(self, ids: Sequence[int]) -> None:
        """:meth:`_flush` for a lockstep call over ``ids``: if a message cannot be sent, the
        answers to those that were sent are awaited and dropped, so the call fails whole and
        the env is idle again."""
        try:
            self._flush()
        except BaseException:
            sent = [i for i in ids if self._slots[i].command is not None]
            if sent:
                self._collect(sent, None)
                self._deliver(sent)
            raise

    # ------------------------------------------------------------------ core loop

    def _receive(self, workers: list[int]) -> None:
        """Reads the next reply of each worker (blocking) and files their results."""
        for worker, reply in zip(workers, self._transport.read_many(workers)):
            self._file(worker, *reply)

    def _file(self, worker: int, ok: bool, payload: Any) -> None:
        """Files a worker's reply to its oldest message: results per env, or the worker's death."""
        queue = self._queues[worker]
        message = queue.popleft()
        if queue:
            queue[0].started_at = time.monotonic()
        if not ok:
            queue.appendleft(message)
            self._worker_failed(worker, payload)
            return
        accept = self._accept
        for index, result in zip(message.env_ids, payload):
            if type(result) is EnvFailure:
                self._env_failed(index, result.payload)
            else:
                accept(index, result)
        self._flush()  # restarts queued by failures (nothing to do without one)

    def _poll(self, deadline: float | None, unlocked: bool = False) -> None:
        """Receive the replies that arrive before ``deadline`` (or the next hang deadline);
        ``unlocked``: the caller holds the lock, released while waiting (:meth:`recv`)."""
        busy = [w for w, queue in enumerate(self._queues) if queue]
        if not busy:
            return
        # The earliest of the caller's deadline and the hang deadlines of timed messages; None
        # waits for the next reply (a call, setattr... has no hang deadline: it may take its time).
        deadlines = [] if self.step_timeout is None else [d for d in map(self._hang_deadline, busy) if d is not None]
        if deadline is not None:
            deadlines.append(deadline)
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        if unlocked:
            self._recv_waiting = True
            self._lock.release()
            try:
                ready = self._transport.wait(busy, timeout)
            finally:
                self._lock.acquire()
                self._recv_waiting = False
        else:
            ready = self._transport.wait(busy, timeout)
        self._receive(ready)
        if self.step_timeout is not None:
            now = time.monotonic()
            for worker, queue in enumerate(self._queues):
                hang_at = self._hang_deadline(worker) if queue else None
                if hang_at is not None and now > hang_at:
                    culprit = self._transport.culprit(worker)
                    self._transport.kill(worker)
                    self._worker_failed(
                        worker,
                        ("StepTimeout", f"no answer within step_timeout={self.step_timeout} s", "", None),
                        culprit,
                    )

    def _hang_deadline(self, worker: int) -> float | None:
        """When the worker's running message counts as hung; ``None``: never (no ``step_timeout``,
        or the message holds no step or reset, or it has not started)."""
        head = self._queues[worker][0]
        if self.step_timeout is None or not head.timed or head.started_at is None:
            return None
        return head.started_at + self.step_timeout * len(head.env_ids)

    def _wait_until(self, done: Callable[[], bool], timeout: float | None, what: str, wakeable: bool = False) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not done():
                if deadline is not None and time.monotonic() >= deadline:
                    raise multiprocessing.TimeoutError(f"{what} within {timeout} s")
                if wakeable and self._woken.is_set():
                    self._woken.clear()
                    raise multiprocessing.TimeoutError(f"{what}: woken by wake()")
                self._poll(deadline, unlocked=wakeable)
        except multiprocessing.TimeoutError:
            raise
        except BaseException as exc:
            self._close_after(exc)
            raise

    def _close_after(self, exc: BaseException) -> None:
        """While waiting for workers, any error but a timeout closes the env: after one, which
        worker answered what is unknown, and a call left half-waiting would make every later
        call fail with ``AlreadyPendingCallError``. The next call says why the env closed.
        (A ``try`` in each waiting method rather than a context manager: this is the hot path.)"""
        if not self.closed:
            self._closed_reason = f"{type(exc).__name__}: {exc}"
            self.close(terminate=True)

    def _accept(self, index: int, result: Any) -> None:
        slot = self._slots[index]
        if slot.command == "step" and self._row_templates is None and self._env_obs is None:
            # the common case (a step, its observation in shared memory), without the checks below
            slot.episode = "ended" if (result[2] or result[3]) and not self._same_step else "live"
        elif slot.command in _ENV_COMMANDS:
            if self._row_templates is not None:
                try:
                    check_row(self._row_templates, index, result[0])
                except ValueError as exc:  # a bad observation is the env's failure, as with shared memory
                    self._env_failed(index, (type(exc).__name__, str(exc), "", None))
                    return
            if self._env_obs is not None:
                rest = result[0]
                self._env_obs[index] = rest if self._shared_rows is None else merge_row(self._shared_rows, index, rest)
            if slot.command == "reset":
                slot.episode = "live"
            else:
                slot.episode = "ended" if (result[2] or result[3]) and not self._same_step else "live"
        slot.result = result
        self._arrivals.append(index)

    def _restart_item(self, index: int) -> dict[str, Any]:
        """How an env whose step or reset was lost to a fault starts again on its rebuilt env."""
        slot = self._slots[index]
        if slot.command == "reset":
            return {"then": "reset", "arg": self._reset_payload(index, slot.payload)}
        then = "autoreset" if slot.episode == "ended" and self.autoreset_mode == AutoresetMode.NEXT_STEP else "truncate"
        seed, slot.reseed = slot.reseed, None
        return {"then": then, "arg": self._single_obs(index), "seed": seed}

    def _give_up(self, index: int, command: str | None, payload: Any, note: str = "") -> None:
        slot = self._slots[index]
        error = self._error_from_payload(index, command, payload)
        if slot.restarts:
            note += f"\n(after {slot.restarts} restart(s); max_restarts={self.max_restarts})"
        if note:
            error.args = (f"{error.args[0]}{note}",)
        self._closed_reason = str(error).split("\n", 1)[0]
        self.close(terminate=True)
        raise error

    def _env_failed(self, index: int, payload: Any) -> None:
        """An env raised; its worker is fine: rebuild that env in place, or close and raise."""
        slot = self._slots[index]
        if slot.command not in _ENV_COMMANDS:
            slot.result = _CallFailure(payload)  # a failing method call is reported, nothing restarts
            self._arrivals.append(index)
            return
        if slot.restarts >= self.max_restarts:
            self._give_up(index, slot.command, payload)
        self._rebuilt(index)
        slot.info_extra = {"env_restarted": True, "restart_reason": f"{payload[0]}: {payload[1]}"}
        self._queue(index, "restart", {"rebuild": True, **self._restart_item(index)})

    def _worker_failed(self, worker: int, payload: Any, culprit: int | None = None) -> None:
        """A worker died or hung: rebuild it (all its envs) in place, or close and raise."""
        lost = [i for message in self._queues[worker] for i in message.env_ids]
        self._queues[worker].clear()
        if culprit is None:
            culprit = self._transport.culprit(worker)
        if culprit is None or culprit not in lost:
            culprit = lost[0]
        group = self._groups[worker]
        note = ""
        if len(group) > 1:
            note = f"\n(its worker also hosted envs {[i for i in group if i != culprit]}, rebuilt with it)"
        command = self._slots[culprit].command
        if (
            any(self._slots[i].command not in _ENV_COMMANDS for i in lost)
            or self._slots[culprit].restarts >= self.max_restarts
        ):
            self._give_up(culprit, command, payload, note)
        try:
            self._transport.restart(worker)
            self._await_ready(worker)
        except WorkerError as error:
            error.args = (f"{error.args[0]}\n(while restarting its worker after: {payload[0]}: {payload[1]})",)
            self._closed_reason = str(error).split("\n", 1)[0]
            self.close(terminate=True)
            raise
        except BaseException as exc:
            self._closed_reason = f"{type(exc).__name__}: {exc}"
            self.close(terminate=True)
            raise
        reason = f"{payload[0]}: {payload[1]}"
        for index in group:
            slot = self._slots[index]
            self._rebuilt(index)
            if index in lost:
                slot.info_extra = {"env_restarted": True, "restart_reason": reason}
                self._queue(index, "restart", {"rebuild": False, **self._restart_item(index)})
            elif slot.episode == "live":
                slot.after_restart = ("truncate", reason)
            elif slot.episode == "ended" and self.autoreset_mode == AutoresetMode.NEXT_STEP:
                slot.after_restart = ("autoreset", reason)
        self._flush()

    def _single_obs(self, index: int) -> Any:
        if self._env_obs is not None:
            return self._env_obs[index]
        return _take(self._observations, index)

    def _collect(self, indices: list[int], timeout: float | None, what: str = "not every env answered") -> None:
        """Wait until every env in ``indices`` has answered (see :meth:`_close_after`)."""
        slots = self._slots
        if timeout is None and self.step_timeout is None:
            # Nothing to time out: read each worker in turn, as gymnasium does (no selector per call).
            # A dead worker reads as a failure, so this never blocks on a dead env.
            try:
                while True:
                    waiting = [i for i in indices if slots[i].result is _NO_RESULT]
                    if not waiting:
                        return
                    busy = [w for w in dict.fromkeys(slots[i].worker for i in waiting) if self._queues[w]]
                    if not busy:
                        raise RuntimeError(f"envs {waiting} wait for an answer but nothing was sent to them")
                    self._receive(busy)
            except BaseException as exc:
                self._close_after(exc)
                raise
        self._wait_until(lambda: all(slots[i].result is not _NO_RESULT for i in indices), timeout, what)

    def _deliver(self, indices: Sequence[int]) -> list[Any]:
        """Pop the answers of ``indices``; the envs become free for the next command."""
        results = []
        if len(indices) == len(self._arrivals):
            self._arrivals.clear()
        else:
            taken = set(indices)
            self._arrivals = deque(i for i in self._arrivals if i not in taken)
        for index in indices:
            slot = self._slots[index]
            results.append(slot.result)
            slot.result = _NO_RESULT
            slot.command = slot.payload = None
        return results

    # ------------------------------------------------------------------ actions

    def _check_action(self, action: Any, env_id: int) -> Any:
        space = self.single_action_space
        if isinstance(space, spaces.Box):
            action = np.asarray(action)
            if action.shape != space.shape:
                raise ValueError(f"action for env {env_id} has shape {action.shape}, expected {space.shape} of {space}")
            if np.issubdtype(action.dtype, np.number) and action.dtype != space.dtype:
                action = action.astype(space.dtype)
        if not space.contains(action):
            raise ValueError(f"action {action} for env {env_id} is not in the action space {space}")
        return action

    def _batched_action_space(self, count: int) -> Space[Any]:
        """The action space of a ``send`` to ``count`` envs (cached per count), to split and check actions.

        A space that gymnasium batches as a ``Tuple`` of deep copies (``Text``, ``Graph``,
        ``Sequence``, custom spaces) is batched here as a ``Tuple`` of the single space itself: the
        same items and checks, without a deep copy per env (``batch_space`` of a ``Text`` space took 1.2 ms
        for 1 env, 8.8 ms for 16: a ``send`` to a number of envs not seen before stalled its caller)."""
        batched = self._action_spaces.get(count)
        if batched is None:
            single = self.single_action_space
            if batch_space.dispatch(type(single)) is batch_space.dispatch(Space):
                batched = spaces.Tuple((single,) * count)
            else:
                batched = batch_space(single, count)
            self._action_spaces[count] = batched
        return batched

    def _split_actions(self, actions: Any, env_ids: Sequence[int]) -> list[Any]:
        count = len(env_ids)
        batched = self._batched_action_space(count)
        try:
            items = list(iterate(batched, actions))
        except Exception as exc:
            raise ValueError(
                f"actions do not fit a batch of {count} from single_action_space {self.single_action_space}: {exc}"
            ) from exc
        if len(items) != count:
            raise ValueError(
                f"got {len(items)} actions for {count} envs (env_ids={list(env_ids)}); "
                f"expected one action per env from {self.single_action_space}"
            )
        if self.validate_actions and not self._quickly_valid(actions, count) and not batched.contains(actions):
            items = [self._check_action(a, i) for a, i in zip(items, env_ids)]  # finds the bad one, casts Box dtypes
        return items

    def _quickly_valid(self, actions: Any, count: int) -> bool:
        """A cheaper ``contains`` for the common cases: an integer array of Discrete actions, or a
        Box batch of the space's dtype whose bounds are one number each (two reductions instead of
        the batched space's checks). ``False`` means "not shown", not "invalid"."""
        space = self.single_action_space
        if type(actions) is not np.ndarray or count == 0:
            return False
        if type(space) is spaces.Discrete:
            if actions.shape != (count,) or actions.dtype.kind not in "iu":
                return False
            return bool(actions.min() >= space.start and actions.max() < space.start + space.n)
        if type(space) is spaces.Box and actions.dtype == space.dtype and actions.shape == (count, *space.shape):
            bounds = self._box_bounds
            if bounds is None:
                low, high = space.low.ravel(), space.high.ravel()
                uniform = low.size > 0 and (low == low[0]).all() and (high == high[0]).all()
                bounds = self._box_bounds = (low[0], high[0]) if uniform else ()
            return bool(bounds) and bool(actions.min() >= bounds[0] and actions.max() <= bounds[1])
        return False

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
        if any(slot.command is not None for slot in self._slots):
            raise AlreadyPendingCallError(
                f"Calling `{call}` while envs {self.in_flight} have sends in flight or answers not yet received "
                "with recv().",
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
        seeds = self._seeds(seed)
        mask = self._reset_mask(options)
        ids = [i for i in range(self.num_envs) if mask is None or mask[i]]
        for i in ids:
            self._send(i, "reset", {"seed": seeds[i], "options": options})
        self._flush_or_discard(ids)
        self._lockstep_ids = ids
        self._state = _LockstepState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Waits for :meth:`reset_async`; returns the batched observations and infos.

        Raises:
            multiprocessing.TimeoutError: not every env answered within ``timeout`` seconds; the
                reset stays pending (call ``reset_wait`` again).
        """
        self._assert_is_running()
        if self._state != _LockstepState.WAITING_RESET:
            raise NoAsyncCallError("Calling `reset_wait` without any prior call to `reset_async`.", "reset")
        self._collect(self._lockstep_ids, timeout, _PENDING.format(call="reset_wait"))
        infos: dict[str, Any] = {}
        for index, (observation, info) in zip(self._lockstep_ids, self._deliver(self._lockstep_ids)):
            infos = self._add_info(infos, self._with_extra(index, info), index)
        self._state = _LockstepState.DEFAULT
        return self._batched_observations(), infos

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Steps every sub-environment; returns batched (obs, rewards, terminations, truncations, infos)."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Sends one action to every sub-environment; :meth:`step_wait` collects the results."""
        self._assert_idle("step_async")
        ids = list(range(self.num_envs))
        items = self._split_actions(actions, ids)
        if self._can_step_in_process():
            transport = self._transport
            assert isinstance(transport, InProcessTransport)  # _can_step_in_process: the envs are in this process
            self._stepped = (items, transport.step_all(0, items))
        else:
            for i, action in zip(ids, items):
                self._send(i, "step", action)
            self._flush_or_discard(ids)
        self._lockstep_ids = ids
        self._state = _LockstepState.WAITING_STEP

    def _can_step_in_process(self) -> bool:
        """Whether a lockstep step takes the fast path of in-process envs (:meth:`EnvGroup.step_all`:
        no message nor result per env, as ``SyncVectorEnv``): whole observations in shared memory
        and no env owing a restart's truncation or info."""
        if self._in_process_steps is None:
            self._in_process_steps = self.placement.in_process and self._shm is not None and self._env_obs is None
        slots = self._slots
        return self._in_process_steps and not any(slot.after_restart is not None or slot.info_extra for slot in slots)

    def _finish_step_in_process(self) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """``step_wait`` of the in-process fast path: the envs that raised go through the usual
        failure path (rebuilt and truncated, or the error); the others' results are taken as they are."""
        items, (rewards, terminations, truncations, env_infos, failures) = self._stepped
        self._stepped = None
        if failures:
            failed = [position for position, _ in failures]
            for index, payload in failures:
                slot = self._slots[index]
                slot.command, slot.payload = "step", items[index]
                self._env_failed(index, payload)
            self._flush()
            self._collect(failed, None)
            for index, result in zip(failed, self._deliver(failed)):
                _, rewards[index], terminations[index], truncations[index], env_infos[index] = result
                env_infos[index] = self._with_extra(index, env_infos[index])
        same_step = self._same_step
        infos: dict[str, Any] = {}
        outcomes = zip(self._slots, terminations, truncations, env_infos)
        for index, (slot, terminated, truncated, info) in enumerate(outcomes):
            slot.episode = "ended" if (terminated or truncated) and not same_step else "live"
            if info:
                infos = self._add_info(infos, info, index)
        self._state = _LockstepState.DEFAULT
        return (
            self._batched_observations(),
            np.array(rewards, dtype=np.float64),
            np.array(terminations, dtype=np.bool_),
            np.array(truncations, dtype=np.bool_),
            infos,
        )

    def step_wait(self, timeout: float | None = None) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Waits for :meth:`step_async` (at most ``timeout`` seconds) and returns the batch.

        Raises:
            multiprocessing.TimeoutError: not every env answered within ``timeout`` seconds; the
                step stays pending (call ``step_wait`` again).
        """
        self._assert_is_running()
        if self._state != _LockstepState.WAITING_STEP:
            raise NoAsyncCallError("Calling `step_wait` without any prior call to `step_async`.", "step")
        if self._stepped is not None:
            return self._finish_step_in_process()
        ids = self._lockstep_ids
        self._collect(ids, timeout, _PENDING.format(call="step_wait"))
        results = self._deliver(ids)
        rewards = np.array([result[1] for result in results], dtype=np.float64)
        terminations = np.array([result[2] for result in results], dtype=np.bool_)
        truncations = np.array([result[3] for result in results], dtype=np.bool_)
        infos: dict[str, Any] = {}
        for index, result in zip(ids, results):
            if result[4] or self._slots[index].info_extra:
                infos = self._add_info(infos, self._with_extra(index, result[4]), index)
        self._state = _LockstepState.DEFAULT
        return self._batched_observations(), rewards, terminations, truncations, infos

    def _with_extra(self, index: int, info: dict[str, Any]) -> dict[str, Any]:
        extra = self._slots[index].info_extra
        if extra:
            self._slots[index].info_extra = {}
            return {**info, **extra}
        return info

    def _batched_observations(self) -> Any:
        if self._env_obs is not None:
            self._observations = concatenate(self.single_observation_space, self._env_obs, self._observations)
        return _copy_batch(self._observations) if self.copy else self._observations

    # ------------------------------------------------------------------ EnvPool API

    def async_reset(
        self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> None:
        """Resets every env without waiting; the reset observations come out of :meth:`recv`.

        Reset results carry reward 0 and ``terminated = truncated = False``.
        """
        self._assert_idle("async_reset")
        seeds = self._seeds(seed)
        for i in range(self.num_envs):
            self._send(i, "reset", {"seed": seeds[i], "options": options})
        self._flush()

    def send(self, actions: Any, env_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Sends one action to each env in ``env_ids`` (default: all) and returns at once.

        Thread-safe with a :meth:`recv` waiting in another thread (as :meth:`wake`): an action
        computed in another thread (a policy's callback) goes to its env at once, and the waiting
        ``recv`` watches that env from then on.

        Raises:
            ValueError: an env id is out of range, repeated, or still busy; or an action does
                not belong to ``single_action_space`` (nothing is sent then).
        """
        with self._lock:
            self._assert_is_running()
            if self._state != _LockstepState.DEFAULT:
                raise AlreadyPendingCallError(
                    f"Calling `send` while waiting for `{self._state.value}`.", self._state.value
                )
            ids = list(range(self.num_envs)) if env_ids is None else [int(i) for i in np.asarray(env_ids).reshape(-1)]
            self._check_free(ids)
            for i, action in zip(ids, self._split_actions(actions, ids)):
                self._send(i, "step", action)
            self._flush()
            if self._recv_waiting:  # called while recv waits in another thread: it watches these envs too
                self._transport.wake()

    def _check_free(self, ids: list[int]) -> None:
        """``send``/``send_reset``: each id once, in range, and not still busy."""
        if len(set(ids)) != len(ids):
            raise ValueError(f"env_ids has repeated ids: {ids}")
        for i in ids:
            if not 0 <= i < self.num_envs:
                raise ValueError(f"env id {i} is out of range [0, {self.num_envs})")
            if self._slots[i].command is not None:
                raise ValueError(
                    f"env {i} is still busy with its previous send (or its answer was not received with recv() yet)"
                )

    def send_reset(
        self, env_ids: Sequence[int], seeds: Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> None:
        """Resets the envs in ``env_ids`` (each with its seed) and returns at once; the reset
        observations come out of :meth:`recv` like :meth:`async_reset`'s. The other envs keep
        stepping: an env whose episode ended (or was abandoned) starts its next one when its
        driver chooses, with the seed it chooses (e.g. k episodes of one seed for a group).
        Thread-safe with a :meth:`recv` waiting in another thread, as :meth:`send`.

        Raises:
            ValueError: an env id is out of range, repeated, or still busy; or ``seeds`` has
                another length than ``env_ids``.
        """
        with self._lock:
            self._assert_is_running()
            if self._state != _LockstepState.DEFAULT:
                raise AlreadyPendingCallError(
                    f"Calling `send_reset` while waiting for `{self._state.value}`.", self._state.value
                )
            ids = [int(i) for i in np.asarray(env_ids).reshape(-1)]
            seeds = [None] * len(ids) if seeds is None else list(seeds)
            if len(seeds) != len(ids):
                raise ValueError(f"send_reset: {len(seeds)} seeds for {len(ids)} env ids")
            self._check_free(ids)
            for i, seed in zip(ids, seeds):
                self._send(i, "reset", {"seed": seed, "options": options})
            self._flush()
            if self._recv_waiting:  # called while recv waits in another thread: it watches these envs too
                self._transport.wake()

    def recv(
        self, timeout: float | None = None, *, at_least: int | None = None
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Returns the first ``batch_size`` envs to finish, in arrival order.

        If fewer than ``batch_size`` envs are in flight, returns all of them once they finish.
        With ``at_least=m``, returns as soon as ``m`` envs have finished, with every env finished
        by then (up to ``batch_size``): a loop whose policy batches requests itself need not
        hold a finished env back until ``batch_size - 1`` others finish too.
        ``info["env_id"]`` holds the env ids of the rows; other info keys follow gymnasium's
        ``key``/``_key`` convention, sized to the batch.

        Raises:
            NoAsyncCallError: nothing was sent.
            multiprocessing.TimeoutError: the batch was not complete within ``timeout``
                seconds, or :meth:`wake` ended the wait; answers already received stay
                buffered for the next ``recv``.
        """
        with self._lock:
            self._assert_is_running()
            in_flight = self.in_flight
            if not in_flight:
                raise NoAsyncCallError(
                    "Calling `recv` with no env in flight: call `async_reset` or `send` first.", "recv"
                )
            target = min(self.batch_size, len(in_flight))
            needed = target if at_least is None else max(1, min(int(at_least), target))
            self._wait_until(
                lambda: len(self._arrivals) >= needed,
                timeout,
                f"recv: fewer than {needed} envs answered",
                wakeable=True,
            )
            if len(self._arrivals) < target:  # at_least: take the answers that are ready, without waiting
                try:
                    self._poll(time.monotonic())
                except BaseException as exc:
                    self._close_after(exc)
                    raise
            target = min(target, len(self._arrivals))
            ids = [self._arrivals[k] for k in range(target)]
            rows = np.asarray(ids, dtype=np.int64)
            commands = [self._slots[i].command for i in ids]
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
            if self._env_obs is None:  # everything in shared memory
                observations = _take(self._observations, rows)
            else:
                empty = create_empty_array(self.single_observation_space, n=target, fn=np.zeros)
                observations = concatenate(self.single_observation_space, [self._env_obs[i] for i in ids], empty)
            return observations, rewards, terminations, truncations, infos

    @property
    def wakeable(self) -> bool:
        """Whether :meth:`wake` ends a waiting :meth:`recv` at once (worker processes: yes; a
        transport that cannot ends it at its next return from waiting, at most its timeout)."""
        return self._transport is not None and self._transport.wakeable

    def wake(self) -> None:
        """Ends a :meth:`recv` waiting in another thread, as its timeout would (it raises
        ``multiprocessing.TimeoutError``); a wake while no ``recv`` waits ends the next wait.
        Thread-safe: with :meth:`send` and :meth:`send_reset`, what another thread may call during ``recv``. For a loop that
        waits on envs and on something else, e.g. a policy's answers: ``recv(timeout)`` with a
        long timeout, and ``wake()`` from the other side when its thing is ready.

        Example:
            >>> import multiprocessing, threading, time, gymnasium as gym
            >>> from asyncvec.envs.slow import SlowEnv
            >>> envs = AsyncLLMVectorEnv([lambda: SlowEnv(gym.make("CartPole-v1"), latency_ms=500)], batch_size=1)
            >>> envs.send_reset([0], [0]); _ = envs.recv()
            >>> envs.send([0], [0])  # a step of 500 ms
            >>> threading.Timer(0.05, envs.wake).start()
            >>> start = time.monotonic()
            >>> try:
            ...     envs.recv(timeout=30)
            ... except multiprocessing.TimeoutError:
            ...     print("woken before the step ended:", time.monotonic() - start < 0.4)
            woken before the step ended: True
            >>> envs.close()
        """
        self._woken.set()
        if self._transport is not None:
            self._transport.wake()

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
        self._flush_or_discard(range(self.num_envs))
        self._state = _LockstepState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """Waits for :meth:`call_async` and returns one result per sub-environment.

        Raises:
            WorkerError: the method raised in an env (the env is idle again).
            multiprocessing.TimeoutError: not every env answered within ``timeout`` seconds; the
                call stays pending (call ``call_wait`` again).
        """
        self._assert_is_running()
        if self._state != _LockstepState.WAITING_CALL:
            raise NoAsyncCallError("Calling `call_wait` without any prior call to `call_async`.", "call")
        return self._finish_calls("call", timeout)

    def _finish_calls(self, command: str, timeout: float | None, ids: list[int] | None = None) -> tuple[Any, ...]:
        ids = list(range(self.num_envs)) if ids is None else ids
        self._flush_or_discard(ids)
        self._collect(ids, timeout, _PENDING.format(call="call_wait"))  # a timeout leaves the call pending
        results = self._deliver(ids)
        self._state = _LockstepState.DEFAULT
        for index, result in zip(ids, results):
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
            self._send(
                i, "check_spaces", (self.observation_mode, self.single_observation_space, self.single_action_space)
            )
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
        return [i for i, slot in enumerate(self._slots) if slot.command is not None]

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
