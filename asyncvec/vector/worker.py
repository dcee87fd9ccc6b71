"""The loop each sub-environment runs in its own process.

Protocol: the parent sends ``(command, payload)`` tuples over a pipe; the worker answers each
with ``(True, result)`` or ``(False, (exc_type_name, message, traceback, pickled_exception))``.
Observations of fixed-shape spaces are written to shared memory and sent as ``None``.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector.utils import write_to_shared_memory
from gymnasium.vector.vector_env import AutoresetMode

# How often a worker checks that its parent is still alive.
_PARENT_CHECK_S = 1.0


def _exit_when_orphaned(parent_pid: int) -> None:
    """Ends the worker once its parent is gone (e.g. SIGKILLed), so no worker lingers.

    A side thread rather than a poll before each command: polling the pipe costs a
    syscall per step on the hot path.
    """
    while True:
        time.sleep(_PARENT_CHECK_S)
        if os.getppid() != parent_pid:
            os._exit(0)


def _error_payload(exc: BaseException) -> tuple[str, str, str, bytes | None]:
    try:
        pickled = pickle.dumps(exc)
    except Exception:
        pickled = None
    return type(exc).__name__, str(exc), traceback.format_exc(), pickled


def run_worker(
    index: int,
    env_fn: Callable[[], Any],
    pipe: Connection,
    parent_pipe: Connection | None,
    shared_memory: Any,
    autoreset_mode: AutoresetMode,
    needs_reset: bool,
    parent_pid: int,
) -> None:
    """Build the env and serve commands until ``close`` or the parent disappears."""
    # Ctrl-C reaches the whole process group; the parent decides how to shut workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent_pipe is not None:
        parent_pipe.close()
    env = None
    try:
        env = env_fn()
    except BaseException as exc:  # report the failure to build the env, then exit
        pipe.send((False, _error_payload(exc)))
        pipe.close()
        return
    pipe.send((True, None))  # ready
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()

    observation_space = env.observation_space
    autoreset = needs_reset  # NEXT_STEP: the next "step" command resets instead

    def publish(observation: Any) -> Any:
        if shared_memory is None:
            return observation
        write_to_shared_memory(observation_space, index, observation, shared_memory)
        return None

    try:
        while True:
            command, data = pipe.recv()
            try:
                if command == "step":
                    if autoreset_mode == AutoresetMode.NEXT_STEP and autoreset:
                        observation, info = env.reset()
                        reward, terminated, truncated = 0.0, False, False
                    else:
                        observation, reward, terminated, truncated, info = env.step(data)
                        if autoreset_mode == AutoresetMode.SAME_STEP and (terminated or truncated):
                            final_observation, final_info = observation, info
                            observation, reset_info = env.reset()
                            info = {"final_obs": final_observation, "final_info": final_info, **reset_info}
                    autoreset = bool(terminated or truncated)
                    pipe.send((True, (publish(observation), reward, terminated, truncated, info)))
                elif command == "reset":
                    observation, info = env.reset(**data)
                    autoreset = False
                    pipe.send((True, (publish(observation), info)))
                elif command == "call":
                    name, args, kwargs = data
                    attr = env.get_wrapper_attr(name)
                    pipe.send((True, attr(*args, **kwargs) if callable(attr) else attr))
                elif command == "setattr":
                    name, value = data
                    env.set_wrapper_attr(name, value)
                    pipe.send((True, None))
                elif command == "check_spaces":
                    observation_mode, single_observation_space, single_action_space = data
                    same_obs = (
                        single_observation_space == observation_space
                        if observation_mode == "same"
                        else is_space_dtype_shape_equiv(single_observation_space, observation_space)
                    )
                    pipe.send((True, (same_obs, single_action_space == env.action_space)))
                elif command == "close":
                    pipe.send((True, None))
                    return
                else:
                    raise RuntimeError(f"unknown worker command {command!r}")
            except Exception as exc:
                pipe.send((False, _error_payload(exc)))
    except (EOFError, BrokenPipeError, OSError):
        return  # the parent went away
    finally:
        if env is not None:
            try:
                env.close()
            except Exception:
                pass
        pipe.close()
