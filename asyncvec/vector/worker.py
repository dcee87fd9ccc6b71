"""What a worker runs: a sub-vector of envs (``EnvGroup``) answering the vector env's commands.

One ``EnvGroup`` is shared by every transport: a worker process (:func:`run_worker`, over a
pipe) and a Ray actor (``asyncvec.distributed.ray_env``) both host an ``EnvGroup`` and hand it
whole messages. A message is a list of ``(local_index, command, payload)`` items, one per env,
and its answer is a list with one result per item, in the same order, so a worker hosting
several envs costs one round trip per message, not one per env.

Commands (per env):

* ``"step"``: the action; answers ``(obs, reward, terminated, truncated, info)`` and applies
  the autoreset mode (as ``gymnasium.vector.SyncVectorEnv`` does). ``"step_shared"``: the same,
  the action read from the env's row of the shared action memory (fixed-shape action spaces:
  no pickled numpy arrays on the hot path).
* ``"reset"``: ``{"seed": ..., "options": ...}``; answers ``(obs, info)``.
* ``"restart"``: ``{"rebuild": bool, "then": "truncate" | "autoreset" | "reset", "arg": ...,
  "seed": int | None}``; rebuilds the env from its function if asked, then ends the episode
  that the fault interrupted as truncated (``arg`` = the last observation the caller saw), or
  runs the NEXT_STEP reset step, or resets with ``arg`` as keyword arguments. ``seed`` seeds
  the env's next reset that has no seed of its own (an autoreset, or a reset without a seed):
  a rebuilt env's episodes are reproducible.
* ``"call"`` ``(name, args, kwargs)``, ``"setattr"`` ``(name, value)``,
  ``"check_spaces"`` ``(observation_mode, observation_space, action_space)``,
  ``"spaces"`` (answers the env's spaces, metadata and render mode), ``"probe"`` (times random
  steps: :func:`time_steps`; only for ``placement="probe"``, which the user opts into).
* ``"timings"`` answers the wall, CPU and ready-wait seconds of the env's first steps (the
  user's own steps, timed as they run), from which :mod:`~asyncvec.vector.advice` advises a
  setting. An env never leaves the process that built it.

An env that raises does not stop the others: its item answers :class:`EnvFailure`.
Observations of fixed-shape spaces are written to shared memory once the whole message is
done (so a worker that dies mid-message never leaves a half-published row) and answered as
``None``.

The hot path, a step of every env of a worker with actions in shared memory, travels without
pickling: the message is the one byte :data:`STEP_MESSAGE`, and when every env's step went well
with an empty info (and its observation in shared memory) the answer is the one byte
:data:`STEP_ANSWER`, each env's reward, ``terminated`` and ``truncated`` in :class:`StepResults`.
Anything else (an info to carry, a failure) answers the whole pickled result list, as for any
message. Frames are multiprocessing's (a 4-byte length, then the bytes), read and written with
one system call each where they fit (:func:`read_frame`, :func:`write_frame`).
"""

from __future__ import annotations

import copy
import copyreg
import io
import os
import pickle
import signal
import struct
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, SupportsFloat

import numpy as np
from gymnasium import Env, Space
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector.utils import read_from_shared_memory
from gymnasium.vector.vector_env import AutoresetMode

from asyncvec.vector.split_obs import copy_row, pipe_part, shared_subspace, write_row

# How often a worker process checks that its parent is still alive.
_PARENT_CHECK_S = 1.0
IDLE = -1  # the value of a worker's "current env" marker between messages
_OBSERVING_COMMANDS = ("step", "step_shared", "reset", "restart")  # commands that answer an observation
#: The probe (``placement="probe"``) steps its env for about this long (wall seconds), at most PROBE_MAX_STEPS steps.
PROBE_BUDGET_S = 0.05
PROBE_MAX_STEPS = 64
#: A step longer than this ends the probe at once: the env is slow, and one step says how slow.
PROBE_SLOW_STEP_S = 0.02


#: Steps of each env not timed before its timed ones (``timed_steps``): a new worker's first steps were about
#: twice its later ones here (page faults, cold caches), and the advice is about the steps after them.
TIMING_WARMUP_STEPS = 32
#: ... or fewer, for slow envs: the warm-up ends once an env has stepped this long.
TIMING_WARMUP_S = 1.0
#: A step of every env of the worker, actions in shared memory (the whole message).
STEP_MESSAGE = b"S"
#: Every step of a STEP_MESSAGE went well with an empty info: results in StepResults and shared memory.
STEP_ANSWER = b"K"
_FRAME_HEADER = struct.Struct("!i")  # multiprocessing.Connection's: a frame sent by send_bytes reads here too


def write_frame(fd: int, payload: bytes) -> None:
    """Writes one frame (``Connection.send_bytes``'s format) to the descriptor ``fd``, in one call where it fits."""
    data = memoryview(_FRAME_HEADER.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data) :]


def read_frame(fd: int) -> bytes:
    """Reads one frame of a non-empty payload (``Connection.recv_bytes``'s format) from ``fd``: one read call
    for a one-byte payload; never reads past the frame. Raises ``EOFError`` when the other end is gone."""
    head = os.read(fd, 5)  # the header and the first byte: all of STEP_MESSAGE / STEP_ANSWER frames
    while len(head) < 5:
        more = os.read(fd, 5 - len(head))
        if not more:
            raise EOFError("the other end of the pipe is gone")
        head += more
    remaining = _FRAME_HEADER.unpack_from(head)[0] - 1
    if remaining == 0:
        return head[4:]
    chunks = [head[4:]]
    while remaining > 0:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            raise EOFError("the other end of the pipe is gone")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


class StepResults:
    """Each env's reward, ``terminated`` and ``truncated`` of its last step, in shared memory (one row per env
    of the vector env): what a :data:`STEP_ANSWER` leaves for the parent to read.

    Example:
        >>> import multiprocessing
        >>> results = StepResults(multiprocessing.get_context(), num_envs=2)
        >>> rewards, terminated, truncated = results.views()
        >>> rewards[1], terminated[1] = 0.5, True
        >>> results.result(1)
        (None, 0.5, True, False, {})
    """

    def __init__(self, ctx: Any, num_envs: int) -> None:
        self.buffers = (ctx.RawArray("d", num_envs), ctx.RawArray("b", num_envs), ctx.RawArray("b", num_envs))
        self._views: tuple[Any, Any, Any] | None = None

    def views(self) -> tuple[Any, Any, Any]:
        """Numpy views: rewards (float64), terminated and truncated (bool), made once per process."""
        if self._views is None:
            rewards, terminated, truncated = self.buffers
            self._views = (
                np.frombuffer(rewards, dtype=np.float64),
                np.frombuffer(terminated, dtype=np.bool_),
                np.frombuffer(truncated, dtype=np.bool_),
            )
        return self._views

    def result(self, index: int) -> tuple[None, float, bool, bool, dict[str, Any]]:
        """Env ``index``'s step as a worker's answer gives it (its observation in shared memory)."""
        rewards, terminated, truncated = self.views()
        return None, float(rewards[index]), bool(terminated[index]), bool(truncated[index]), {}

    def __getstate__(self) -> dict[str, Any]:
        return {"buffers": self.buffers}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.buffers, self._views = state["buffers"], None


@dataclass(frozen=True)
class EnvFailure:
    """One env raised while handling its item: ``(exc_type, message, traceback, pickled exception)``."""

    payload: tuple[str, str, str, bytes | None]


@dataclass(frozen=True)
class BuildFailure:
    """The worker could not build the env at ``position`` of its group."""

    position: int
    payload: tuple[str, str, str, bytes | None]


_NUMPY_SCALARS: tuple[type[np.generic], ...] = (
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
)
_NUMPY_SCALARS += (np.float16, np.float32, np.float64)


def _reduce_numpy_scalar(value: np.generic) -> tuple[Any, ...]:
    return type(value), (value.item(),)


class _MessagePickler(pickle.Pickler):
    """Pickles numpy scalars as ``type(value.item())``: ~4x cheaper than numpy's own reduce.

    Actions from ``gymnasium.vector.utils.iterate`` are numpy scalars (``np.int64`` for
    Discrete), and pickling them dominated the cost of a message to a worker.
    """

    dispatch_table = {**copyreg.dispatch_table, **dict.fromkeys(_NUMPY_SCALARS, _reduce_numpy_scalar)}


def dumps(message: Any) -> bytes:
    """Serializes a message for a pipe (see :class:`_MessagePickler`); ``pickle.loads`` reads it."""
    buffer = io.BytesIO()
    _MessagePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def make_env(fn: Callable[[], Env[Any, Any]], index: int) -> Env[Any, Any]:
    """``fn()``, refused with a TypeError naming ``env_fns[index]`` unless it is an env with gymnasium
    spaces (a plain text game is the common case: it names the wrapper that gives it spaces)."""
    env = fn()
    missing = [
        name for name in ("observation_space", "action_space") if not isinstance(getattr(env, name, None), Space)
    ]
    missing += [f"{name}()" for name in ("reset", "step") if not callable(getattr(env, name, None))]
    if missing:
        raise TypeError(
            f"env_fns[{index}]() returned a {type(env).__name__}, which is not a gymnasium env: it has no "
            f"{' and no '.join(missing)} (a gymnasium env has both spaces, as gymnasium.Space, and reset() and "
            f"step()). A game with plain reset() -> str and step(str) -> (str, reward, done) runs wrapped: "
            f"lambda: asyncvec.lm.StringEnv({type(env).__name__}(...))"
        )
    return env


def error_payload(exc: BaseException) -> tuple[str, str, str, bytes | None]:
    """An exception as plain data that crosses any transport, the original pickled when possible."""
    try:
        pickled = pickle.dumps(exc)
    except Exception:
        pickled = None
    return type(exc).__name__, str(exc), traceback.format_exc(), pickled


_SCHEDSTAT = "/proc/thread-self/schedstat"


def ready_wait_s() -> float:
    """Seconds this thread has spent ready to run but waiting for a CPU (Linux schedstat's run
    delay), 0.0 where the kernel does not say. A step's CPU share is measured against the time it
    had a CPU or did not want one: on a loaded machine a CPU-bound env is preempted, and its
    share of wall time alone would look like an env that waits (placement's test)."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return 0.0


def step_clock() -> tuple[float, float, float]:
    """(wall, process CPU, ready-wait) seconds before a step; `step_elapsed` gives the step's share.
    The schedstat file is read outside the wall and CPU windows: on a 10 us step its read would
    otherwise count as part of the env's step."""
    ready = ready_wait_s()
    cpu = time.process_time()
    return time.perf_counter(), cpu, ready


def step_elapsed(before: tuple[float, float, float]) -> tuple[float, float, float]:
    """(wall, process CPU, ready-wait) seconds since ``before`` (from `step_clock`)."""
    wall = time.perf_counter() - before[0]
    cpu = time.process_time() - before[1]
    return wall, cpu, ready_wait_s() - before[2]


def time_steps(
    env: Env[Any, Any], budget_s: float = PROBE_BUDGET_S, max_steps: int = PROBE_MAX_STEPS
) -> dict[str, Any]:
    """Steps ``env`` with random actions (a seeded copy of its action space) and times each step.

    Runs in the probe's worker process (the ``"probe"`` command, ``placement="probe"`` only). Returns
    ``{"step_s": [...], "cpu_s": [...], "ready_s": [...]}``, wall, process-CPU and ready-wait seconds
    per step (`step_clock`); a reset after an
    episode's end is not timed. Stops after ``budget_s`` of stepping, ``max_steps`` steps, or one
    step longer than ``PROBE_SLOW_STEP_S``.
    """
    space: Space[Any] = copy.deepcopy(env.action_space)
    space.seed(0)
    env.reset(seed=0)
    walls: list[float] = []
    cpus: list[float] = []
    readies: list[float] = []
    spent = 0.0
    while len(walls) < max_steps and spent < budget_s:
        action = space.sample()
        before = step_clock()
        _, _, terminated, truncated, _ = env.step(action)
        wall, cpu, ready = step_elapsed(before)
        walls.append(wall)
        cpus.append(cpu)
        readies.append(ready)
        spent += wall
        if wall > PROBE_SLOW_STEP_S:
            break
        if terminated or truncated:
            env.reset()
    return {"step_s": walls, "cpu_s": cpus, "ready_s": readies}


class EnvGroup:
    """The envs one worker hosts, and how they answer a message (see the module docstring).

    Args:
        env_fns: the functions that build this worker's envs.
        indices: each env's index in the vector env (names the env in shared memory).
        autoreset_mode: the vector env's autoreset mode.
        shared_memory: gymnasium shared memory for fixed-shape observations, or ``None``;
            ``(buffer, num_envs)``, the buffer as made by ``create_shared_memory``.
        action_memory: gymnasium shared memory holding each env's action for ``"step_shared"``
            (``(buffer, num_envs)``), or ``None``.
        marker: optional ``(array, slot)``: ``array[slot]`` holds the index of the env being
            worked on (``IDLE`` between messages), so the parent can name the env that hung or
            killed the worker.
        timed_steps: time this many of each env's steps after its first :data:`TIMING_WARMUP_STEPS` (for
            ``"timings"``); 0: none.
        step_results: where a :data:`STEP_MESSAGE`'s answer leaves each env's reward and ends, or ``None``.

    Raises:
        BuildFailureError: an env function raised (``.failure`` says which one and why).
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Env[Any, Any]]],
        indices: Sequence[int],
        autoreset_mode: AutoresetMode,
        shared_memory: Any = None,
        marker: tuple[Any, int] | None = None,
        action_memory: Any = None,
        timed_steps: int = 0,
        step_results: StepResults | None = None,
    ) -> None:
        self.env_fns = list(env_fns)
        self.step_results = step_results
        self._step_items = [(position, "step_shared", None) for position in range(len(env_fns))]
        self.indices = list(indices)
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self._next_step = self.autoreset_mode == AutoresetMode.NEXT_STEP  # read per step: cheaper than the enum
        self._same_step = self.autoreset_mode == AutoresetMode.SAME_STEP
        self.shared_memory = shared_memory
        self.action_memory = action_memory
        self._action_rows: Any = None  # numpy views of the shared action rows, made once
        self._rows: Any = None  # numpy views of the shared observation rows, made once
        self.marker: Any
        self.slot: int
        self.marker, self.slot = marker if marker is not None else (None, 0)
        self.envs: list[Env[Any, Any]] = []
        self.autoreset = [False] * len(self.env_fns)  # NEXT_STEP: the env's next "step" resets it
        self.next_seed: list[int | None] = [None] * len(self.env_fns)  # seeds the next unseeded reset
        for position, fn in enumerate(self.env_fns):
            self._mark(position)
            try:
                self.envs.append(make_env(fn, self.indices[position]))
            except BaseException as exc:
                self.close()
                raise BuildFailureError(BuildFailure(position, error_payload(exc))) from exc
        self._mark(None)
        # (wall, cpu, ready-wait) seconds of each env's first `timed_steps` steps (`step_clock`); timing
        # stops once every env has them
        self.timings: list[list[tuple[float, float, float]]] = [[] for _ in self.envs]
        self._timed_steps = timed_steps
        self._untimed_left = [TIMING_WARMUP_STEPS] * len(self.envs)  # warm-up steps before the timed ones
        self._warming_s = [0.0] * len(self.envs)
        self._ready_start: float | None = None  # ready-wait seconds when timing began, and when it ended
        self._ready_end: float | None = None
        self._timing = timed_steps > 0

    def _mark(self, position: int | None) -> None:
        if self.marker is not None:
            self.marker[self.slot] = IDLE if position is None else self.indices[position]

    def handle(self, items: Sequence[tuple[int, str, Any]]) -> list[Any]:
        """Runs every item of one message; one result (or :class:`EnvFailure`) per item."""
        results: list[Any] = []
        published: list[tuple[int, int]] = []  # (result slot, env position) whose obs goes to shared memory
        shared = self.shared_memory is not None
        marker, indices = self.marker, self.indices
        result: Any
        for position, command, payload in items:
            if marker is not None:
                marker[self.slot] = indices[position]
            try:
                if command == "step":
                    result = self._step(position, payload)
                elif command == "step_shared":
                    result = self._step(position, self._shared_action(position))
                else:
                    result = self._run(position, command, payload)
            except Exception as exc:
                result = EnvFailure(error_payload(exc))
            else:
                if shared and command in _OBSERVING_COMMANDS:
                    published.append((len(results), position))
            results.append(result)
        if marker is not None:
            marker[self.slot] = IDLE
        if published:
            rows = self._observation_rows()
            split = isinstance(rows, dict)  # a Dict may have entries that go by pipe (pipe_part)
            for slot, position in published:
                result = results[slot]
                observation = result[0]
                try:
                    write_row(rows, indices[position], observation)
                except Exception as exc:
                    results[slot] = EnvFailure(error_payload(exc))
                    continue
                results[slot] = (pipe_part(rows, observation) if split else None, *result[1:])  # e.g. a Text entry
        return results

    def answer(self, payload: bytes) -> bytes:
        """The answer to one message as it arrived (:data:`STEP_MESSAGE` or a pickled item list), as bytes."""
        if payload != STEP_MESSAGE:
            return dumps((True, self.handle(pickle.loads(payload))))
        results = self.handle(self._step_items)
        step_results = self.step_results
        if step_results is not None and all(type(r) is tuple and r[0] is None and r[4] == {} for r in results):
            rewards, terminated, truncated = step_results.views()
            try:
                for index, (_, reward, ended, cut, _) in zip(self.indices, results):
                    rewards[index], terminated[index], truncated[index] = reward, ended, cut
            except (TypeError, ValueError):
                pass  # a reward numpy cannot take as a float: the answer carries it as it is
            else:
                return STEP_ANSWER
        return dumps((True, results))

    def _observation_rows(self) -> Any:
        """Numpy views of the shared observation rows (a Dict's fixed-shape entries, or all), made once."""
        if self._rows is None:
            buffer, num_envs = self.shared_memory
            space = shared_subspace(self.envs[0].observation_space)
            assert space is not None  # the group has shared memory only for spaces with a fixed-shape part
            self._rows = read_from_shared_memory(space, buffer, n=num_envs)
        return self._rows

    def step_all(self, actions: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any], list[Any], list[Any]]:
        """Steps every env of the group with its action, in order, and writes each observation to
        its shared row: the lockstep fast path of envs in the calling process (no message, no
        result per env: the loop ``SyncVectorEnv.step`` runs). Needs the whole observation in shared memory.

        Returns ``(rewards, terminations, truncations, infos, failures)``; ``failures`` lists
        ``(position, error payload)`` of the envs that raised (their other entries are placeholders).
        """
        rows = self._observation_rows()
        # a row of one array takes the observation as it is when it has the row's type, dtype and shape (what
        # write_row checks first, inline here); anything else goes through write_row's checks
        plain = type(rows) is np.ndarray
        row_dtype, row_shape = (rows.dtype, rows.shape[1:]) if plain else (None, None)
        rewards: list[Any] = []
        terminations: list[Any] = []
        truncations: list[Any] = []
        infos: list[Any] = []
        failures = []
        autoreset, indices, next_step, same_step = self.autoreset, self.indices, self._next_step, self._same_step
        timing = self._timing
        for position, (env, action) in enumerate(zip(self.envs, actions)):
            try:
                if timing:
                    observation, reward, terminated, truncated, info = self._timed_step(position, action)
                elif next_step and autoreset[position]:
                    observation, info = self._reset(position)
                    reward, terminated, truncated = 0.0, False, False
                    autoreset[position] = False
                else:  # _untimed_step, inline: this loop is the whole cost beside the envs' own steps
                    observation, reward, terminated, truncated, info = env.step(action)
                    autoreset[position] = bool(terminated or truncated)
                    if same_step and (terminated or truncated):
                        final_observation, final_info = observation, info
                        observation, reset_info = self._reset(position)
                        info = {"final_obs": final_observation, "final_info": final_info, **reset_info}
                if (
                    plain
                    and type(observation) is np.ndarray
                    and observation.dtype == row_dtype
                    and observation.shape == row_shape
                ):
                    rows[indices[position]] = observation
                else:
                    write_row(rows, indices[position], observation)
            except Exception as exc:
                failures.append((position, error_payload(exc)))
                reward, terminated, truncated, info = 0.0, False, False, {}
            rewards.append(reward)
            terminations.append(terminated)
            truncations.append(truncated)
            infos.append(info)
        return rewards, terminations, truncations, infos, failures

    def _shared_action(self, position: int) -> Any:
        """The action the parent wrote to this env's row of the shared action memory (a copy)."""
        if self._action_rows is None:
            buffer, num_envs = self.action_memory
            self._action_rows = read_from_shared_memory(self.envs[0].action_space, buffer, n=num_envs)
        return copy_row(self._action_rows, self.indices[position])

    def _run(self, position: int, command: str, payload: Any) -> Any:
        env = self.envs[position]
        if command == "step":
            return self._step(position, payload)
        if command == "reset":
            observation, info = self._reset(position, **payload)
            self.autoreset[position] = False
            return observation, info
        if command == "restart":
            return self._restart(position, **payload)
        if command == "call":
            name, args, kwargs = payload
            attr = env.get_wrapper_attr(name)
            return attr(*args, **kwargs) if callable(attr) else attr
        if command == "setattr":
            name, value = payload
            env.set_wrapper_attr(name, value)
            return None
        if command == "check_spaces":
            observation_mode, single_observation_space, single_action_space = payload
            same_obs = (
                single_observation_space == env.observation_space
                if observation_mode == "same"
                else is_space_dtype_shape_equiv(single_observation_space, env.observation_space)
            )
            return same_obs, single_action_space == env.action_space
        if command == "spaces":
            return env.observation_space, env.action_space, dict(env.metadata), env.render_mode
        if command == "probe":
            return time_steps(env)
        if command == "timings":
            return self._timings(position)
        # Bare RuntimeError: the parent sends only the commands above; another one is a bug in asyncvec.
        raise RuntimeError(f"unknown worker command {command!r}")

    def _step(self, position: int, action: Any) -> tuple[Any, ...]:
        if self._timing:  # the user's own first steps, timed for the placement advice (advice.py)
            return self._timed_step(position, action)
        return self._untimed_step(position, action)

    def _timed_step(self, position: int, action: Any) -> tuple[Any, ...]:
        # wall and CPU per step; the ready wait (schedstat: a file read, ~10 us) once per window, shared out by
        # wall time in `_timings`: read per step, it slowed the very steps the advice is about
        cpu, wall = time.process_time(), time.perf_counter()
        result = self._untimed_step(position, action)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if self._untimed_left[position] > 0:  # a new process's first steps (page faults, caches) say little
            self._warming_s[position] += wall
            warm = self._warming_s[position] >= TIMING_WARMUP_S
            self._untimed_left[position] = 0 if warm else self._untimed_left[position] - 1
            return result
        timings = self.timings[position]
        if len(timings) < self._timed_steps:
            if self._ready_start is None:
                self._ready_start = ready_wait_s()
            timings.append((wall, cpu, 0.0))
            self._timing = any(len(t) < self._timed_steps for t in self.timings)
            if not self._timing:
                self._ready_end = ready_wait_s()
        return result

    def _timings(self, position: int) -> list[tuple[float, float, float]]:
        """Env ``position``'s timed steps, (wall, CPU, ready-wait) each: the window's ready wait shared out
        among all the group's timed steps by their wall time."""
        if self._ready_start is None:
            return []
        ready = (self._ready_end if self._ready_end is not None else ready_wait_s()) - self._ready_start
        total = sum(wall for steps in self.timings for wall, _, _ in steps) or 1.0
        return [(wall, cpu, ready * wall / total) for wall, cpu, _ in self.timings[position]]

    def _untimed_step(self, position: int, action: Any) -> tuple[Any, ...]:
        reward: SupportsFloat
        if self._next_step and self.autoreset[position]:
            observation, info = self._reset(position)
            reward, terminated, truncated = 0.0, False, False
        else:
            observation, reward, terminated, truncated, info = self.envs[position].step(action)
            if self._same_step and (terminated or truncated):
                final_observation, final_info = observation, info
                observation, reset_info = self._reset(position)
                info = {"final_obs": final_observation, "final_info": final_info, **reset_info}
        self.autoreset[position] = bool(terminated or truncated)
        return observation, reward, terminated, truncated, info

    def _reset(self, position: int, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, ...]:
        """Resets one env; without a ``seed``, with the one a restart left for it, if any."""
        if seed is None:
            seed = self.next_seed[position]
        self.next_seed[position] = None
        return self.envs[position].reset(seed=seed, options=options)

    def _restart(self, position: int, rebuild: bool, then: str, arg: Any, seed: int | None = None) -> Any:
        if rebuild:
            try:
                self.envs[position].close()
            except Exception:
                pass  # the env is being replaced because it failed
            self.envs[position] = self.env_fns[position]()
            self.autoreset[position] = False
        if seed is not None:
            self.next_seed[position] = seed
        if then == "reset":
            return self._run(position, "reset", arg)
        if then == "autoreset":  # the episode had ended: this step is NEXT_STEP's reset step
            self.autoreset[position] = True
            return self._step(position, None)
        # "truncate": the interrupted episode ends at the last observation the caller saw.
        if self.autoreset_mode == AutoresetMode.SAME_STEP:
            observation, reset_info = self._reset(position)
            return observation, 0.0, False, True, {"final_obs": arg, "final_info": {}, **reset_info}
        self.autoreset[position] = True
        return arg, 0.0, False, True, {}

    def close(self) -> None:
        for env in self.envs:
            try:
                env.close()
            except Exception:
                pass
        self.envs = []


class BuildFailureError(Exception):
    """Raised by :class:`EnvGroup` when an env function fails; carries a :class:`BuildFailure`."""

    def __init__(self, failure: BuildFailure) -> None:
        self.failure = failure
        super().__init__(
            f"env at position {failure.position} failed to build: {failure.payload[0]}: {failure.payload[1]}"
        )


def _exit_when_orphaned(parent_pid: int) -> None:
    """Ends the worker once its parent is gone (e.g. SIGKILLed), so no worker lingers.

    A side thread rather than a poll before each command: polling the pipe costs a
    syscall per step on the hot path.
    """
    while True:
        time.sleep(_PARENT_CHECK_S)
        if os.getppid() != parent_pid:
            os._exit(0)


def run_worker(
    env_fns: Sequence[Callable[[], Env[Any, Any]]],
    indices: Sequence[int],
    pipes: tuple[Connection, Connection],
    parent_pipes: tuple[Connection, Connection] | None,
    shared_memory: Any,
    autoreset_mode: AutoresetMode,
    marker: tuple[Any, int],
    parent_pid: int,
    action_memory: Any = None,
    timed_steps: int = 0,
    step_results: StepResults | None = None,
) -> None:
    """A worker process: builds its envs, answers ``(True, results)`` per message until ``None`` (close).

    Messages travel as frames (:func:`read_frame`): :data:`STEP_MESSAGE`, or bytes made by :func:`dumps`.

    A failure to build answers ``(False, BuildFailure)`` and exits.
    """
    # Ctrl-C reaches the whole process group; the parent decides how to shut workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent_pipes is not None:  # the parent's ends, inherited by a fork
        for end in parent_pipes:
            end.close()
    receiver, pipe = pipes
    try:
        group = EnvGroup(
            env_fns, indices, autoreset_mode, shared_memory, marker, action_memory, timed_steps, step_results
        )
    except BuildFailureError as exc:
        pipe.send_bytes(dumps((False, exc.failure)))
        pipe.close()
        receiver.close()
        return
    pipe.send_bytes(dumps((True, None)))  # ready
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    fd, reply_fd = receiver.fileno(), pipe.fileno()
    stop = dumps(None)
    try:
        while True:
            payload = read_frame(fd)
            if payload == stop:
                write_frame(reply_fd, dumps((True, None)))
                return
            write_frame(reply_fd, group.answer(payload))
    except (EOFError, BrokenPipeError, OSError):
        return  # the parent went away
    finally:
        group.close()
        pipe.close()
        receiver.close()
