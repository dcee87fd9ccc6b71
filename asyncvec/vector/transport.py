"""How the vector env reaches its workers: a ``Backend`` builds a ``Transport`` of messages.

The vector env holds the semantics (``AsyncLLMVectorEnv``'s lockstep and partial-batch APIs,
autoreset, and in :mod:`~asyncvec.vector.dispatch` and :mod:`~asyncvec.vector.faults` the
messages, timeouts and restarts); a transport only moves messages to the workers and back and
restarts a worker when asked. Three transports exist: :class:`ProcessTransport` (worker
processes on this machine, pipes and shared memory), :class:`InProcessTransport` (the envs in
the calling process, for envs far cheaper than a pipe round trip) and the Ray transport in
``asyncvec.distributed.ray_env`` (Ray actors, on any node of a cluster). Each hosts an
:class:`~asyncvec.vector.worker.EnvGroup` per worker.

A worker answers its messages in the order they were sent, so each worker is a FIFO: the
vector env may send a worker a second message before the first is answered.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gymnasium import Env, Space
from gymnasium.vector.utils import CloudpickleWrapper, clear_mpi_env_vars, create_shared_memory
from gymnasium.vector.vector_env import AutoresetMode

from asyncvec.vector.worker import (
    IDLE,
    STEP_ANSWER,
    STEP_MESSAGE,
    BuildFailureError,
    EnvGroup,
    StepResults,
    dumps,
    read_frame,
    run_worker,
    write_frame,
)

__all__ = [
    "Backend",
    "InProcessBackend",
    "InProcessTransport",
    "ProcessBackend",
    "ProcessTransport",
    "Transport",
    "WorkerSpec",
    "usable_cores",
]


@dataclass(frozen=True)
class WorkerSpec:
    """What every transport needs to start the workers.

    Attributes:
        env_fns: one function per env of the vector env.
        groups: the env indices each worker hosts (``groups[w]``); every env in exactly one group.
        autoreset_mode: the vector env's autoreset mode, applied inside the workers.
        shared_memory: the buffer made by :meth:`Backend.create_shared_memory`, or ``None``.
        action_memory: shared memory for one action per env (fixed-shape action spaces, worker
            processes), or ``None``: actions then travel with the message.
        timed_steps: each env times this many of its first steps (:mod:`~asyncvec.vector.advice`).
        start_timeout: seconds a worker may take to start; a backend whose start does not return
            within it (a cluster that stopped answering) raises, naming the backend and the stage.
    """

    env_fns: Sequence[Callable[[], Env[Any, Any]]]
    groups: Sequence[Sequence[int]]
    autoreset_mode: AutoresetMode
    shared_memory: Any = None
    action_memory: Any = None
    timed_steps: int = 0
    start_timeout: float = 60.0

    @property
    def num_envs(self) -> int:
        return len(self.env_fns)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells it, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class Transport(ABC):
    """Moves messages between the vector env and its workers (see the module docstring).

    A reply is ``(True, results)`` (one result per item of the message) or ``(False, payload)``
    when the worker is gone: ``payload = (exc_type, message, traceback, pickled)``.
    """

    #: Whether :meth:`wake` ends a :meth:`wait` in another thread at once (otherwise that wait
    #: runs to its timeout).
    wakeable: bool = False

    def wake(self) -> None:
        """Ends a :meth:`wait` blocked in another thread at once (it returns no worker); thread-safe.
        A wake while nobody waits ends the next wait at once. Nothing unless :attr:`wakeable`."""

    @abstractmethod
    def await_ready(self, worker: int, timeout: float) -> tuple[bool, Any]:
        """Waits until ``worker`` has built its envs: ``(True, None)``, or ``(False, BuildFailure | payload)``."""

    @abstractmethod
    def send(self, worker: int, message: list[tuple[int, str, Any]]) -> None:
        """Sends one message; never blocks on the worker and never raises for a dead one."""

    @abstractmethod
    def wait(self, workers: Sequence[int], timeout: float | None) -> list[int]:
        """Those of ``workers`` (each with a message outstanding) whose next reply is ready."""

    @abstractmethod
    def read(self, worker: int) -> tuple[bool, Any]:
        """The worker's next reply, blocking; a dead worker reads as ``(False, payload)``, never as a hang."""

    def read_many(self, workers: Sequence[int]) -> list[tuple[bool, Any]]:
        """:meth:`read` for several workers (a transport may fetch them in one call)."""
        return [self.read(worker) for worker in workers]

    @abstractmethod
    def kill(self, worker: int) -> None:
        """Stops a hung worker at once; its outstanding messages are lost."""

    @abstractmethod
    def restart(self, worker: int) -> None:
        """Brings back a worker that died or was killed (fresh envs); :meth:`await_ready` follows."""

    def culprit(self, worker: int) -> int | None:
        """The env the worker was working on when it died or hung, if the transport can tell."""
        return None

    @abstractmethod
    def close(self, timeout: float | None, terminate: bool) -> None:
        """Stops every worker (killing those that do not stop within ``timeout``)."""

    def pid(self, worker: int) -> int | None:
        """The worker's process id, if known."""
        return None

    def node(self, worker: int) -> str | None:
        """The cluster node the worker runs on (``None`` for this machine)."""
        return None


class Backend(ABC):
    """Builds the transport of a vector env; pass one as ``AsyncLLMVectorEnv(backend=...)``."""

    #: Whether the workers run on this machine (then the parent builds one throwaway env to
    #: read the spaces, and fixed-shape observations may travel through shared memory).
    local: bool = True

    def create_shared_memory(self, space: Space[Any], n: int) -> Any:
        """Shared memory for ``n`` observations of ``space``, or ``None`` when the workers cannot reach it."""
        return None

    def parallelism(self) -> int:
        """How many CPU-bound workers can run at once (the placement rule's ``cores``): this machine's usable cores."""
        return usable_cores()

    @abstractmethod
    def create(self, spec: WorkerSpec) -> Transport:
        """Starts the workers (without waiting for them) and returns their transport."""


@dataclass
class ProcessBackend(Backend):
    """Worker processes on this machine (the default backend).

    Args:
        context: multiprocessing start method (``"fork"``, ``"spawn"``, ``"forkserver"``).
        daemon: start workers as daemon processes.
    """

    context: str | None = None
    daemon: bool = True

    def __post_init__(self) -> None:
        self._ctx = multiprocessing.get_context(self.context)

    def create_shared_memory(self, space: Space[Any], n: int) -> Any:
        return create_shared_memory(space, n=n, ctx=self._ctx)

    def create(self, spec: WorkerSpec) -> ProcessTransport:
        return ProcessTransport(spec, self._ctx, self.daemon)


_STEP_FRAME = struct.pack("!i", len(STEP_MESSAGE)) + STEP_MESSAGE


class ProcessTransport(Transport):
    """One process per worker, a pipe each, fixed-shape observations in shared memory.

    A step of every env of a worker with its actions in shared memory travels as one byte each way
    (:data:`~asyncvec.vector.worker.STEP_MESSAGE`), rewards and ends in :class:`~asyncvec.vector.worker.StepResults`;
    everything else as pickled frames.
    """

    wakeable = True

    def __init__(self, spec: WorkerSpec, ctx: Any, daemon: bool) -> None:
        self.spec = spec
        self._owner_pid = os.getpid()  # a forked copy of this transport (a child of the user's) owns no worker
        # wake(): a byte written here ends wait(), which watches the read end with the workers' pipes
        self._wake_write: int | None  # None once close() closed the pipe
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._wake_lock = threading.Lock()  # no write to the descriptor once close() released it
        # wait() keeps one poll object and registers only the descriptors that changed since its last
        # call (a wait per env result: building a selector of every busy pipe each time cost more
        # than the poll itself). poll() holds no kernel state: a closed or reused descriptor is safe.
        self._poller = select.poll()
        self._polled: dict[int, int] = {}  # descriptor -> worker, as registered in the poller
        self._ctx = ctx
        self._daemon = daemon
        # Which env each worker is working on: names the env that hung or killed its worker.
        self._marker = ctx.RawArray("i", [IDLE] * len(spec.groups))
        self._processes: list[Any] = [None] * len(spec.groups)
        # one pipe each way per worker (cheaper than a duplex socket pair: 30 against 58 us of this process's
        # CPU for a lockstep step of 8 one-byte messages, measured here); _pipes: the replies' read ends
        self._pipes: list[Any] = [None] * len(spec.groups)
        self._senders: list[Any] = [None] * len(spec.groups)
        self._fds: list[int] = [-1] * len(spec.groups)  # the replies' read descriptors
        self._send_fds: list[int] = [-1] * len(spec.groups)
        # compact steps need each action and observation in shared memory
        compact = spec.action_memory is not None and spec.shared_memory is not None
        self._step_results = StepResults(ctx, spec.num_envs) if compact else None
        # the message of a step of every env of a worker, with its actions in shared memory (then sent as one byte)
        self._step_messages = [[(p, "step_shared", None) for p in range(len(group))] for group in spec.groups]
        with clear_mpi_env_vars():
            for worker in range(len(spec.groups)):
                self._start(worker, spec.timed_steps)

    def _start(self, worker: int, timed_steps: int = 0) -> None:
        indices = list(self.spec.groups[worker])
        child_reader, parent_sender = self._ctx.Pipe(duplex=False)
        parent_reader, child_sender = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(
            target=run_worker,
            name=f"Worker<AsyncLLMVectorEnv>-{worker}",
            args=(
                [CloudpickleWrapper(self.spec.env_fns[i]) for i in indices],
                indices,
                (child_reader, child_sender),
                (parent_reader, parent_sender),
                None if self.spec.shared_memory is None else (self.spec.shared_memory, self.spec.num_envs),
                self.spec.autoreset_mode,
                (self._marker, worker),
                os.getpid(),
                None if self.spec.action_memory is None else (self.spec.action_memory, self.spec.num_envs),
                timed_steps,
                self._step_results,
            ),
            daemon=self._daemon,
        )
        self._marker[worker] = IDLE
        process.start()
        child_reader.close()
        child_sender.close()
        self._processes[worker], self._pipes[worker], self._senders[worker] = process, parent_reader, parent_sender
        self._fds[worker], self._send_fds[worker] = parent_reader.fileno(), parent_sender.fileno()

    @property
    def compact_steps(self) -> bool:
        """Whether :meth:`send_steps` is available (actions and observations in shared memory)."""
        return self._step_results is not None

    def send_steps(self, workers: Sequence[int]) -> None:
        """Sends each of ``workers`` a step of every env it hosts, actions already in shared memory (one byte)."""
        frame = _STEP_FRAME
        for worker in workers:
            try:
                os.write(self._send_fds[worker], frame)
            except OSError:
                pass  # the next read sees EOF and reports the dead worker

    def read_step(self, worker: int) -> tuple[bool, Any] | None:
        """:meth:`read`, except that :data:`~asyncvec.vector.worker.STEP_ANSWER` reads as ``None``: the steps'
        results are in :attr:`step_results` and shared memory."""
        try:
            payload = read_frame(self._fds[worker])
        except (EOFError, OSError):
            return self.read(worker)  # reports the dead worker
        if payload == STEP_ANSWER:
            return None
        answer: tuple[bool, Any] = pickle.loads(payload)
        return answer

    @property
    def step_results(self) -> StepResults | None:
        """Each env's last reward and ends, for answers that came as ``STEP_ANSWER``."""
        return self._step_results

    def await_ready(self, worker: int, timeout: float) -> tuple[bool, Any]:
        if not self._pipes[worker].poll(timeout):
            return False, ("StartTimeout", f"the worker did not build its envs within {timeout} s", "", None)
        return self.read(worker)

    def send(self, worker: int, message: list[tuple[int, str, Any]] | None) -> None:  # None: stop
        compact = self._step_results is not None and message == self._step_messages[worker]
        try:
            write_frame(self._send_fds[worker], STEP_MESSAGE if compact else dumps(message))
        except OSError:
            pass  # the next read sees EOF and reports the dead worker

    def wait(self, workers: Sequence[int], timeout: float | None) -> list[int]:
        wanted = {self._pipes[w].fileno(): w for w in workers}
        wanted[self._wake_read] = -1
        polled, poller = self._polled, self._poller
        if wanted != polled:
            for fd in [fd for fd in polled if fd not in wanted]:
                poller.unregister(fd)
                del polled[fd]
            for fd, worker in wanted.items():
                if polled.get(fd) != worker:
                    poller.register(fd, select.POLLIN)  # a dead worker's pipe reports POLLHUP: read() sees EOF
                    polled[fd] = worker
        events = poller.poll(None if timeout is None else max(timeout, 0.0) * 1000.0)
        ready = []
        for fd, _ in events:
            worker = polled[fd]
            if worker >= 0:
                ready.append(worker)
                continue
            try:
                os.read(self._wake_read, 4096)  # every wake so far: one return
            except BlockingIOError:
                pass
        return ready

    def wake(self) -> None:
        with self._wake_lock:
            if self._wake_write is None:
                return
            try:
                os.write(self._wake_write, b"\0")
            except BlockingIOError:
                pass  # the pipe is full: a wake is pending anyway

    def read(self, worker: int) -> tuple[bool, Any]:
        try:
            payload = read_frame(self._fds[worker])
            if payload == STEP_ANSWER:
                assert self._step_results is not None  # only an answer to STEP_MESSAGE is STEP_ANSWER
                return True, [self._step_results.result(index) for index in self.spec.groups[worker]]
            answer: tuple[bool, Any] = pickle.loads(payload)
            return answer
        except (EOFError, OSError):
            process = self._processes[worker]
            process.join(timeout=1.0)
            code = process.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return False, ("WorkerDied", f"worker process died ({how})", "", None)

    def culprit(self, worker: int) -> int | None:
        index = self._marker[worker]
        return None if index == IDLE else int(index)

    def kill(self, worker: int) -> None:
        process = self._processes[worker]
        if process.is_alive():
            process.kill()
        process.join(timeout=5.0)
        self._pipes[worker].close()
        self._senders[worker].close()

    def restart(self, worker: int) -> None:
        self.kill(worker)
        with clear_mpi_env_vars():
            self._start(worker)

    def close(self, timeout: float | None, terminate: bool) -> None:
        if os.getpid() != self._owner_pid:  # e.g. the vector env's __del__ in a process the user forked
            return
        started = [w for w, p in enumerate(self._processes) if p is not None]
        if not terminate:
            for w in started:
                if self._processes[w].is_alive() and not self._pipes[w].closed:
                    self.send(w, None)
        deadline = (
            None
            if timeout is None and not terminate
            else time.monotonic() + (timeout if not terminate and timeout else 0.0)
        )
        for w in started:
            process = self._processes[w]
            process.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
            self._pipes[w].close()
            self._senders[w].close()
        with self._wake_lock:
            if self._wake_write is not None:
                os.close(self._wake_read)
                os.close(self._wake_write)
                self._wake_write = None

    def pid(self, worker: int) -> int | None:
        pid: int | None = self._processes[worker].pid
        return pid


class InProcessBackend(Backend):
    """Every env in the calling process, stepped one after another when its message is sent.

    For envs whose step is far cheaper than a message to a worker process (the placement rule
    of :mod:`asyncvec.vector.placement` picks it). No isolation: an env that crashes the process
    crashes the caller, and a step cannot be interrupted (so no ``step_timeout``); an env that
    raises is still reported and restarted like a worker's.
    """

    def create_shared_memory(self, space: Space[Any], n: int) -> Any:
        # Plain process memory that the envs write and the vector env reads, as with workers.
        return create_shared_memory(space, n=n, ctx=multiprocessing.get_context())

    def create(self, spec: WorkerSpec) -> InProcessTransport:
        return InProcessTransport(spec)


class InProcessTransport(Transport):
    """Hosts each worker's :class:`EnvGroup` in this process: :meth:`send` runs the message and
    keeps its reply for :meth:`read`. Thread-safe as the vector env uses it (one caller at a time
    sends; another may wait)."""

    wakeable = True

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self._groups: list[EnvGroup | None] = [None] * len(spec.groups)
        self._ready: list[tuple[bool, Any]] = [(True, None)] * len(spec.groups)
        self._replies: list[deque[tuple[bool, Any]]] = [deque() for _ in spec.groups]
        self._changed = threading.Condition()
        self._woken = False
        for worker in range(len(spec.groups)):
            self._start(worker)

    def _start(self, worker: int) -> None:
        indices = list(self.spec.groups[worker])
        memory = None if self.spec.shared_memory is None else (self.spec.shared_memory, self.spec.num_envs)
        try:
            group = EnvGroup(
                [self.spec.env_fns[i] for i in indices],
                indices,
                self.spec.autoreset_mode,
                memory,
                timed_steps=self.spec.timed_steps,
            )
        except BuildFailureError as exc:
            self._groups[worker], self._ready[worker] = None, (False, exc.failure)
        else:
            self._groups[worker], self._ready[worker] = group, (True, None)

    def await_ready(self, worker: int, timeout: float) -> tuple[bool, Any]:
        return self._ready[worker]

    def step_all(
        self, worker: int, actions: Sequence[Any]
    ) -> tuple[list[Any], list[Any], list[Any], list[Any], list[Any]]:
        """:meth:`EnvGroup.step_all` of the worker's envs: a lockstep step without a message."""
        group = self._groups[worker]
        assert group is not None  # steps reach only a group that was built
        return group.step_all(actions)

    def send(self, worker: int, message: list[tuple[int, str, Any]]) -> None:
        group = self._groups[worker]
        if message is None or group is None:
            return
        reply = (True, group.handle(message))
        with self._changed:
            self._replies[worker].append(reply)
            self._changed.notify_all()

    def wait(self, workers: Sequence[int], timeout: float | None) -> list[int]:
        with self._changed:
            ready = [w for w in workers if self._replies[w]]
            if not ready and not self._woken:
                self._changed.wait(timeout)
                ready = [w for w in workers if self._replies[w]]
            self._woken = False
            return ready

    def wake(self) -> None:
        with self._changed:
            self._woken = True
            self._changed.notify_all()

    def read(self, worker: int) -> tuple[bool, Any]:
        with self._changed:
            return self._replies[worker].popleft()

    def kill(self, worker: int) -> None:
        self._replies[worker].clear()

    def restart(self, worker: int) -> None:
        group = self._groups[worker]
        if group is not None:
            group.close()
        self._replies[worker].clear()
        self._start(worker)

    def close(self, timeout: float | None, terminate: bool) -> None:
        for worker, group in enumerate(self._groups):
            if group is not None:
                group.close()
            self._groups[worker] = None
